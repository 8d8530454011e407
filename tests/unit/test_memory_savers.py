"""Memory savers on one process: the chunked MLP (``lctrain.parallel.chunked_mlp``) computes what the plain MLP
computes and keeps only its input for the backward; activation offload
(``lctrain.parallel.activation_checkpointing``) sends exactly the checkpointed layers' inputs through its
pack/unpack hooks, frees the device copy, copies each input back one layer ahead of its use, and changes no result
(the CUDA copies replaced by clones on the CPU; ``tests/gpu/test_cuda_memory.py`` runs the streams); ``check_job``
refuses offload without checkpointing.

Tolerances (fp32): chunked vs plain outputs and gradients within 1e-6 absolute + 1e-6 relative (the chunks change
only the order in which weight gradients are summed over tokens); offload on a CPU device changes nothing at all
(compared exactly).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from lctrain.config import check_job, load_config
from lctrain.models import ModelConfig, build_empty_model, materialize, model_config, random_init_source
from lctrain.models.hf import hf_name
from lctrain.parallel.activation_checkpointing import HostOffload, Offloaded, apply_activation_checkpointing
from lctrain.parallel.chunked_mlp import apply_chunked_mlp, chunked_mlp

VOCAB = 97
HIDDEN, INTERMEDIATE, LAYERS = 32, 88, 3
TIGHT = {"atol": 1e-6, "rtol": 1e-6}


def tiny_model() -> nn.Module:
    cfg = ModelConfig(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_layers=LAYERS, num_heads=4, num_kv_heads=2
    )
    config = model_config(cfg, VOCAB)
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed=0), torch.device("cpu"))
    return model.train()


def loss_and_grads(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {hf_name(name): param.grad.clone() for name, param in model.named_parameters()}


def tokens(batch: int = 2, seq: int = 45) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------------------------
# Chunked MLP
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens", [1, 9, 15, 16, 90, 1000], ids=lambda c: f"chunk{c}")
def test_chunked_mlp_matches_plain_mlp_outputs_and_gradients(chunk_tokens: int) -> None:
    """[2, 45] tokens = 90: chunks of 9, 15 and 90 divide it, 16 does not (last chunk 10), 1000 is one chunk."""
    mlp = tiny_model().model.layers[0].mlp
    x = torch.randn(2, 45, HIDDEN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    grad_out = torch.randn(2, 45, HIDDEN, generator=torch.Generator().manual_seed(3))

    def run(module: nn.Module) -> tuple[torch.Tensor, ...]:
        x.grad = None
        module.zero_grad(set_to_none=True)
        out = module(x)
        out.backward(grad_out)
        return out.detach(), x.grad.clone(), *(p.grad.clone() for p in mlp.parameters())

    expected = run(mlp)
    wrapped = chunked_mlp(mlp, chunk_tokens)  # shares mlp's parameters
    result = run(wrapped)
    assert result[0].shape == (2, 45, HIDDEN)
    for got, want in zip(result, expected):
        torch.testing.assert_close(got, want, **TIGHT)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), expected[0], **TIGHT)


def saved_elements(fn, *args) -> int:
    """Elements of the tensors autograd keeps from ``fn(*args)``'s forward for its backward (one per storage)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes() // tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(*args)
    return sum(storages.values())


def test_chunked_mlp_keeps_only_its_input_for_the_backward() -> None:
    """The plain MLP keeps several [tokens, intermediate] tensors; the chunked one only the (shared) input
    [tokens, hidden]: its intermediates are recomputed one chunk at a time in the backward."""
    mlp = tiny_model().model.layers[0].mlp
    x = torch.randn(1, 64, HIDDEN, requires_grad=True)
    tokens_hidden, tokens_intermediate = 64 * HIDDEN, 64 * INTERMEDIATE
    assert saved_elements(mlp, x) >= tokens_hidden + 3 * tokens_intermediate
    assert saved_elements(chunked_mlp(mlp, 16), x) == tokens_hidden


