"""Expert parallelism: each of ``ep`` ranks holds ``E / ep`` of a mixture-of-experts layer's experts, and the tokens
routed to an expert travel to its rank by all-to-all and come back the same way.

The experts are transformers' own modules (``Qwen3MoeExperts``, ``MixtralExperts``: ``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]; ``GptOssExperts``: transposed, ``[E, H, 2I]`` and ``[E, I, H]``, with per-expert biases
and its own gate), called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``).
They run through transformers' public experts registry (``ExpertsInterface``): ``apply_expert_parallel`` shards the
expert weights on dim 0 over the EP mesh (DTensors: each rank keeps its experts) and selects the implementation
registered here, which

    sorts the T·k (token, expert) pairs by expert -> all-to-all: each rank receives the pairs of its own experts
    -> the local experts' feed-forward (one grouped GEMM, or a loop over experts) -> all-to-all back
    -> each token's k outputs weighted by the router and summed

The all-to-all's backward is the reverse all-to-all, so an expert's gradient on its rank sums the pairs of every
rank of the EP group: outputs and gradients equal the model without EP. With ``ep = 1`` the same implementation runs
without communication (``expert_kernel`` picks the local kernel for the device).

EP ranks are drawn from the ranks FSDP shards over (``dp x ring x ulysses``), innermost first: the ``ep`` adjacent
ranks of that flattened mesh (Ulysses neighbours, then ring, then data-parallel), so an EP group stays inside a node
when it can. The expert weights are then FSDP-sharded over the remaining ``dp_cp / ep`` ranks that hold the same
experts.
"""

from __future__ import annotations

import time
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

IMPLEMENTATION = "lctrain_experts"  # the name under which transformers' ExpertsInterface finds experts_forward
KERNELS = ("grouped_mm", "loop")  # the local experts' GEMM: one grouped GEMM, or one GEMM per expert


