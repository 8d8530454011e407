"""The trainer on one GPU (NCCL, world size 1, bf16 FSDP mixed precision) against the plain Hugging Face model in
fp32 on the same GPU: the loss of the first step and its gradients. Skipped without CUDA.

Tolerances are those of bf16 compute: loss within 1e-2 relative, gradients within 5e-2 relative Frobenius error.
Then 30 steps: the loss falls. A training step (after the first) makes one synchronizing CUDA call, the read-back of
the logged loss and gradient norm (``torch.cuda.set_sync_debug_mode``), with the fused AdamW; a NaN gradient skips
the update on the device (parameters and AdamW's states unchanged).
"""

from __future__ import annotations

import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lctrain.config import load_config
from lctrain.models import build_empty_model, materialize, random_init_source
from lctrain.models.hf import hf_name
from lctrain.train.job import build_training_job
from lctrain.train.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

OVERRIDES = [
    "train.device=cuda",
    "parallel.param_dtype=bfloat16",
    "model.hidden_size=256",
    "model.intermediate_size=688",
    "model.num_layers=4",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "data.seq_len=4096",
    "checkpoint.every=0",
    "checkpoint.export_hf=false",
    "logging.plot=false",
    "logging.progress_bar=false",
]


@pytest.fixture(scope="module")
def nccl_group():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_first_step_matches_plain_model_and_loss_falls(nccl_group, tmp_path) -> None:
    cfg = load_config([*OVERRIDES, f"train.run_dir={tmp_path}", "train.steps=30"])
    trainer = Trainer(build_training_job(cfg))
    batch = next(iter(trainer.loader))
    loss = trainer.forward_backward([batch]).loss.item()
    grads = {hf_name(n): p.grad.full_tensor().float() for n, p in trainer.model.named_parameters()}

    plain = build_empty_model(trainer.hf_config)
    materialize(plain, random_init_source(trainer.hf_config, cfg.train.seed), torch.device("cuda"))
    bounds = batch["cu_seqlens"][0].tolist()
    input_ids, labels = batch["input_ids"].cuda(), batch["labels"].cuda()
    total = sum(
        F.cross_entropy(plain(input_ids=input_ids[:, a:b]).logits[0].float(), labels[0, a:b], reduction="sum")
        for a, b in zip(bounds, bounds[1:])
    )
    expected = total / (labels != -100).sum()
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-2 * abs(expected.item())
    for name, param in plain.named_parameters():
        error = (grads[name] - param.grad).norm() / param.grad.norm()
        assert error <= 5e-2, f"{name}: relative gradient error {error:.3g}"

    trainer.optimizer.zero_grad(set_to_none=True)
    losses = trainer.train()
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_a_training_step_syncs_with_the_host_once(nccl_group, tmp_path) -> None:
    cfg = load_config([*OVERRIDES, f"train.run_dir={tmp_path}", "train.steps=3"])
    trainer = Trainer(build_training_job(cfg))
    assert trainer.optimizer.defaults["fused"] is True
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])  # the first step creates AdamW's states and the communicators
    batch = next(batches)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step([batch])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, syncs


def test_a_nan_gradient_skips_the_update_on_the_device(nccl_group, tmp_path) -> None:
    """Fused AdamW on CUDA with FSDP2's DTensors: a NaN gradient leaves parameters and AdamW's states as they were."""
    trainer = Trainer(build_training_job(load_config([*OVERRIDES, f"train.run_dir={tmp_path}", "train.steps=3"])))
    batches = iter(trainer.loader)
    trainer.train_step([next(batches)])
    params = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    first = next(trainer.model.parameters())
    states = {
        k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
        for k, v in trainer.optimizer.state[first].items()
    }
    step = trainer.forward_backward([next(batches)])
    first.grad.to_local().view(-1)[0] = float("nan")
    norm = trainer.optimizer_step(step.trained)
    assert not torch.isfinite(norm).item()
    assert all(torch.equal(p.full_tensor(), params[n]) for n, p in trainer.model.named_parameters())
    for key, value in trainer.optimizer.state[first].items():
        local = value.to_local() if hasattr(value, "to_local") else value
        assert torch.equal(local, states[key]), key
