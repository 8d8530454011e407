"""Long-context evaluation on the training mesh: passkey retrieval (needle in a haystack) and perplexity.

``python -m lctrain eval`` (``lctrain.eval.run``); see ``docs/evaluation.md``.
"""

from lctrain.eval.passkey import PasskeySample, passkey_sample, passkey_text, sample_key

__all__ = ["PasskeySample", "passkey_sample", "passkey_text", "sample_key"]
