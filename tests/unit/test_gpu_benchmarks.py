"""The comparison benchmarks on CPU: every module ``scripts/gpu_check.sh`` runs imports and parses its arguments; the
longest-context search (doubling, halving, bisection, the memory budget) and the layer fit on made-up probes; and a
smoke run of ``benchmarks.bench_trainer`` and of ``benchmarks.bench_context`` with tiny shapes (``--device cpu``:
fresh processes, the resident set standing in for device memory, ``--budget-mib`` for its size), whose reports
hold both sides, the ratio, FSDP2's share, the layer fit and its check; and the one-process path that
``bench_preference --device cuda`` and ``bench_experts --device cuda`` take, on the CPU with tiny shapes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_context import fits, line
from benchmarks.report import fit_line
from benchmarks.runs import Probe, Search

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4"]
TINY += ["--kv-heads", "2", "--vocab", "8192"]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
STEPS = ("tests", "speed", "planner", "context", "preference", "moe")


def gpu_check_modules() -> list[str]:
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    return sorted(set(re.findall(r"python3 -m (benchmarks\.\w+)", text)))


def test_gpu_check_runs_the_benchmarks_and_its_syntax_is_valid() -> None:
    assert gpu_check_modules() == [
        "benchmarks.bench_context",
        "benchmarks.bench_experts",
        "benchmarks.bench_preference",
        "benchmarks.bench_ring_compute",
        "benchmarks.bench_trainer",
        "benchmarks.validate_planner",
    ]
    subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], cwd=REPO, check=True)


def run_gpu_check(tmp_path: Path, budget: int) -> tuple[list[str], list[str]]:
    """``gpu_check.sh`` with stand-ins for ``timeout``, ``nvidia-smi`` and ``python3`` that record their arguments
    and return at once: (the timeout each step got, the lines of status.txt)."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "timeouts.txt"
    (bin_dir / "timeout").write_text(f'#!/bin/sh\necho "$3 $5 $6" >> {calls}\n')
    for name in ("nvidia-smi", "python3"):
        (bin_dir / name).write_text("#!/bin/sh\necho stand-in\n")
    for script in bin_dir.iterdir():
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "GPU_CHECK_SECONDS": str(budget)}
    subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=REPO, env=env, check=True, capture_output=True)
    timeouts = calls.read_text().splitlines() if calls.exists() else []
    return timeouts, (out / "status.txt").read_text().splitlines()


def test_gpu_check_caps_each_step_by_what_is_left_of_its_budget(tmp_path: Path) -> None:
    """One device call may take 600 s: by default the six steps share 540 s, each capped by what is left."""
    timeouts, status = run_gpu_check(tmp_path / "capped", budget=200)
    seconds = [int(line.split()[0]) for line in timeouts]
    assert [line.split(maxsplit=1)[1] for line in timeouts] == [
        "-m pytest",
        "-m benchmarks.bench_trainer",
        "-m benchmarks.validate_planner",
        "-m benchmarks.bench_context",
        "-m benchmarks.bench_preference",
        "-m benchmarks.bench_experts",
    ]
    # 200 s less the 10 s of `timeout -k 10` and the whole seconds the stand-ins took; the planner's own 180 s and
    # the experts' own 120 s
    assert seconds[2] == 180 and seconds[5] == 120, seconds
    assert all(185 <= s <= 190 for s in seconds[:2] + seconds[3:5]), seconds
    assert [line.split(":")[0] for line in status[1::2]] == [f"== {name}" for name in STEPS]
    timeouts, status = run_gpu_check(tmp_path / "spent", budget=39)
    assert timeouts == []
    assert all(
        re.fullmatch(rf"== {name}: skipped, 2\d s of GPU_CHECK_SECONDS=39 left", line)
        for name, line in zip(STEPS, status, strict=True)
    ), status


HELP = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__")
        except SystemExit as exit:
            assert exit.code in (0, None), (module, exit.code)
    assert out.getvalue().startswith("usage:"), (module, out.getvalue()[:200])
    print("ok", module)
