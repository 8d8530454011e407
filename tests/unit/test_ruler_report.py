"""The suite's table, effective length (relative to the shortest length's score, or RULER's absolute threshold),
training figures, files and curve plot, from hand-made records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lctrain.config.ruler import RulerConfig
from lctrain.ruler.report import (
    effective_length,
    metrics,
    plot_curves,
    read_curve,
    summarize,
    table,
    write_results,
)


@pytest.mark.parametrize(
    "scores,ruler,expected",
    [
        # relative: 0.85 x 0.8 = 0.68 at the shortest; 2048 is the last length at or above it
        ({1024: 0.8, 2048: 0.7, 4096: 0.5, 8192: 0.7}, RulerConfig(), (0.68, 2048)),
        # a length below the threshold ends the effective length, whatever comes after it
        ({1024: 0.8, 2048: 0.6, 4096: 0.79}, RulerConfig(), (0.68, 1024)),
        ({1024: 1.0, 2048: 0.9, 4096: 0.86}, RulerConfig(relative_threshold=0.9), (0.9, 2048)),
        # RULER's absolute threshold
        ({1024: 0.95, 2048: 0.9, 4096: 0.8}, RulerConfig(absolute_threshold=0.856), (0.856, 2048)),
        ({1024: 0.5, 2048: 0.4}, RulerConfig(absolute_threshold=0.856), (0.856, 0)),
        # a model that does nothing at the shortest length has no effective length
        ({1024: 0.0, 2048: 0.0}, RulerConfig(), (0.0, 0)),
    ],
)
def test_effective_length(scores: dict, ruler: RulerConfig, expected: tuple[float, int]) -> None:
    threshold, length = effective_length(scores, ruler)
    assert threshold == pytest.approx(expected[0]) and length == expected[1]


def record(task: str, length: int, score: float, match: bool, logprob: float) -> dict:
    return {"task": task, "length": length, "score": score, "match": match, "logprob": logprob}


RECORDS = [
    record("niah_single", 512, 1.0, True, -0.5),
    record("niah_single", 512, 0.0, False, -9.5),
    record("niah_single", 1024, 0.0, False, -8.0),
    record("cwe", 512, 0.5, False, -20.0),
    record("cwe", 1024, 0.2, False, -30.0),
]


def test_summary_table_and_training_figures() -> None:
    summary = summarize(RECORDS, RulerConfig())
    assert summary["tasks"]["niah_single"]["512"] == {"score": 0.5, "match": 0.5, "logprob": -5.0, "examples": 2}
    assert summary["tasks"]["cwe"]["1024"]["score"] == 0.2
    # each task weighs the same at a length, however many examples it has
    assert summary["score_by_length"] == {"512": 0.5, "1024": pytest.approx(0.1)}
    assert summary["threshold"] == pytest.approx(0.425) and summary["effective_length"] == 512
    text = table(summary)
    assert text.splitlines()[1].split() == ["niah_single", "0.500", "0.000"]
    assert text.splitlines()[-1] == "effective length 512 (threshold 0.425)"
    figures = metrics(summary)
    assert figures["ruler/effective_length"] == 512 and figures["ruler/cwe"] == {"512": 0.5, "1024": 0.2}
    assert figures["ruler/score_by_length"] == summary["score_by_length"]


def test_files_and_one_line_per_checkpoint(tmp_path: Path) -> None:
    summary = summarize(RECORDS, RulerConfig())
    meta = {"label": "step 10", "ruler": {"seed": 3}}
    write_results(tmp_path / "step_10", meta, summary, [dict(r, prompt_ids=[1, 2]) for r in RECORDS])
    written = json.loads((tmp_path / "step_10" / "ruler.json").read_text())
    assert written["effective_length"] == 512 and written["label"] == "step 10"
    lines = (tmp_path / "step_10" / "ruler_examples.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0]) == {**RECORDS[0], "prompt_ids": [1, 2], "seed": 3}
    label, curve = read_curve(tmp_path / "step_10" / "ruler.json")
    assert label == "step 10" and curve["score_by_length"] == {"512": 0.5, "1024": pytest.approx(0.1)}
    assert curve["logprob_by_length"] == {"512": -12.5, "1024": -19.0}
    base = {"score_by_length": {"512": 0.1, "1024": 0.0}, "logprob_by_length": {"512": -30, "1024": -40},
            "effective_length": 512}  # fmt: skip
    plot_curves([("base", base), (label, curve)], tmp_path / "ruler.png", "curves")
    assert (tmp_path / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
