"""A recipe's header against the planner: the memory it states as predicted and the ``python -m lctrain plan``
command it names."""

from __future__ import annotations

import json
import re
import shlex

import pytest


def planned_recipe(recipe: str, capsys: pytest.CaptureFixture[str]) -> tuple[float, dict[str, str | None], float]:
    """The memory per GPU ``recipe``'s header predicts, its planner command's flags (a flag without a value: None)
    and what that command recommends (GiB, rounded to 0.1), the command run here."""
    from lctrain.config import RECIPE_DIR
    from lctrain.planner import main as plan

    lines = (RECIPE_DIR / f"{recipe}.yaml").read_text().splitlines()
    header = "".join(line[2:] + " " for line in lines if line[:2] == "# ")
    predicted = float(re.search(r"Predicted \(not measured\) memory per GPU: ([\d.]+) GiB", header).group(1))
    command = shlex.split(re.search(r"`python -m lctrain plan ([^`]+)`", header).group(1))
    plan([*command, "--json"])
    report = json.loads(capsys.readouterr().out)
    values = [None if later.startswith("--") else later for later in [*command[1:], "--"]]
    flags = {flag: value for flag, value in zip(command, values) if flag.startswith("--")}
    return predicted, flags, round(report["recommended"]["memory_gib"]["total"], 1)