"""


def test_each_module_gpu_check_runs_imports_and_parses_arguments_on_cpu() -> None:
    """``--help`` of each, in one interpreter (torch imported once)."""
    modules = gpu_check_modules()
    result = subprocess.run(
        [sys.executable, "-c", HELP, *modules], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [word for module in modules for word in ("ok", module)]


def probe(limit: int, seen: list[int]):  # noqa: ANN201
    def run(seq: int) -> Probe:
        seen.append(seq)
        return Probe(seq, seq <= limit, {"ok": seq <= limit, "error": None if seq <= limit else "out of memory"})

    return run


def test_search_doubles_then_bisects_between_the_longest_fit_and_the_shortest_failure() -> None:
    seen: list[int] = []
    search = Search(probe(5000, seen), unit=512, max_seq=65536)
    assert search.run(1024, bisect=3) == 4608
    assert seen == [1024, 2048, 4096, 8192, 6144, 5120, 4608]
    assert search.shortest_failure() == 5120 and search.probes[5120].reason == "out of memory"


def test_search_halves_when_the_start_does_not_fit_and_stops_at_the_maximum() -> None:
    seen: list[int] = []
    assert Search(probe(1500, seen), unit=512, max_seq=65536).run(8192, bisect=1) == 1024
    assert seen == [8192, 4096, 2048, 1024, 1536]  # 1536 > 1500: the bisection step fails
    seen.clear()
    assert Search(probe(10**9, seen), unit=512, max_seq=65536).run(65536, bisect=2) == 65536
    assert seen == [65536]  # lctrain's search: a fit at --max-seq ends it
    seen.clear()
    assert Search(probe(100, seen), unit=512, max_seq=4096).run(1024, bisect=2) is None
    assert seen == [1024, 512]


def test_a_probe_fits_when_it_finished_within_the_memory_budget() -> None:
    gib = 2**30
    assert fits({"ok": True, "step_peak": 3 * gib}, None)
    assert fits({"ok": True, "step_peak": 3 * gib}, 3 * gib)
    assert not fits({"ok": True, "step_peak": 3 * gib + 1}, 3 * gib)
    assert not fits({"ok": False, "error": "out of memory"}, None)  # a CUDA out-of-memory: a clean "does not fit"


def test_scaling_line_fits_the_step_peak_per_rank_against_tokens_per_rank() -> None:
    """``bench_context --sections scaling``: a + b·(S/P) through the largest rank's step peak of each point, with the
    largest residual; no line through a single S/P."""
    points = [{"seq": 2 * n, "ranks": 2, "peaks": [10 + 3 * n, 9 + 3 * n + (n == 2048)]} for n in (1024, 2048, 4096)]
    a, b, residual = line(points)
    assert b == pytest.approx(3.0) and a == pytest.approx(10.0) and residual == pytest.approx(0.0, abs=1e-6)
    points[1]["peaks"][0] += 7  # one point 7 above the line: residuals -3, 4.5, -1.5 of the new fit
    assert line(points)[2] == pytest.approx(4.5)
    assert line(points[:1]) is None


def test_fit_line_through_depths() -> None:
    assert fit_line([2, 4], [10.0, 14.0]) == (6.0, 2.0)
    fixed, per_layer = fit_line([1, 2, 4], [5.0, 7.5, 12.0])
    assert per_layer == pytest.approx(65 / 28) and fixed == pytest.approx(2.75)


@pytest.mark.slow
def test_bench_trainer_on_cpu_reports_both_sides_and_their_ratio(tmp_path: Path) -> None:
    """A timed run of each side, taken in turn, and a memory run of each (four fresh processes)."""
    command = [sys.executable, "-m", "benchmarks.bench_trainer", *TINY, "--seq", "128", "--checkpointing", "none"]
    command += ["--warmup", "1", "--steps", "1", "--json", str(tmp_path / "speed.json")]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    number = r"[\d,.]+"
    for side in ("lctrain", "HF loop"):
        row = rf"^\| {side} \| 128 \| none \| {number} \| {number} \| {number} \| n/a \| — \| {number} \| {number} \|"
        assert re.search(row, out, re.MULTILINE), out
    assert re.search(rf"^\| 128 \| none \| {number} \| {number} \| \*\*\d+\.\d{{3}}\*\* \|", out, re.MULTILINE), out
    assert re.search(r"^\| 128 \| none \| — \| — \| n/a \| [\d.]+ of [\d.]+ \| [\d.]+% \|", out, re.MULTILINE), out
    cases = json.loads((tmp_path / "speed.json").read_text())["cases"]
    assert [c["side"] for c in cases] == ["lctrain", "hf"]
    for case in cases:
        steps = [case["result"]["ready"], *case["result"]["steps"], *case["result"]["memory"]]
        assert len(steps) == 4 and all(step["ok"] for step in steps)  # ready, 1 timed step, 2 memory steps


@pytest.mark.slow
def test_bench_context_on_cpu_searches_fits_layers_and_checks_the_prediction(tmp_path: Path) -> None:
    """Three fresh processes: each side at S=256 (the start and the maximum), and lctrain with 1 layer; the search's
    2-layer probe serves as the second depth of the fit and as the full-depth check (so the error is 0 here: the
    arithmetic of the fit has its own test)."""
    command = [sys.executable, "-m", "benchmarks.bench_context", *TINY, "--sections", "search", "layers"]
    command += ["--ring", "1", "--hf-checkpointing", "full"]
    command += ["--start-seq", "256", "--max-seq", "256", "--seq-unit", "128", "--warmup-seq", "64"]
    command += ["--layer-counts", "1", "2", "--fit-seqs", "256", "--check-seq", "256", "--budget-mib", "8192"]
    command += ["--json", str(tmp_path / "context.json")]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    probe_cell = r"256 ✓ [\d,]+ MiB"
    assert re.search(rf"^\| lctrain \| ≥ 256 \| — \| [\d.]+ \| n/a \| [\d.]+ \| {probe_cell} \|$", out, re.MULTILINE), (
        out
    )
    assert re.search(r"^\| HF loop \(gradient checkpointing\) \| ≥ 256 \|", out, re.MULTILINE), out
    assert "lctrain / HF loop: **≥ 1.0×**" in out
    assert re.search(r"^\| 256 \| 2 \(predicted\) \| \*\*[\d.]+\*\* = ", out, re.MULTILINE), out
    assert re.search(r"^\| 256 \| 2 \| [\d.]+ \| [\d.]+ \| [+-]0\.0% \|$", out, re.MULTILINE), out
    probes = json.loads((tmp_path / "context.json").read_text())["probes"]
    assert len(probes) == 3 and all(p["fits"] for p in probes)
    assert all(0 < p["result"]["step_peak"] <= p["result"]["peak"] <= 8 * 2**30 for p in probes)


def test_bench_preference_one_process_path_on_cpu() -> None:
    """``run`` with one rank (the path ``--device cuda`` takes: one fresh process, its default group of one) on a
    tiny 16:1 pair, shared and unshared: a time, a peak and a growth for each side."""
    script = """
