"""The optimizer step's per-step overheads, on CPU in one process: AdamW is fused, a NaN/inf gradient norm skips the
update exactly without reading the norm on the host, and a training step reads device values back to the host once
(the logged loss and gradient norm, together).

"Reads back to the host" is what makes a CUDA host wait for the GPU: ``item``, ``tolist``, ``bool`` (an ``if`` on a
tensor), ``float``, ``int``, ``cpu``, ``numpy``. A ``TorchFunctionMode`` records every such call during a step; the
document bounds (``cu_seqlens``) are host tensors by design (the attention plans its blocks from them), so reads of
those are not counted. ``tests/gpu/test_cuda_trainer.py`` checks the same on a GPU with CUDA's sync detection.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from lctrain.config import OptimConfig, load_config
from lctrain.data import IGNORE_INDEX
from lctrain.train.optim import build_optimizer, step_if_finite

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
}


class HostReads(TorchFunctionMode):
    """Records the host reads of tensors other than ``ignored`` (identified by their storage)."""

    def __init__(self, ignored: list[torch.Tensor]):
        super().__init__()
        self.ignored = {t.untyped_storage().data_ptr() for t in ignored}
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_READS and args[0].untyped_storage().data_ptr() not in self.ignored:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def trainer(tmp_path):  # noqa: ANN001, ANN201
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    cfg = load_config(
        [
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "data.seq_len=64",
            "train.device=cpu",
            "train.loss_chunk_tokens=16",
            "parallel.activation_checkpointing=full",
            f"train.run_dir={tmp_path}",
            "checkpoint.resume=none",
            "logging.progress_bar=false",
        ]
    )
    try:
        yield Trainer(build_training_job(cfg))
    finally:
        dist.destroy_process_group()


def batch(vocab_size: int, seed: int) -> dict:
    tokens = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(seed))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    labels[:, 39] = IGNORE_INDEX  # two documents: [0, 40) and [40, 64)
    positions = torch.cat([torch.arange(40), torch.arange(24)])[None]
    return {
        "input_ids": tokens,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": [torch.tensor([0, 40, 64], dtype=torch.int32)],
    }


def test_a_training_step_reads_back_once_and_the_optimizer_step_never(trainer) -> None:  # noqa: ANN001
    vocab = trainer.hf_config.vocab_size
    trainer.train_step([batch(vocab, 0)])  # AdamW's states exist from here on
    micro_batches = [batch(vocab, 1)]
    with HostReads(micro_batches[0]["cu_seqlens"]) as step:
        result = trainer.train_step(micro_batches)
    assert step.reads == ["tolist"]
    assert set(result) == {"loss", "grad_norm"} and all(isinstance(v, float) for v in result.values())
    step = trainer.forward_backward([batch(vocab, 2)])
    with HostReads([]) as optimizer_step:
        trainer.optimizer_step(step.trained)
    assert optimizer_step.reads == []


def test_a_step_without_a_trained_token_changes_no_weight(trainer, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    """Every label masked (a batch of prompts only): the loss is 0, not NaN, the update is skipped on the device (the
    parameters and AdamW's state stay bitwise), the step is logged; the next step with tokens trains normally."""
    vocab = trainer.hf_config.vocab_size
    trainer.train_step([batch(vocab, 0)])
    before = {name: p.detach().full_tensor().clone() for name, p in trainer.model.named_parameters()}
    masked = batch(vocab, 1)
    masked["labels"] = torch.full_like(masked["labels"], IGNORE_INDEX)
    with caplog.at_level("WARNING", logger="lctrain"):
        result = trainer.train_step([masked])
    assert result["loss"] == 0.0 and result["grad_norm"] == 0.0
    assert any("no trained token in this step" in r.getMessage() for r in caplog.records)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach().full_tensor(), before[name]), name
    trainer.train_step([batch(vocab, 2)])
    assert any(not torch.equal(p.detach().full_tensor(), before[n]) for n, p in trainer.model.named_parameters())


def test_adamw_is_fused() -> None:
    optimizer = build_optimizer(torch.nn.Linear(4, 4), OptimConfig())
    assert optimizer.defaults["fused"] is True


def test_step_if_finite_skips_a_nonfinite_update_exactly() -> None:
    """A NaN norm leaves parameters, moments and the step count bitwise unchanged; the next finite step then equals
    the step of an optimizer that never saw the skipped one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = torch.nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    cfg = OptimConfig(lr=0.1)
    optimizer, twin_optimizer = build_optimizer(model, cfg), build_optimizer(twin, cfg)
    gradients = [torch.randn(p.shape) for p in model.parameters()]

    def step(module: torch.nn.Module, opt: torch.optim.AdamW, scale: float, norm: float) -> None:
        for param, grad in zip(module.parameters(), gradients):
            param.grad = grad * scale
        step_if_finite(opt, torch.tensor(norm))

    step(model, optimizer, 1.0, 1.0)
    step(twin, twin_optimizer, 1.0, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    step(model, optimizer, float("nan"), float("nan"))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(optimizer.state[model.weight][k], v) for k, v in state.items())
    assert not hasattr(optimizer, "found_inf")
    step(model, optimizer, 0.5, 0.5)
    step(twin, twin_optimizer, 0.5, 0.5)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert optimizer.state[model.weight]["step"].item() == 2
