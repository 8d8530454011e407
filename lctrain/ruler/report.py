"""The suite's results: the table (mean score per task x length), the effective context length, the files and the
curve of score against length (one line per checkpoint).

Effective length: the longest length L such that the mean score over the tasks is at least the threshold at L and at
every shorter length scored (and above 0). The threshold is ``ruler.relative_threshold`` (0.85) times the mean score at
the shortest length, or ``ruler.absolute_threshold`` when set (RULER's is 0.856, Llama 2 7B's score at 4K).
A model that scores 0 at the shortest length has effective length 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lctrain.config.ruler import RulerConfig


def effective_length(by_length: dict[int, float], ruler: RulerConfig) -> tuple[float, int]:
    """(threshold, effective length) of the mean scores ``by_length`` (module docstring)."""
    lengths = sorted(by_length)
    absolute = ruler.absolute_threshold
    threshold = absolute if absolute is not None else ruler.relative_threshold * by_length[lengths[0]]
    effective = 0
    for length in lengths:
        if by_length[length] <= 0 or by_length[length] < threshold - 1e-12:
            break
        effective = length
    return threshold, effective


def summarize(records: Sequence[dict[str, Any]], ruler: RulerConfig) -> dict[str, Any]:
    """Per task and length: the mean ``score``, the fraction of exact matches, the mean answer log-probability and
    the example count; per length the mean score and mean answer log-probability over the tasks (each task weighs
    the same); the threshold and the effective length. Lengths are keys as strings (as in JSON)."""
    tasks: dict[str, dict[str, dict[str, float]]] = {}
    for task in dict.fromkeys(r["task"] for r in records):
        cells = {}
        for length in sorted({r["length"] for r in records if r["task"] == task}):
            cell = [r for r in records if r["task"] == task and r["length"] == length]
            cells[str(length)] = {
                "score": sum(r["score"] for r in cell) / len(cell),
                "match": sum(r["match"] for r in cell) / len(cell),
                "logprob": sum(r["logprob"] for r in cell) / len(cell),
                "examples": len(cell),
            }
        tasks[task] = cells
    lengths = sorted({r["length"] for r in records})

    def mean(key: str) -> dict[int, float]:
        return {length: sum(cells[str(length)][key] for cells in tasks.values()) / len(tasks) for length in lengths}

    by_length = mean("score")
    threshold, effective = effective_length(by_length, ruler)
    return {
        "tasks": tasks,
        "score_by_length": {str(length): score for length, score in by_length.items()},
        "logprob_by_length": {str(length): logprob for length, logprob in mean("logprob").items()},
        "threshold": threshold,
        "effective_length": effective,
    }


def table(summary: dict[str, Any]) -> str:
    """The mean score per task (rows) and length (columns), the mean over the tasks, and the effective length."""
    lengths = list(summary["score_by_length"])
    lines = ["task \\ length  " + "".join(f"{length:>9}" for length in lengths)]
    for task, cells in summary["tasks"].items():
        lines.append(f"{task:<15}" + "".join(f"{cells[length]['score']:>9.3f}" for length in lengths))
    lines.append(f"{'mean':<15}" + "".join(f"{summary['score_by_length'][length]:>9.3f}" for length in lengths))
    lines.append(f"effective length {summary['effective_length']} (threshold {summary['threshold']:.3f})")
    return "\n".join(lines)


def metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures a training step records (``metrics.jsonl``, W&B): ``ruler/effective_length``,
    ``ruler/score_by_length`` and ``ruler/<task>`` (score by length)."""
    return {
        "ruler/effective_length": summary["effective_length"],
        "ruler/score_by_length": summary["score_by_length"],
        **{f"ruler/{task}": {k: c["score"] for k, c in cells.items()} for task, cells in summary["tasks"].items()},
    }


def write_results(directory: Path, meta: dict[str, Any], summary: dict[str, Any], records: list[dict]) -> None:
    """``ruler.json`` (``meta`` and the summary) and ``ruler_examples.jsonl`` (every example) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ruler.json").write_text(json.dumps({**meta, **summary}, indent=2) + "\n")
    seed = meta["ruler"]["seed"]
    with (directory / "ruler_examples.jsonl").open("w") as f:
        for record in records:
            f.write(json.dumps({**record, "seed": seed}) + "\n")


Curve = tuple[str, dict[str, Any]]  # (label, a summary: its score_by_length and logprob_by_length)


def read_curve(path: Path) -> Curve:
    """(label, summary) of a ``ruler.json``."""
    data = json.loads(path.read_text())
    return data.get("label", str(path)), data


def plot_curves(curves: Sequence[Curve], out: Path, title: str) -> None:
    """The mean score and the mean answer log-probability against length (log scale), one line per curve (a
    checkpoint, later ones darker), the effective length in each label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, panels = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("viridis_r")
    for number, (label, summary) in enumerate(curves):
        shade = colors(0.2 + 0.8 * (number + 1) / len(curves))
        for panel, key in zip(panels, ("score_by_length", "logprob_by_length")):
            by_length = {int(length): value for length, value in summary[key].items()}
            lengths = sorted(by_length)
            name = f"{label} (effective length {summary['effective_length']})"
            panel.plot(lengths, [by_length[length] for length in lengths], "o-", color=shade, label=name)
    panels[0].set_ylim(-0.03, 1.03)
    for panel, name in zip(panels, ("mean score over the tasks", "mean log P(answer) over the tasks")):
        panel.set_xscale("log", base=2)
        panel.set_xlabel("context length (tokens)")
        panel.set_ylabel(name)
        panel.grid(alpha=0.3)
    panels[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