import json
from benchmarks.bench_preference import job, pair_length, run
one_rank = ("parallel.ring=1", "parallel.ulysses=1")
specs = {
    side: {"job": job("cpu", pair_length(128, 8, side == "shared"), *one_rank), "prompt": 128, "completion": 8,
           "shared": side == "shared"}
    for side in ("shared", "unshared")
}
print(json.dumps(run(specs, 0, 1, 1)))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    sides = json.loads(result.stdout.splitlines()[-1])
    assert set(sides) == {"shared", "unshared"}
    for figures in sides.values():
        assert figures["time"] > 0 and 0 < figures["growth"] <= figures["peak"], figures


def test_bench_experts_single_part_on_cpu(tmp_path: Path) -> None:
    """``--part single`` with tiny shapes (on CUDA the same code in bf16): every side's row and its step times."""
    command = [sys.executable, "-m", "benchmarks.bench_experts", "--part", "single", "--seq", "64", "--hidden", "64"]
    command += ["--layers", "1", "--experts", "4", "--expert-width", "32", "--top-k", "2", "--warmup", "0"]
    command += ["--steps", "1", "--json", str(tmp_path / "moe.json")]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for side in ("transformers grouped_mm", "transformers eager", "lctrain loop", "lctrain grouped_mm"):
        assert re.search(rf"^\| {side}( \(chosen here\))? \| \d+ \| [\d.]+ \|$", result.stdout, re.MULTILINE), (
            result.stdout
        )
    times = json.loads((tmp_path / "moe.json").read_text())["times"]
    assert len(times) == 4 and all(len(t) == 1 and t[0] > 0 for t in times.values())
