"""The patched attention on one process: its refusals, the sliding window reaching it from the layer, shared
prefixes, the registered implementation it selects (the parity on several ranks:
tests/distributed/test_model_parity.py)."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from lctrain.models import patch_attention


def tiny(model_cls, config_cls, **overrides):  # noqa: ANN001, ANN003, ANN201
    config = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        **overrides,
    )
    return model_cls(config)


def test_patched_model_refuses_what_it_cannot_do_exactly() -> None:
    ids = torch.randint(0, 50, (1, 16))
    model = tiny(LlamaForCausalLM, LlamaConfig, attention_dropout=0.1)
    patch_attention(model, ulysses_group=None, ring_group=None)
    model.train()
    with pytest.raises(ValueError, match="attention dropout=0.1 is not supported"):
        model(input_ids=ids)


def test_patched_model_keeps_the_sliding_window() -> None:
    """The layer's sliding_window reaches USP attention as its window: logits equal the plain model's (sdpa with
    transformers' own sliding-window mask), and differ from the same model without a window."""
    ids = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    plain = tiny(MistralForCausalLM, MistralConfig, sliding_window=5, attn_implementation="sdpa")
    patched = copy.deepcopy(plain)
    patch_attention(patched, ulysses_group=None, ring_group=None)
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
        torch.testing.assert_close(patched(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        plain.config.sliding_window = None
        assert (plain(input_ids=ids).logits - expected).abs().max() > 1e-3


def test_patch_selects_the_registered_implementation() -> None:
    model = tiny(LlamaForCausalLM, LlamaConfig)
    name = patch_attention(model, ulysses_group=None, ring_group=None, layout="contiguous")
    assert model.config._attn_implementation == name == "lctrain_usp:contiguous:none:none"


@pytest.mark.parametrize("window", [None, 6])
def test_patched_model_passes_shared_prefixes(window: int | None) -> None:
    """``doc_prefix`` given to the model reaches USP attention: a packed pair [prompt | chosen | rejected] (the
    answers' positions continuing the prompt's) gives each answer the logits the plain model gives it after its
    own copy of the prompt."""
    torch.manual_seed(0)
    plain = tiny(MistralForCausalLM, MistralConfig, sliding_window=window, attn_implementation="sdpa")
    patched = copy.deepcopy(plain)
    patch_attention(patched, ulysses_group=None, ring_group=None)
    prompt, chosen, rejected = (
        torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 4, 5)
    )
    positions = torch.cat([torch.arange(13), torch.arange(9, 14)])[None]
    with torch.no_grad():
        shared = patched(
            input_ids=torch.cat([prompt, chosen, rejected], dim=1),
            position_ids=positions,
            cu_seq_lens_q=torch.tensor([0, 9, 13, 18], dtype=torch.int32),
            doc_prefix=torch.tensor([-1, 0, 0]),
        ).logits
        for answer, rows in ((chosen, slice(9, 13)), (rejected, slice(13, 18))):
            expected = plain(input_ids=torch.cat([prompt, answer], dim=1)).logits
            torch.testing.assert_close(shared[:, rows], expected[:, 9:], atol=1e-5, rtol=0)
            torch.testing.assert_close(shared[:, :9], expected[:, :9], atol=1e-5, rtol=0)
