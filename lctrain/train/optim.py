"""AdamW and the learning-rate schedule (linear warmup, then cosine decay to ``lr · min_lr_ratio``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lctrain.config.schema import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linear and embedding weights) only, not on norms or biases.

    The fused implementation, on every device (CUDA and CPU; with ``parallel.cpu_offload`` the step runs on the CPU):
    one kernel per device instead of a loop of element-wise kernels, and it can skip an update on the device
    (``step_if_finite``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # no empty group (LoRA adapters alone are all matrices): a checkpoint's optimizer state could not load into one
    groups = [group for group in groups if group["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def step_if_finite(optimizer: torch.optim.AdamW, grad_norm: Tensor) -> None:
    """``optimizer.step()`` unless ``grad_norm`` (a scalar tensor) is NaN or inf, decided on the device, without a
    host sync: the fused AdamW kernel leaves parameters, moments and step count untouched when its ``found_inf``
    flag (the one ``torch.amp.GradScaler`` sets) is 1."""
    optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float | None, *, pp_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Clip gradients by their global L2 norm and return it (the same on every rank): over every FSDP shard
    (DTensor) and, with pipeline stages, over ``pp_group`` (each stage holds different parameters).
    ``max_norm=None`` only measures. Gradients on different meshes (the experts' under expert parallelism,
    ``lctrain.parallel.expert``) are measured and clipped one mesh at a time."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for param in params:
        by_mesh.setdefault(param.grad.device_mesh if isinstance(param.grad, DTensor) else None, []).append(param)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:
        norm = norm**2
        dist.all_reduce(norm, group=pp_group)
        norm = norm.sqrt()
    if max_norm is not None:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of ``lr`` for optimizer step ``step`` (0-based): (step+1)/warmup during warmup, then a
    cosine from 1 down to ``min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