def test_apply_chunked_mlp_keeps_names_and_results_and_composes_with_checkpointing() -> None:
    plain, chunked = tiny_model(), tiny_model()
    apply_chunked_mlp(chunked.model.layers, 0)  # off: nothing changes
    assert [n for n, _ in chunked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    apply_chunked_mlp(chunked.model.layers, 16)
    apply_activation_checkpointing(chunked.model.layers, "full")
    apply_chunked_mlp(chunked.model.layers, 16)  # again, after checkpointing: no second wrapper
    assert all(n.count("_checkpoint_wrapped_module") == 2 for n, _ in chunked.named_parameters() if ".mlp." in n)
    assert [hf_name(n) for n, _ in chunked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(chunked.state_dict()) == list(plain.state_dict())  # torch's wrapper strips its prefix
    ids = tokens()
    loss, grads = loss_and_grads(chunked, ids)
    ref_loss, ref_grads = loss_and_grads(plain, ids)
    torch.testing.assert_close(loss, ref_loss, **TIGHT)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def test_apply_chunked_mlp_on_a_pipeline_stage_dict() -> None:
    model = tiny_model()
    stage_layers = nn.ModuleDict({"1": model.model.layers[1], "2": model.model.layers[2]})
    apply_chunked_mlp(stage_layers, 8)
    assert all(layer.mlp is not model.model.layers[0].mlp for layer in stage_layers.values())
    assert "_checkpoint_wrapped_module" not in "".join(n for n, _ in model.model.layers[0].named_parameters())
    assert all("mlp._checkpoint_wrapped_module." in n for n, _ in stage_layers.named_parameters() if ".mlp" in n)


def test_apply_chunked_mlp_names_the_setting_for_a_layer_without_mlp() -> None:
    with pytest.raises(TypeError, match="parallel.mlp_chunk_tokens=0"):
        apply_chunked_mlp(nn.ModuleList([nn.Linear(2, 2)]), 4)


# ---------------------------------------------------------------------------------------------------------------
# Activation offload
# ---------------------------------------------------------------------------------------------------------------


class CountingHooks:
    """Wraps ``HostOffload``'s hooks to record the shapes they see. ``device=True`` makes the CPU play the device:
    every tensor is "offloaded", the copies are clones, and ``ops`` records each copy and each use in order
    (``("host", i)``, ``("device", i)``, ``("use", i)`` for the i-th packed tensor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, device: bool = False):
        self.packed: list[tuple[int, ...]] = []
        self.unpacked: list[tuple[int, ...]] = []
        self.same_tensor: list[bool] = []
        self.ops: list[tuple[str, int]] = []
        self.hosts: list[torch.Tensor] = []
        pack, unpack = HostOffload.pack, HostOffload.unpack

        def counting_pack(offload: HostOffload, tensor: torch.Tensor) -> object:
            self.packed.append(tuple(tensor.shape))
            stored = pack(offload, tensor)
            self.same_tensor.append(stored is tensor)
            return stored

        def counting_unpack(offload: HostOffload, packed: object) -> torch.Tensor:
            tensor = unpack(offload, packed)
            self.unpacked.append(tuple(tensor.shape))
            if isinstance(packed, Offloaded):
                self.ops.append(("use", next(i for i, h in enumerate(self.hosts) if h is packed.host)))
            return tensor

        monkeypatch.setattr(HostOffload, "pack", counting_pack)
        monkeypatch.setattr(HostOffload, "unpack", counting_unpack)
        if not device:
            return

        def to_host(offload: HostOffload, tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
            self.ops.append(("host", len(self.hosts)))
            self.hosts.append(tensor.detach().clone())
            return self.hosts[-1], None

        def to_device(offload: HostOffload, entry: Offloaded) -> tuple[torch.Tensor, None]:
            self.ops.append(("device", next(i for i, h in enumerate(self.hosts) if h is entry.host)))
            return entry.host.clone(), None

        monkeypatch.setattr(HostOffload, "_offloads", lambda offload, tensor: True)
        monkeypatch.setattr(HostOffload, "_to_host", to_host)
        monkeypatch.setattr(HostOffload, "_to_device", to_device)
        monkeypatch.setattr(HostOffload, "_use", lambda offload, tensor, ready: tensor)


@pytest.mark.parametrize(("mode", "every", "checkpointed"), [("full", 1, 3), ("selective", 2, 2)])
def test_offload_packs_each_checkpointed_layer_input_once_and_changes_nothing_on_cpu(
    monkeypatch: pytest.MonkeyPatch, mode: str, every: int, checkpointed: int
) -> None:
    hooks = CountingHooks(monkeypatch)
    plain, offloaded = tiny_model(), tiny_model()
    for model in (plain, offloaded):  # nested checkpoints (MLP chunks) inside the layers: recomputed, not offloaded
        apply_chunked_mlp(model.model.layers, 16)
    apply_activation_checkpointing(plain.model.layers, mode, every)
    apply_activation_checkpointing(offloaded.model.layers, mode, every, offload=True)
    ids = tokens()
    with torch.no_grad():
        offloaded(input_ids=ids)
    assert hooks.packed == []  # no backward coming: nothing kept, nothing moved
    loss, grads = loss_and_grads(offloaded, ids)
    layer_input = (2, 45, HIDDEN)
    assert hooks.packed == [layer_input] * checkpointed  # forward: one input per checkpointed layer
    assert hooks.unpacked == [layer_input] * checkpointed  # backward: each brought back once, for its recompute
    assert all(hooks.same_tensor)  # a CPU tensor is kept as it is: no copy
    ref_loss, ref_grads = loss_and_grads(plain, ids)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[name], grad) for name, grad in ref_grads.items())


def test_offload_copies_each_input_out_once_and_back_one_layer_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order of the copies, with the CPU playing the device: the forward copies the three layers' inputs out;
    the backward copies the last layer's back when it needs it and, before using it, starts the copy of the input
    of the layer before, and so on: each copied back once, one layer ahead of its use. The gradients are those
    without offload, exactly."""
    hooks = CountingHooks(monkeypatch, device=True)
    plain, offloaded = tiny_model(), tiny_model()
    apply_activation_checkpointing(plain.model.layers, "full")
    host_offload = apply_activation_checkpointing(offloaded.model.layers, "full", offload=True)
    ids = tokens()
    loss, grads = loss_and_grads(offloaded, ids)
    forward = [("host", 0), ("host", 1), ("host", 2)]
    backward = [("device", 2), ("device", 1), ("use", 2), ("device", 0), ("use", 1), ("use", 0)]
    assert hooks.ops == forward + backward
    assert not any(hooks.same_tensor)
    ref_loss, ref_grads = loss_and_grads(plain, ids)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[name], grad) for name, grad in ref_grads.items())
    hooks.ops.clear()
    offloaded(input_ids=ids).logits.sum()  # a graph dropped without a backward: its host copies go with it
    gc.collect()
    assert hooks.ops == [("host", 3), ("host", 4), ("host", 5)]
    assert host_offload is not None and all(ref() is None for ref in host_offload._pending)