def is_experts(module: nn.Module) -> bool:
    """A transformers experts module with 3D weights (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and hasattr(module, "down_proj")


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if is_experts(module)]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward sends the gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``x`` [sum(send), ...] -> [sum(receive), ...]: ``send[j]`` consecutive rows go to rank j of ``group``,
    ``receive[j]`` come from it. Differentiable."""
    return _AllToAll.apply(x, send, receive, group)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], kernel: str) -> torch.Tensor:
    """``x`` [N, in] sorted by expert (``counts[e]`` rows for expert e) times each expert's ``weight[e]`` [out, in]
    transposed -> [N, out]."""
    if kernel == "grouped_mm":
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        return grouped_mm(x.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)
    parts = [rows @ weight[e].T for e, rows in enumerate(x.split(counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def local_weight(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert weight: its local shard when EP made it a DTensor (FSDP has gathered the
    other dims by the time the forward runs)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _projection(experts: nn.Module, name: str, x: torch.Tensor, counts: list[int], kernel: str) -> torch.Tensor:
    """One projection of the local experts on their rows (``x`` sorted by expert), with its bias where the module
    has them (``has_bias``: gpt-oss); weights stored ``[E, in, out]`` (``is_transposed``: gpt-oss) or ``[E, out,
    in]``."""
    weight = local_weight(getattr(experts, name))
    out = grouped_linear(x, weight.transpose(-2, -1) if experts.is_transposed else weight, counts, kernel)
    if experts.has_bias:
        bias = local_weight(getattr(experts, f"{name}_bias"))  # [E, out]
        out = out + bias.repeat_interleave(torch.tensor(counts, device=bias.device), dim=0, output_size=len(x))
    return out


def expert_ffn(experts: nn.Module, x: torch.Tensor, counts: list[int], kernel: str) -> torch.Tensor:
    """The gated feed-forward of each local expert on its rows: ``x`` [N, H] sorted by expert -> [N, H]. The gate
    is the module's own (``_apply_gate``: transformers' ``act_fn(gate) * up`` of the two halves, or gpt-oss's
    clamped SwiGLU of interleaved columns)."""
    return _projection(
        experts,
        "down_proj",
        experts._apply_gate(_projection(experts, "gate_up_proj", x, counts, kernel)),
        counts,
        kernel,
    )


def inverse(permutation: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``permutation``: ``x[permutation][inverse(permutation)]`` is ``x`` (a gather,
    which keeps only indices for its backward, where ``index_copy`` would keep its source)."""
    undo = torch.empty_like(permutation)
    undo[permutation] = torch.arange(len(permutation), device=permutation.device)
    return undo


def segments(starts: torch.Tensor, lengths: torch.Tensor, ep: int, local: int) -> torch.Tensor:
    """Row indices of the segments ``(source j, expert e)`` (``starts`` in source-major order) visited expert-major:
    ``lengths`` [local · ep] are the segments' lengths in that expert-major order."""
    firsts = starts.view(ep, local).T.flatten()  # [local · ep], expert-major
    offsets = torch.arange(int(lengths.sum()), device=starts.device) - (lengths.cumsum(0) - lengths).repeat_interleave(
        lengths
    )
    return firsts.repeat_interleave(lengths) + offsets


def experts_forward(
    experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts call with the experts of ``experts.expert_group`` (None: all experts here): ``hidden``
    [T, H], ``top_k_index`` and ``top_k_weights`` [T, k] -> [T, H] (module docstring)."""
    group: dist.ProcessGroup | None = experts.expert_group
    local = local_weight(experts.gate_up_proj).shape[0]  # experts held here: E / ep
    ep = 1 if group is None else dist.get_world_size(group)
    tokens, k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)  # [T·k]: pair p is token p // k's choice p % k
    order = torch.argsort(expert_ids, stable=True)
    pairs = hidden[order // k]  # [T·k, H] sorted by expert
    counts = torch.bincount(expert_ids, minlength=local * ep)  # [E]: pairs per expert
    if group is None:
        out = expert_ffn(experts, pairs, counts.tolist(), experts.expert_kernel)
    else:
        # counts of the pairs each rank sends to my experts: [ep (source rank), local]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        send = counts.view(ep, local).sum(1).tolist()
        by_source = received.view(ep, local)
        arrived = all_to_all(pairs, send, by_source.sum(1).tolist(), group)  # sorted by (source rank, local expert)
        # regroup the arrived rows by (local expert, source rank) for the kernel, and back after it
        by_expert = segments(by_source.flatten().cumsum(0) - by_source.flatten(), by_source.T.flatten(), ep, local)
        computed = expert_ffn(experts, arrived[by_expert], by_source.sum(0).tolist(), experts.expert_kernel)
        back = computed[inverse(by_expert)]
        out = all_to_all(back, by_source.sum(1).tolist(), send, group)
    unsorted = out[inverse(order)]  # back to pair order
    weighted = unsorted.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(unsorted.dtype)
    return weighted.sum(1).to(hidden.dtype)


def expert_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The local experts' GEMM on ``device`` for parameters of ``dtype``: on CUDA ``grouped_mm`` (one grouped GEMM
    over all experts, ``torch._grouped_mm``) on devices of capability >= 9.0 in bfloat16, else ``loop`` (one GEMM
    per expert over its sorted rows); on the CPU the faster of the two, measured once per process."""
    if device.type == "cuda":
        usable = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) >= (9, 0)
        return "grouped_mm" if usable and dtype == torch.bfloat16 else "loop"
    return fastest_cpu_kernel(dtype)


@cache
def fastest_cpu_kernel(dtype: torch.dtype) -> str:
    """``grouped_mm`` or ``loop``, whichever runs a small experts forward and backward faster on this CPU in
    ``dtype`` (the best of 3 runs each; a CPU without a grouped kernel for ``dtype`` gets ``loop``)."""
    generator = torch.Generator().manual_seed(0)
    counts = [96, 32, 64, 0, 128, 64, 80, 48]  # uneven, one expert idle, as routing makes them
    x = torch.randn(sum(counts), 256, generator=generator).to(dtype)
    weight = torch.randn(len(counts), 512, 256, generator=generator).to(dtype).requires_grad_()
    times: dict[str, list[float]] = {"grouped_mm": [], "loop": []}
    for _ in range(3):  # in turn, so that drift in the machine's load hits both alike
        for kernel in list(times):
            try:
                start = time.perf_counter()
                out = grouped_linear(x, weight, counts, kernel)
                out.backward(torch.ones_like(out))  # a dense gradient, as a model's (grouped_mm wants one)
                times[kernel].append(time.perf_counter() - start)
            except (RuntimeError, NotImplementedError):  # no grouped kernel for this dtype here
                del times[kernel]
    best = {kernel: min(measured) for kernel, measured in times.items()}
    return min(best, key=best.get) if best else "loop"


def expert_weights(experts: nn.Module) -> tuple[str, ...]:
    """The names of an experts module's per-expert tensors (dim 0: the expert): the projections and, where the
    module has them (gpt-oss), their biases."""
    names = ("gate_up_proj", "down_proj")
    return names + tuple(f"{name}_bias" for name in names) if experts.has_bias else names


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh | None, kernel: str) -> None:
    """Run every experts module of ``model`` (built with all E experts) through ``experts_forward`` with the local
    GEMM ``kernel`` (``expert_kernel``). With ``ep_mesh`` (the 1-D EP mesh of ``ep`` ranks), each rank keeps experts
    ``rank · E/ep`` to ``(rank + 1) · E/ep - 1``: the expert weights become DTensors sharded on dim 0 over
    ``ep_mesh`` (global shape unchanged, so loading, checkpoints and the export see all E experts), each rank keeping
    its shard of the tensor it holds (no communication; on the meta device before materialization). None: all
    experts stay, no communication. Apply it before FSDP, which then shards the experts over the other ranks."""
    modules = experts_modules(model)
    if not modules:
        raise ValueError("the model has no experts module (gate_up_proj and down_proj): expert parallelism needs one")
    for experts in modules:
        if ep_mesh is not None:
            total = experts.gate_up_proj.shape[0]
            if total % ep_mesh.size():
                raise ValueError(
                    f"parallel.ep={ep_mesh.size()} does not divide the {total} experts: choose an ep that divides "
                    f"{total}"
                )
            for name in expert_weights(experts):
                full = getattr(experts, name)
                shard = distribute_tensor(full.data, ep_mesh, [Shard(0)], src_data_rank=None)
                setattr(experts, name, nn.Parameter(shard, full.requires_grad))
        experts.expert_group = None if ep_mesh is None else ep_mesh.get_group()
        experts.expert_kernel = kernel
    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)
