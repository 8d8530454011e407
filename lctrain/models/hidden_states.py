"""The final hidden states of a Hugging Face causal LM, computed through its full forward but without logits.

The loss (``lctrain.train.loss``) and the evaluator compute logits themselves, a chunk of tokens or only the
labelled positions at a time, from the final hidden states and the LM head. The model is still called as a whole:
FSDP gathers the root's parameters (embeddings, final norm, LM head) in the root module's forward and keeps them for
its backward, so the base model cannot be called on its own. ``logits_to_keep`` empty makes the LM head compute
nothing, and a forward hook on the base model keeps the hidden states it returns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class FinalHiddenStates:
    """``FinalHiddenStates(model)(input_ids, position_ids, cu_seqlens)`` -> ``[B, S_local, hidden]``."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._hidden: Tensor | None = None
        model.model.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._hidden = output.last_hidden_state

    def __call__(
        self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, doc_prefix: Tensor | None = None
    ) -> Tensor:
        """``input_ids``, ``position_ids`` ``[B, S_local]`` on the model's device: this rank's shard, with global
        positions (RoPE is right on every shard); ``cu_seqlens`` the document bounds of the global row and
        ``doc_prefix`` each document's shared prefix (-1: none; None: no document has one), on the host: the
        attention plans its blocks from them."""
        self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            cu_seq_lens_q=cu_seqlens,
            doc_prefix=doc_prefix,
            logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),  # no host-to-device copy
        )
        hidden, self._hidden = self._hidden, None
        return hidden