@pytest.mark.parametrize("offload", [False, True])
def test_offload_frees_the_layer_input_until_the_backward(monkeypatch: pytest.MonkeyPatch, offload: bool) -> None:
    """With the CPU playing the device (the pack hook stores a copy, as the move to host memory does on a GPU), the
    checkpointed layer no longer references its input after the forward: the device memory is free until the
    backward; the gradients are the same. Without offload the checkpoint holds the input."""
    hooks = CountingHooks(monkeypatch, device=True)
    model = tiny_model()
    apply_activation_checkpointing(model.model.layers, "full", offload=offload)
    layer = model.model.layers[1]
    x = torch.randn(1, 8, HIDDEN, requires_grad=True)
    hidden = x * 2.0  # the layer's input: a non-leaf activation, referenced only by what the layer keeps
    position_ids = torch.arange(8)[None]
    position_embeddings = model.model.rotary_emb(hidden, position_ids=position_ids)
    alive = weakref.ref(hidden)
    out = layer(hidden, position_ids=position_ids, position_embeddings=position_embeddings)
    del hidden
    gc.collect()
    assert (alive() is None) == offload
    assert hooks.ops == ([("host", 0)] if offload else [])
    out.sum().backward()
    assert len(hooks.unpacked) == int(offload)
    grad = x.grad.clone()
    x.grad = None
    unwrapped = layer._checkpoint_wrapped_module
    unwrapped(x * 2.0, position_ids=position_ids, position_embeddings=position_embeddings).sum().backward()
    torch.testing.assert_close(grad, x.grad, atol=0, rtol=0)


def test_apply_activation_checkpointing_refuses_offload_without_checkpointing() -> None:
    with pytest.raises(ValueError, match="offload=True keeps the inputs of checkpointed layers"):
        apply_activation_checkpointing(tiny_model().model.layers, "none", offload=True)


# ---------------------------------------------------------------------------------------------------------------
# Config checks
# ---------------------------------------------------------------------------------------------------------------


def check(overrides: list[str]) -> None:
    cfg = load_config(["model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=128", *overrides])
    check_job(cfg, 1, num_heads=4, num_kv_heads=2, num_layers=4, tied_embeddings=False, vocab_size=VOCAB)


def test_check_job_refuses_offload_without_checkpointing_and_negative_chunks() -> None:
    with pytest.raises(ValueError) as error:
        check(["parallel.activation_offload=true"])
    message = str(error.value)
    assert "parallel.activation_offload=true" in message and "parallel.activation_checkpointing=none" in message
    assert "set parallel.activation_checkpointing=full" in message and "parallel.activation_offload=false" in message
    with pytest.raises(ValueError, match=r"parallel.mlp_chunk_tokens=-1 must be >= 0"):
        check(["parallel.mlp_chunk_tokens=-1"])
    check(["parallel.activation_offload=true", "parallel.activation_checkpointing=selective"])
    check(["parallel.mlp_chunk_tokens=256"])


def test_check_job_warns_that_cpu_offload_on_a_cpu_device_only_adds_copies(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="lctrain"):
        check(["parallel.cpu_offload=true", "train.device=cpu"])
    assert "parallel.cpu_offload=true with train.device=cpu" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lctrain"):
        check(["parallel.cpu_offload=true", "train.device=cuda"])
        check(["parallel.cpu_offload=false", "train.device=cpu"])
    assert caplog.text == ""
