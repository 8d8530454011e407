"""``python -m lctrain probe``: measure the job's own links and attention kernel, and write the hardware file that
``python -m lctrain plan --hardware FILE`` reads in place of the presets.

Launched like a training job (torchrun on every node, e.g. ``NNODES=2 scripts/launch.sh``'s torchrun line with
``-m lctrain probe`` instead of ``-m lctrain train``), one process per GPU (per rank on CPU). Every rank takes
part in every measurement at once, as in a ring step:

- ``intra_gbps``: each rank sends ``--bytes`` to the next rank on its node and receives as much from the previous
  one (a ring over every node's ranks, all nodes at once; with two, each direction alone), per direction, the
  slowest rank;
- ``inter_gbps``: the same between the ranks of equal local rank on consecutive nodes (the ring across nodes);
- ``alltoall_gbps``: the all-to-all of the Ulysses groups (``--ulysses`` consecutive ranks of a node; default all
  of them): bytes leaving a rank per second;
- ``attention_tflops`` and ``attention_backward_tflops``: the kernel lctrain resolves for the model's head shape
  (its heads over ``--ulysses``), forward and backward of one zigzag ring step's block (``--tokens`` queries
  against half as many keys), FLOPs counted as the planner counts them (4·D per pair and head forward, 2.5 times
  that backward);
- ``summary_intra_gbps`` and ``summary_inter_gbps`` (a hybrid's model only): a gated delta layer's exchange over
  the ranks of a node (every node at once) and over the ranks of equal local rank on every node: the forward's
  all-gathers of two pieces' convolution halos and state summaries at the model's sizes (its linear heads over
  ``--ulysses``), then the backward's all-reduce of their gradient; the planner's bytes for both (three times what a
  rank receives in the forward) per second;
- ``tflops``: a large GEMM in the compute dtype (it stands in for the peak; the planner's ``--mfu`` scales it);
- ``mem_gib``: device memory (on CPU the host's memory over the ranks of a node).

Each time is the median of ``--iters`` runs after one warm-up, the slowest rank's. A link the job cannot measure
(one node: none between nodes; one rank per node: none inside one) is written as null, and the planner takes it
from a preset. Rank 0 writes the file.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lctrain.attention.kernels import resolve_kernel
from lctrain.planner.cli import check_positive, model_parser
from lctrain.planner.presets import GIB, MEASURABLE, ModelSpec, load_model
from lctrain.planner.timing import BACKWARD_FLOPS_RATIO
from lctrain.rules import check_linear_heads, check_ulysses_heads, groups_inside_nodes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class ProbeOptions:
    """What to measure with: the model's head shape (after Ulysses), message and block sizes, repetitions."""

    heads: int
    kv_heads: int
    head_dim: int
    ulysses: int = 1  # Ulysses group size: consecutive ranks of a node
    tokens: int = 2048  # queries of the timed attention block (a ring rank's S/R)
    bytes: int = 8 * 2**20  # per message of the link measurements
    iters: int = 5
    dtype: str = "bf16"
    gemm: int = 2048  # the GEMM's square size
    # a hybrid's gated delta layer, per piece: its summary [Hv/U, dk, dk + dv] (fp32) and convolution halo
    # [K - 1, C/U] (compute dtype); () for a model without such layers
    summary_shape: tuple[int, ...] = ()
    halo_shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Nodes:
    """Where the ranks run: ``hosts[i]`` is the node of global rank i; ``index`` the node of each rank and
    ``local`` its place among its node's ranks."""

    hosts: list[str]
    index: list[int]
    local: list[int]

    @classmethod
    def gather(cls) -> Nodes:
        hosts: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        order = list(dict.fromkeys(hosts))
        index = [order.index(h) for h in hosts]
        local = [hosts[:rank].count(hosts[rank]) for rank in range(len(hosts))]
        counts = {hosts.count(h) for h in order}
        if len(counts) != 1:
            raise ValueError(f"the nodes run different numbers of ranks ({sorted(counts)}): launch as many on each")
        return cls(hosts, index, local)

    @property
    def count(self) -> int:
        return max(self.index) + 1

    @property
    def per_node(self) -> int:
        return len(self.hosts) // self.count

    def rank(self, node: int, local: int) -> int:
        return next(r for r in range(len(self.hosts)) if self.index[r] == node and self.local[r] == local)


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median over ``iters`` runs (after one warm-up, every rank starting together) of the slowest rank's seconds."""
    times = []
    for index in range(iters + 1):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        elapsed = _slowest(time.perf_counter() - start)
        if index:
            times.append(elapsed)
    return statistics.median(times)


