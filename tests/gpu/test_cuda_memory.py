"""The memory savers that move tensors to host memory, on one GPU. Skipped without CUDA.

- Activation offload (``parallel.activation_offload``): the side-stream copies out in the forward and back (one
  layer ahead) in the backward change no result (fp32, math attention: the same kernels with and without offload;
  within 1e-6, where a copy read before it completed would give garbage), and the peak device memory of the forward
  and backward drops by at least all but three of the layer inputs.
- FSDP2's CPU offload (``parallel.cpu_offload``, one rank, gloo beside NCCL): the sharded parameters are pinned host
  tensors, three training steps give the losses of the same job without offload (1e-3 relative: bf16 compute, the
  AdamW step on the CPU instead of the GPU), and the peak device memory is lower.
"""

from __future__ import annotations

import socket

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lctrain.config import ModelConfig, load_config
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.parallel.activation_checkpointing import apply_activation_checkpointing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
LAYERS, HIDDEN, TOKENS = 8, 1024, 8192


def model(offload: bool) -> torch.nn.Module:
    cfg = ModelConfig(hidden_size=HIDDEN, intermediate_size=2816, num_layers=LAYERS, num_heads=16, num_kv_heads=4)
    config = model_config(cfg, vocab_size=1024)
    built = build_empty_model(config)
    materialize(built, random_init_source(config, seed=0), CUDA)
    apply_activation_checkpointing(built.model.layers, "full", offload=offload)
    return built.train()


def step(offload: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Loss, gradients and peak allocated device memory (bytes) of one forward and backward."""
    built = model(offload)
    ids = torch.randint(0, 1024, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(CUDA)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel(SDPBackend.MATH):
        loss = built(input_ids=ids, labels=ids).loss
        loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return loss.detach(), {n: p.grad for n, p in built.named_parameters()}, peak


def test_activation_offload_on_cuda_changes_no_result_and_frees_the_layer_inputs() -> None:
    loss, grads, peak = step(offload=False)
    offloaded_loss, offloaded_grads, offloaded_peak = step(offload=True)
    torch.testing.assert_close(offloaded_loss, loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(offloaded_grads[name], grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    layer_input = TOKENS * HIDDEN * 4
    assert peak - offloaded_peak >= (LAYERS - 3) * layer_input, (peak, offloaded_peak)


@pytest.fixture(scope="module")
def nccl_and_gloo_group():
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_cpu_offload_trains_like_the_same_job_on_the_gpu(nccl_and_gloo_group, tmp_path) -> None:
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    overrides = [
        "train.device=cuda",
        "parallel.param_dtype=bfloat16",
        "model.hidden_size=512",
        "model.intermediate_size=1376",
        "model.num_layers=4",
        "model.num_heads=8",
        "model.num_kv_heads=2",
        "data.seq_len=4096",
        "train.steps=3",
        "checkpoint.every=0",
        "checkpoint.export_hf=false",
        "logging.plot=false",
        "logging.progress_bar=false",
    ]
    results = {}
    for offload in (False, True):
        cfg = load_config([*overrides, f"parallel.cpu_offload={offload}", f"train.run_dir={tmp_path / str(offload)}"])
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(build_training_job(cfg))
        losses = trainer.train()
        locals_ = [p.to_local() for p in trainer.model.parameters()]
        results[offload] = (losses, torch.cuda.max_memory_allocated(), locals_)
        del trainer
    (losses, peak, _), (offloaded_losses, offloaded_peak, host_shards) = results[False], results[True]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host_shards)
    torch.testing.assert_close(torch.tensor(offloaded_losses), torch.tensor(losses), rtol=1e-3, atol=0)
    assert offloaded_peak < peak
