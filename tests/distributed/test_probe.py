"""``lctrain probe`` on spawned gloo groups of 2 and 4 ranks (one host: the links inside a node, the Ulysses
all-to-all and a hybrid's gated delta summary exchange are measured, none between nodes), and the planner reading the
file it writes. Sizes are tiny: these
tests check what is measured and written, never how fast anything is."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lctrain.planner import NAMED_MODELS, Layout, Workload, ring_step
from lctrain.planner import cli as plan_cli
from lctrain.planner.presets import HARDWARE, load_hardware
from lctrain.planner.probe import ProbeOptions, measure, write_hardware
from lctrain.planner.timing import summary_exchange_bytes
from lctrain.testing import run_distributed

QWEN3_NEXT = NAMED_MODELS["qwen3-next-80b-a3b"]


def probe_job(ulysses: int, out: str) -> dict:
    """What ``python -m lctrain probe --model M --ulysses U`` measures for a tiny hybrid M (summaries of 2 value heads
    [16, 16 + 8] and halos [3, 40] per piece), with tiny sizes; rank 0 writes it."""
    shapes = {"summary_shape": (2, 16, 24), "halo_shape": (3, 40)}
    options = ProbeOptions(4, 2, 32, ulysses=ulysses, tokens=128, bytes=1 << 16, iters=1, gemm=128, **shapes)
    record = measure(options, torch.device("cpu"))
    if dist.get_rank() == 0:
        write_hardware(record, Path(out))
    return record


@functools.cache
def probed(world: int, ulysses: int, out: str) -> list[dict]:
    return run_distributed(probe_job, world, ulysses, out)


@pytest.mark.parametrize("world,ulysses", [(2, 2), (4, 2)])
def test_probe_writes_a_file_the_planner_reads(world: int, ulysses: int, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "hardware.json"
    records = probed(world, ulysses, str(out))
    assert all(record == records[0] for record in records)  # every rank agrees (the slowest rank's times)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(records[0]))
    assert (
        written["probe"] | {"world": world, "nodes": 1, "ranks_per_node": world, "ulysses": ulysses} == written["probe"]
    )
    assert written["inter_gbps"] is None  # one host: no link between nodes to measure
    assert written["summary_inter_gbps"] is None
    measured = ("intra_gbps", "alltoall_gbps", "summary_intra_gbps", "attention_tflops", "attention_backward_tflops")
    for name in (*measured, "tflops"):
        assert written[name] > 0, name
    seconds = written["probe"]["seconds"]
    assert seconds["summary_intra_forward"] > 0 and seconds["summary_intra_backward"] > 0
    assert written["probe"]["kernel"] == "torch_cpu_flash"

    hw = load_hardware(out)
    assert hw.inter_gbps == HARDWARE["cpu"].inter_gbps  # from the preset
    assert "inter_gbps" not in hw.measured and {"intra_gbps", "attention_tflops", "summary_intra_gbps"} <= set(
        hw.measured
    )
    assert (hw.intra_gbps, hw.attention_tflops, hw.dtype) == (
        written["intra_gbps"],
        written["attention_tflops"],
        "bf16",
    )

    command = ["--model", "tiny", "--seq-len", "4096", "--gpus-per-node", str(world), "--hardware", str(out)]
    plan_cli.main(command)
    assert "measured by lctrain probe (bf16" in capsys.readouterr().out
    plan_cli.main([*command, "--mesh", f"1,1,{world},1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"]["measured"] == list(hw.measured) and report["workload"]["dtype_bytes"] == 2
    # the ring step from the measured figures as they are: no MFU, no link efficiency; K/V in bf16, dK/dV in fp32
    # (and K/V again in the backward when the ring has more than two ranks, else the transfers hide behind 1.75 steps)
    backward_bytes, overlap = (4 + 2, 1.0) if world > 2 else (4, 1.75)
    rates = 1e12 * written["attention_tflops"], 1e12 * written["attention_backward_tflops"]
    threshold = 2 / 4 * max(2 * rates[0], backward_bytes * rates[1] / 2.5) / (written["intra_gbps"] * 1e9 * overlap)
    ring = report["plans"][0]["ring_step"]
    assert (ring["link"], ring["threshold_tokens"]) == ("intra", pytest.approx(threshold, rel=1e-9))
    # a hybrid's ring inside the node: its gated delta exchange at the measured rate, forward and backward (2x)
    layout, work = Layout(1, 1, world, 1), Workload(4096, gpus_per_node=world)
    step = ring_step(QWEN3_NEXT, layout, hw, work)
    exchange = summary_exchange_bytes(QWEN3_NEXT, world, 1, 2) / (written["summary_intra_gbps"] * 1e9)
    assert (step.summary_fwd_s, step.summary_bwd_s) == (
        pytest.approx(exchange, rel=1e-12),
        pytest.approx(2 * exchange, rel=1e-12),
    )