def ring_exchange_seconds(peer_next: int, peer_prev: int, size: int, iters: int, device: torch.device) -> float:
    """Seconds of sending ``size`` bytes to ``peer_next`` while receiving as many from ``peer_prev``, as a ring step
    does. Between two ranks (the next and the previous one are the same) each direction alone, the slower: a ring
    of two sends different amounts each way, and an equal two-way exchange on one connection can get, on links
    shaped by a queue, half the rate each way or all of it, depending on how the two flows start."""
    send = torch.ones(size, dtype=torch.uint8, device=device)
    receive = torch.empty_like(send)

    def exchange(sending: bool = True, receiving: bool = True) -> None:
        ops = [dist.P2POp(dist.isend, send, peer_next)] if sending else []
        ops += [dist.P2POp(dist.irecv, receive, peer_prev)] if receiving else []
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    if peer_next != peer_prev:
        return timed(exchange, iters, device)
    first = dist.get_rank() < peer_next  # sends first, while the other receives; then the other way
    return max(timed(functools.partial(exchange, lead, not lead), iters, device) for lead in (first, not first))


def measure_links(nodes: Nodes, options: ProbeOptions, device: torch.device) -> dict[str, Any]:
    """``intra_gbps``, ``inter_gbps`` and ``alltoall_gbps`` (None where the job has no such link), and the
    seconds each took."""
    rank = dist.get_rank()
    node, local = nodes.index[rank], nodes.local[rank]
    result: dict[str, Any] = {"intra_gbps": None, "inter_gbps": None, "alltoall_gbps": None, "seconds": {}}
    size, iters = options.bytes, options.iters
    if nodes.per_node > 1:
        peers = [nodes.rank(node, (local + step) % nodes.per_node) for step in (1, -1)]
        seconds = ring_exchange_seconds(*peers, size, iters, device)
        result["intra_gbps"], result["seconds"]["intra"] = size / seconds / 1e9, seconds
    if nodes.count > 1:
        peers = [nodes.rank((node + step) % nodes.count, local) for step in (1, -1)]
        seconds = ring_exchange_seconds(*peers, size, iters, device)
        result["inter_gbps"], result["seconds"]["inter"] = size / seconds / 1e9, seconds
    ulysses = options.ulysses
    if not groups_inside_nodes(ulysses, nodes.per_node):
        raise ValueError(f"--ulysses {ulysses} does not divide the {nodes.per_node} ranks of a node")
    if ulysses > 1:
        group = groups_of([list(range(first, first + ulysses)) for first in range(0, len(nodes.hosts), ulysses)])
        send = torch.ones(size // ulysses * ulysses, dtype=torch.uint8, device=device)
        receive = torch.empty_like(send)
        seconds = timed(lambda: dist.all_to_all_single(receive, send, group=group), iters, device)
        result["alltoall_gbps"] = send.numel() * (ulysses - 1) / ulysses / seconds / 1e9
        result["seconds"]["alltoall"] = seconds
    return result


def groups_of(members: list[list[int]]) -> dist.ProcessGroup:
    """The process group of the member list holding this rank, every list made on every rank in the same order."""
    rank, mine = dist.get_rank(), None
    for ranks in members:
        made = dist.new_group(ranks)
        mine = made if rank in ranks else mine
    return mine


def summary_exchange(group: dist.ProcessGroup, options: ProbeOptions, device: torch.device) -> tuple[float, float]:
    """Bytes/s of a gated delta layer's exchange over ``group`` (``lctrain.linear_attention.context``): the
    forward's all-gathers of this rank's two pieces' halos and summaries, the backward's all-reduce of the gradient
    of everything gathered; counted as the planner counts it, three times the bytes a rank receives in the forward.
    Returns the rate and the seconds of the forward and backward."""
    size = dist.get_world_size(group)
    halos = torch.ones(2, 1, *options.halo_shape, dtype=DTYPES[options.dtype], device=device)
    summaries = torch.ones(2, 1, *options.summary_shape, dtype=torch.float32, device=device)
    gathered = [[torch.empty_like(t) for _ in range(size)] for t in (halos, summaries)]
    gradients = [torch.ones(size, *t.shape, dtype=t.dtype, device=device) for t in (halos, summaries)]

    def forward() -> None:
        for parts, t in zip(gathered, (halos, summaries)):
            dist.all_gather(parts, t, group=group)

    def backward() -> None:
        for gradient in reversed(gradients):
            dist.all_reduce(gradient, group=group)

    forward_s, backward_s = (timed(run, options.iters, device) for run in (forward, backward))
    received = (size - 1) * (halos.nbytes + summaries.nbytes)
    return 3 * received / (forward_s + backward_s) / 1e9, forward_s, backward_s


def measure_summaries(nodes: Nodes, options: ProbeOptions, device: torch.device) -> dict[str, Any]:
    """``summary_intra_gbps`` (the ranks of each node) and ``summary_inter_gbps`` (the ranks of equal local rank
    on every node), None where the job has no such group or the model no gated delta layers."""
    result: dict[str, Any] = {"summary_intra_gbps": None, "summary_inter_gbps": None, "seconds": {}}
    if not options.summary_shape:
        return result
    ranks = range(len(nodes.hosts))
    for link, count, members in (
        ("intra", nodes.per_node, [[r for r in ranks if nodes.index[r] == n] for n in range(nodes.count)]),
        ("inter", nodes.count, [[r for r in ranks if nodes.local[r] == i] for i in range(nodes.per_node)]),
    ):
        if count > 1:
            rate, forward_s, backward_s = summary_exchange(groups_of(members), options, device)
            result[f"summary_{link}_gbps"] = rate
            result["seconds"] |= {f"summary_{link}_forward": forward_s, f"summary_{link}_backward": backward_s}
    return result


def measure_attention(options: ProbeOptions, device: torch.device) -> dict[str, Any]:
    """The resolved kernel's forward and backward rates (TFLOP/s) on one ring step's block of this rank's heads."""
    q_heads = options.heads // options.ulysses  # after the all-to-all; KV heads replicated when fewer than U
    kv_heads = max(options.kv_heads // options.ulysses, 1)
    dtype = DTYPES[options.dtype]
    kernel = resolve_kernel(device, dtype, head_dim=options.head_dim, q_heads=q_heads, kv_heads=kv_heads)
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(tokens: int, heads: int) -> torch.Tensor:
        shape = (1, tokens, heads, options.head_dim)
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    keys = options.tokens // 2
    q, dout = randn(options.tokens, q_heads), randn(options.tokens, q_heads)
    k, v = randn(keys, kv_heads), randn(keys, kv_heads)
    scale = options.head_dim**-0.5
    out, lse = kernel.forward(q, k, v, causal=False, scale=scale)
    out = out.to(dtype)
    forward_s = timed(lambda: kernel.forward(q, k, v, causal=False, scale=scale), options.iters, device)
    backward_s = timed(
        lambda: kernel.backward(dout, q, k, v, out, lse, causal=False, scale=scale), options.iters, device
    )
    flops = 4 * options.head_dim * q_heads * options.tokens * keys
    return {
        "kernel": kernel.name,
        "attention_tflops": flops / forward_s / 1e12,
        "attention_backward_tflops": BACKWARD_FLOPS_RATIO * flops / backward_s / 1e12,
        "seconds": {"attention_forward": forward_s, "attention_backward": backward_s},
    }


def measure_gemm(options: ProbeOptions, device: torch.device) -> float:
    """TFLOP/s of a square GEMM of ``options.gemm`` in the compute dtype."""
    n = options.gemm
    a = torch.randn(n, n, device=device).to(DTYPES[options.dtype])
    b = torch.randn(n, n, device=device).to(DTYPES[options.dtype])
    return 2 * n**3 / timed(lambda: a @ b, options.iters, device) / 1e12


def memory_gib(device: torch.device, ranks_per_node: int) -> float:
    """A GPU's memory, or on CPU the host's over the ranks of a node."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1] / GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_node / GIB


def measure(options: ProbeOptions, device: torch.device) -> dict[str, Any]:
    """Everything the hardware file holds (the same on every rank), measured on the default process group."""
    nodes = Nodes.gather()
    links = measure_links(nodes, options, device)
    summaries = measure_summaries(nodes, options, device)
    attention = measure_attention(options, device)
    gemm = measure_gemm(options, device)
    return {
        "name": f"probed-{device.type}",
        "device": device.type,
        "dtype": options.dtype,
        "tflops": gemm,
        "mem_gib": memory_gib(device, nodes.per_node),
        "intra_gbps": links["intra_gbps"],
        "inter_gbps": links["inter_gbps"],
        "alltoall_gbps": links["alltoall_gbps"],
        "summary_intra_gbps": summaries["summary_intra_gbps"],
        "summary_inter_gbps": summaries["summary_inter_gbps"],
        "attention_tflops": attention["attention_tflops"],
        "attention_backward_tflops": attention["attention_backward_tflops"],
        "probe": {
            **asdict(options),
            "kernel": attention["kernel"],
            "world": len(nodes.hosts),
            "nodes": nodes.count,
            "ranks_per_node": nodes.per_node,
            "hosts": list(dict.fromkeys(nodes.hosts)),
            "seconds": {**links["seconds"], **summaries["seconds"], **attention["seconds"]},
            "torch": torch.__version__,
        },
    }


def write_hardware(record: dict[str, Any], path: Path) -> str:
    """Write ``measure``'s record as the hardware file ``path``; returns a line saying what it holds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    figures = ", ".join(f"{name} {record[name]:.4g}" for name in MEASURABLE if record[name] is not None)
    return f"wrote {path}: {figures}\nplan with: python -m lctrain plan --hardware {path} ..."


def parser() -> argparse.ArgumentParser:
    p = model_parser(
        "probe",
        "Measure this job's links (inside and between nodes, the Ulysses all-to-all, a hybrid's gated delta summary "
        "exchange) and the attention kernel at the "
        "model's head shape; write the hardware file `python -m lctrain plan --hardware FILE` reads. Launch it like a "
        "training job (torchrun on every node).",
    )
    p.add_argument("--out", default="hardware.json", help="the hardware file to write (default hardware.json)")
    p.add_argument(
        "--ulysses", type=int, help="Ulysses group size (default: the ranks of a node, torchrun's LOCAL_WORLD_SIZE)"
    )
    p.add_argument("--tokens", type=int, help="queries of the timed attention block (default 8192 on GPU, 2048 CPU)")
    p.add_argument("--bytes", type=int, help="bytes per link message (default 64 MiB on GPU, 8 MiB on CPU)")
    p.add_argument("--iters", type=int, default=5, help="timed runs of each measurement (default 5)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    return p


def options_from(args: argparse.Namespace, device: torch.device) -> ProbeOptions:
    """The options of a command line, checked (before any process group)."""
    model = load_model(args.model)
    cuda = device.type == "cuda"
    ulysses = args.ulysses or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    options = ProbeOptions(
        heads=model.heads,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        ulysses=ulysses,
        tokens=args.tokens or (8192 if cuda else 2048),
        bytes=args.bytes or (64 if cuda else 8) * 2**20,
        iters=args.iters,
        dtype=args.dtype,
        gemm=8192 if cuda else 2048,
        **summary_shapes(model, ulysses),
    )
    check_positive(options, ("tokens", "bytes", "iters", "ulysses"))
    if options.tokens % 2:
        raise ValueError(f"--tokens {options.tokens} must be even (the block has half as many keys)")
    check_ulysses_heads(options.heads, options.kv_heads, ulysses, setting="--ulysses")
    return options


def summary_shapes(model: ModelSpec, ulysses: int) -> dict[str, tuple[int, ...]]:
    """A hybrid's ``summary_shape`` and ``halo_shape`` (``ProbeOptions``) under ``ulysses``; none for another model."""
    if not any(model.linear_layers):
        return {}
    check_linear_heads(*model.linear_heads, ulysses, setting="--ulysses")
    hv, (dk, dv) = model.linear_heads[1], model.linear_head_dims
    return {
        "summary_shape": (hv // ulysses, dk, dk + dv),
        "halo_shape": (model.conv_kernel - 1, model.conv_channels // ulysses),
    }


def main(argv: Sequence[str] | None = None) -> None:
    from lctrain.runtime import init_distributed, resolve_device  # here: measuring needs neither Hydra nor the data

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        options = options_from(args, device)
    except (ValueError, RuntimeError) as error:
        raise SystemExit(f"lctrain probe: {error}") from None
    init_distributed(device, timeout_s=600.0)
    try:
        record = measure(options, device)
        record["probe"]["command"] = "python -m lctrain probe " + shlex.join(argv)
        if dist.get_rank() == 0:
            print(write_hardware(record, Path(args.out)))
    except ValueError as error:
        raise SystemExit(f"lctrain probe: {error}") from None
    finally:
        dist.destroy_process_group()
