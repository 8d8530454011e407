"""The planner on a hardware file (``plan --hardware FILE``, written by ``lctrain probe``): measured figures are used
as achieved (no MFU on the attention rates, no link efficiency on measured links), missing ones come from a preset,
bad files are refused naming the field; and the probe's command at world size 1 writes a file the planner reads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lctrain.planner import HARDWARE, NAMED_MODELS, Layout, Workload, ring_step
from lctrain.planner.presets import load_hardware
from lctrain.planner.timing import RING_PIECES, summary_exchange_bytes

CPU = torch.device("cpu")
PROBED = {
    "name": "probed-cuda",
    "device": "cuda",
    "dtype": "bf16",
    "tflops": 700.0,
    "mem_gib": 139.8,
    "intra_gbps": 300.0,
    "inter_gbps": None,
    "alltoall_gbps": 200.0,
    "attention_tflops": 400.0,
    "attention_backward_tflops": 250.0,
}


def write(tmp_path: Path, **fields: object) -> Path:
    path = tmp_path / "hardware.json"
    path.write_text(json.dumps({**PROBED, **fields}))
    return path


def test_measured_figures_replace_the_preset_and_missing_ones_come_from_it(tmp_path: Path) -> None:
    hw = load_hardware(write(tmp_path))
    assert (hw.name, hw.tflops, hw.intra_gbps, hw.attention_tflops, hw.dtype) == ("probed-cuda", 700, 300, 400, "bf16")
    assert hw.inter_gbps == HARDWARE["h100"].inter_gbps and "inter_gbps" not in hw.measured
    assert load_hardware(write(tmp_path), "a100").inter_gbps == HARDWARE["a100"].inter_gbps
    assert load_hardware(write(tmp_path, device="cpu")).mem_gib == 139.8  # the cpu preset's the rest


def test_ring_pieces_are_the_rings() -> None:
    from lctrain.attention import ring_transfers

    assert RING_PIECES == ring_transfers.PIECES


def test_ring_step_uses_measured_rates_as_achieved(tmp_path: Path) -> None:
    """Ring inside a node: W = the measured 300 GB/s as it is, C = the measured kernel rates (no MFU); the nominal
    inter-node link of the preset still gets the link efficiency."""
    model, hw = NAMED_MODELS["llama3-8b"], load_hardware(write(tmp_path))
    work = Workload(seq_len=65536, gpus_per_node=8, mfu=0.4, link_efficiency=0.8)
    # a ring of two fetches no K/V again in the backward, and its one transfer per pass hides behind 2 - 1/4 steps
    for ring, backward_bytes, overlap in ((2, 4, 1.75), (4, 2 + 4, 1.0)):
        step = ring_step(model, Layout(1, 8 // ring, ring, 1), hw, work)
        forward, backward = 2 * 400e12, backward_bytes * 250e12 / 2.5
        assert (step.link, step.overlap) == ("intra", overlap)
        assert step.threshold_tokens == pytest.approx(8 / 32 * max(forward, backward) / 300e9 / overlap, rel=1e-12)
        pairs = (65536 // ring) ** 2 / 2
        assert step.compute_fwd_s == pytest.approx(4 * 128 * 32 * pairs / 400e12, rel=1e-12)
        assert step.compute_bwd_s == pytest.approx(2.5 * 4 * 128 * 32 * pairs / 250e12, rel=1e-12)
        assert step.comm_bwd_s == pytest.approx(2 * (65536 // ring) * 8 * 128 * backward_bytes / 300e9, rel=1e-12)
    across = ring_step(model, Layout(1, 1, 16, 1), hw, replace(work, nodes=2))
    assert across.link == "inter"
    assert across.comm_fwd_s == pytest.approx(2 * 4096 * 8 * 128 * 2 / (HARDWARE["h100"].inter_gbps * 1e9 * 0.8))


def test_hybrid_summary_exchange_takes_the_measured_rate_else_the_rings_link(tmp_path: Path) -> None:
    """A gated delta layer's exchange over a ring inside a node runs at the file's ``summary_intra_gbps``, across
    nodes at its ``summary_inter_gbps`` (both as measured, forward and twice the bytes backward); a file without them
    gives it the ring's link: the measured ``intra_gbps`` as it is, the preset's network x link efficiency."""
    model, work = NAMED_MODELS["qwen3-next-80b-a3b"], Workload(65536, gpus_per_node=8, link_efficiency=0.8)
    without = load_hardware(write(tmp_path))
    measured = load_hardware(write(tmp_path, summary_intra_gbps=120.0, summary_inter_gbps=20.0))
    assert {"summary_intra_gbps", "summary_inter_gbps"} <= set(measured.measured)
    network = HARDWARE["h100"].inter_gbps * 1e9 * 0.8
    for layout, nodes, rates in (
        (Layout(1, 2, 4, 1), 1, (120e9, 300e9)),
        (Layout(1, 1, 8, 2), 2, (20e9, network)),
    ):
        exchange = summary_exchange_bytes(model, layout.ring, layout.ulysses, 2)
        for hw, rate in zip((measured, without), rates):
            step = ring_step(model, layout, hw, replace(work, nodes=nodes))
            assert step.summary_fwd_s == pytest.approx(exchange / rate, rel=1e-12)
            assert step.summary_bwd_s == pytest.approx(2 * exchange / rate, rel=1e-12)


def test_probe_sizes_the_summary_exchange_from_the_model() -> None:
    """``lctrain probe --model M --ulysses U``: a hybrid's summaries [Hv/U, dk, dk + dv] and halos [K - 1, C/U];
    none for a model without gated delta layers."""
    from lctrain.planner import probe

    options = probe.options_from(probe.parser().parse_args(["--model", "qwen3-next-80b-a3b", "--ulysses", "4"]), CPU)
    assert (options.summary_shape, options.halo_shape) == ((8, 128, 256), (3, (2 * 16 * 128 + 32 * 128) // 4))
    plain = probe.options_from(probe.parser().parse_args(["--model", "llama3-8b", "--ulysses", "4"]), CPU)
    assert (plain.summary_shape, plain.halo_shape) == ((), ())


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"device": "tpu"}, 'no "device": "cuda" or "cpu"'),
        ({"intra_gbps": -1}, "intra_gbps=-1 must be a positive number or null"),
        ({"attention_tflops": "fast"}, "attention_tflops='fast' must be a positive number"),
        ({"dtype": "fp8"}, "dtype='fp8' must be bf16 or fp32"),
    ],
)
def test_bad_hardware_files_are_refused_naming_the_field(tmp_path: Path, fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_hardware(write(tmp_path, **fields))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        load_hardware(tmp_path / "broken.json")


def test_probe_command_alone_writes_a_file_without_links(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """``python -m lctrain probe`` without torchrun: a group of one, so no link is measured, only the kernel, the
    GEMM and memory; the planner then takes every link from the preset."""
    from lctrain.planner import cli as plan_cli
    from lctrain.planner import probe

    out = tmp_path / "hardware.json"
    # fp32: a CPU without bf16 instructions takes minutes for the bf16 GEMM
    probe.main(
        ["--model", "tiny", "--out", str(out), "--tokens", "64", "--bytes", "1024", "--iters", "1", "--dtype", "fp32"]
    )
    assert f"wrote {out}" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["device"] == "cpu" and written["probe"]["world"] == 1
    assert (written["intra_gbps"], written["inter_gbps"], written["alltoall_gbps"]) == (None, None, None)
    assert written["attention_tflops"] > 0 and written["probe"]["command"].startswith("python -m lctrain probe")
    plan_cli.main(["--model", "tiny", "--seq-len", "2048", "--gpus-per-node", "2", "--hardware", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"]["intra_gbps"] == HARDWARE["cpu"].intra_gbps
    assert report["hardware"]["attention_tflops"] == written["attention_tflops"]
    with pytest.raises(SystemExit, match="--tokens 3 must be even"):
        probe.main(["--model", "tiny", "--tokens", "3"])
