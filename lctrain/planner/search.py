"""The layouts: which ones lctrain accepts (the rules of ``lctrain.rules``), their estimates, the recommendation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from lctrain.planner.memory import MemoryEstimate, estimate_memory
from lctrain.planner.presets import GIB, Hardware, Layout, ModelSpec, Workload
from lctrain.planner.timing import RingStep, StepTime, ring_step, step_time
from lctrain.rules import (
    check_activation_offload,
    check_expert_adapters,
    check_expert_parallel,
    check_linear_heads,
    check_pipeline,
    check_ulysses_heads,
)

NEAR_BEST = 0.03  # layouts within this fraction of the best estimated throughput count as equally fast
# activation checkpointing tried by --activation-checkpointing auto, least recomputation first: (mode, ac_every)
AUTO_AC = (("none", 1), ("selective", 4), ("selective", 2), ("full", 1))


def layout_problems(model: ModelSpec, layout: Layout, work: Workload) -> list[str]:
    """Why lctrain would refuse this layout: the rules ``check_job`` applies (``lctrain.rules``), with the layout's
    sequence layout (zigzag by default) and the 1F1B schedule; empty if it runs. Memory is judged separately."""
    checks = [
        lambda: layout.check_ulysses_inside_nodes(work.gpus_per_node, ranks="GPUs"),
        lambda: check_ulysses_heads(model.heads, model.kv_heads, layout.ulysses),
        lambda: check_linear_heads(*model.linear_heads, layout.ulysses) if any(model.linear_layers) else None,
        lambda: layout.check_sequence_length(work.seq_len),
        lambda: check_activation_offload(work.offload, layout.ac),
        lambda: check_expert_parallel(layout.ep, layout.dp_cp, model.experts),
        lambda: check_expert_adapters(work.lora_experts and bool(work.lora_rank), layout.ep),
    ]
    if layout.pp > 1:
        pipeline = (layout.pp, "1F1B", 1, (), model.layers, work.batch)
        checks.append(lambda: check_pipeline(*pipeline, tied_embeddings=model.tied))
    problems = []
    for check in checks:
        try:
            check()
        except ValueError as error:
            problems.append(str(error))
    return problems


@dataclass
class Plan:
    layout: Layout
    memory: MemoryEstimate
    ring: RingStep
    time: StepTime
    problems: list[str] = field(default_factory=list)  # why it cannot run (memory included); empty = feasible

    @property
    def feasible(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        ring = {**asdict(self.ring), "hidden": self.ring.hidden}
        time = {**asdict(self.time), "total_s": self.time.total_s, "tokens_per_s": self.time.tokens_per_s}
        time["mfu"] = self.time.mfu
        layout = {**self.layout.degrees(), "ep": self.layout.ep, "ac": self.layout.ac, "ac_every": self.layout.ac_every}
        return {
            "layout": layout,
            "feasible": self.feasible,
            "problems": self.problems,
            "memory_gib": self.memory.gib(),
            "ring_step": ring,
            "step": time,
        }


def usable_bytes(hw: Hardware, work: Workload) -> float:
    return hw.mem_gib * (1 - work.headroom) * GIB


def evaluate(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload) -> Plan:
    """The estimates for one layout, with every reason it cannot run (memory last)."""
    memory = estimate_memory(model, layout, work)
    ring = ring_step(model, layout, hw, work)
    plan = Plan(layout, memory, ring, step_time(model, layout, hw, work, ring), layout_problems(model, layout, work))
    if memory.total > usable_bytes(hw, work):
        plan.problems.append(
            f"needs {memory.total / GIB:.1f} GiB per GPU, more than the {usable_bytes(hw, work) / GIB:.1f} GiB "
            f"usable ({hw.mem_gib:g} GiB less {work.headroom:.0%} headroom)"
        )
    return plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int, *, max_pp: int | None = None, max_dp: int | None = None) -> list[tuple[int, int, int, int]]:
    """Every (pp, dp, ring, ulysses) with pp·dp·ring·ulysses = world (pp ≤ max_pp, dp ≤ max_dp when given)."""
    out = []
    for pp in _divisors(world):
        for ulysses in _divisors(world // pp):
            for ring in _divisors(world // (pp * ulysses)):
                out.append((pp, world // (pp * ulysses * ring), ring, ulysses))
    return [m for m in out if (max_pp is None or m[0] <= max_pp) and (max_dp is None or m[1] <= max_dp)]


def plan_layouts(
    model: ModelSpec,
    hw: Hardware,
    work: Workload,
    *,
    ac: str = "auto",
    ac_every: int = 2,
    max_pp: int | None = None,
    max_dp: int | None = None,
    mesh: tuple[int, int, int, int] | None = None,
    ep: int | None = None,
) -> list[Plan]:
    """One plan per mesh (or only ``mesh``) and, for a mixture of experts, per expert-parallel degree (``ep``, else
    every one that divides both dp x ring x ulysses and the experts). With ``ac="auto"`` each gets the least
    recomputation that fits (none, selective every 4th, every 2nd, full); otherwise the given mode."""
    choices = AUTO_AC if ac == "auto" else ((ac, ac_every),)
    if work.offload:
        choices = tuple(c for c in choices if c[0] != "none") or choices
    plans = []
    grid = [
        (degrees, expert_degree)
        for degrees in ([mesh] if mesh else meshes(work.world, max_pp=max_pp, max_dp=max_dp))
        for expert_degree in ([ep] if ep else expert_degrees(model, degrees[1] * degrees[2] * degrees[3]))
    ]
    for (pp, dp, ring, ulysses), expert_degree in grid:
        candidates = [
            evaluate(model, Layout(pp, dp, ring, ulysses, mode, every, ep=expert_degree), hw, work)
            for mode, every in choices
        ]
        runnable = [p for p in candidates if not layout_problems(model, p.layout, work)]
        # the first that fits; else the one that needs least memory; a mesh lctrain refuses: the first choice
        fits = [p for p in runnable if p.feasible]
        plans.append(fits[0] if fits else min(runnable, key=lambda p: p.memory.total) if runnable else candidates[0])
    return plans


def expert_degrees(model: ModelSpec, dp_cp: int) -> list[int]:
    """The expert-parallel degrees a mesh allows: those dividing both ``dp_cp`` and the experts (1 for a dense
    model)."""
    return [d for d in _divisors(dp_cp) if model.moe and model.experts % d == 0] or [1]


def recommend(plans: Sequence[Plan]) -> Plan | None:
    """Among feasible plans whose ring communication hides (or all feasible ones if none hides), those within
    ``NEAR_BEST`` of the best estimated throughput; of these the fewest pipeline stages, then the largest Ulysses
    degree, then the smallest ring (so the largest dp), then the least recomputation, then the smallest ep."""
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        return None
    pool = [p for p in feasible if p.ring.hidden] or feasible
    best = max(p.time.tokens_per_s for p in pool)
    near = [p for p in pool if p.time.tokens_per_s >= (1 - NEAR_BEST) * best]
    return min(near, key=_preference)


def _preference(plan: Plan) -> tuple:
    layout = plan.layout
    recompute = {"none": 0.0, "selective": 1 / layout.ac_every, "full": 1.0}[layout.ac]
    return (layout.pp, -layout.ulysses, layout.ring, recompute, layout.ep)


def ranked(plans: Sequence[Plan], chosen: Plan | None) -> list[Plan]:
    """The recommendation first, then feasible plans (hidden first, fastest first), then the refused ones."""
    rest = sorted(
        (p for p in plans if p is not chosen),
        key=lambda p: (not p.feasible, not p.ring.hidden, -p.time.tokens_per_s, _preference(p)),
    )
    return ([chosen] if chosen else []) + rest
