"""The files of an evaluation: ``passkey.json`` + ``passkey.png`` (accuracy heat map, depth × length) and
``perplexity.json``, and a text table of the passkey accuracies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def accuracy_grid(cells: list[dict[str, Any]], key: str = "accuracy") -> tuple[list[int], list[float], list[list]]:
    """(lengths, depths, grid) with ``grid[d][l]`` the ``key`` of the cell (depths[d], lengths[l])."""
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    by_cell = {(c["length"], c["depth"]): c[key] for c in cells}
    return lengths, depths, [[by_cell.get((length, depth)) for length in lengths] for depth in depths]


def passkey_table(cells: list[dict[str, Any]]) -> str:
    """Accuracy per depth (rows) and length (columns), as text."""
    lengths, depths, grid = accuracy_grid(cells)
    lines = ["depth \\ length " + "".join(f"{length:>8d}" for length in lengths)]
    for depth, row in zip(depths, grid):
        lines.append(f"{depth:>14.2f} " + "".join(f"{value:>8.2f}" for value in row))
    return "\n".join(lines)


def plot_passkey(cells: list[dict[str, Any]], out: Path, title: str) -> None:
    """The heat map of accuracy: needle depth (rows) × length (columns), each cell annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths, grid = accuracy_grid(cells)
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for row, values in enumerate(grid):
        for col, value in enumerate(values):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{depth:.2f}" for depth in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="passkey accuracy")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
