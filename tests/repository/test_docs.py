"""The docs stay true to the code where a test can tell.

- ``docs/faults.md``: every row of its tables names at least one test as ``tests/<file>.py::<test function>``, and
  every test named there is defined in that file (so the table cannot cite a test that was renamed or removed).
- ``README.md`` and ``docs/*.md`` refer only to files and directories that exist (``docs/x.md``, ``scripts/...``,
  ``benchmarks/...``, ``docker/...``, ``lctrain/...``, ``tests/...`` written in backquotes).
- Counts the docs state about the tests (how many bad configs are refused) are the tests' own.
- ``docs/configuration.md`` has a row for every config field with its default.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
PATH_REFERENCE = re.compile(r"`((?:docs|scripts|benchmarks|examples|docker|lctrain|tests)/[\w./-]*\w)`")


def table_rows(text: str) -> list[str]:
    """The body rows of the markdown tables in ``text`` (header and separator rows left out)."""
    lines = text.splitlines()

    def separator(line: str) -> bool:
        return line.startswith("|") and set(line) <= set("|-: ")

    def header(i: int) -> bool:
        return i + 1 < len(lines) and separator(lines[i + 1])

    return [line for i, line in enumerate(lines) if line.startswith("|") and not separator(line) and not header(i)]


def test_every_fault_row_is_backed_by_an_existing_test() -> None:
    rows = table_rows((REPO / "docs" / "faults.md").read_text())
    assert len(rows) >= 15
    for row in rows:
        references = TEST_REFERENCE.findall(row)
        assert references, f"docs/faults.md: a row names no test: {row[:100]}"
        for file, name in references:
            source = (REPO / file).read_text() if (REPO / file).is_file() else ""
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"docs/faults.md names {file}::{name}"


def bad_job_count() -> int:
    from tests.unit.test_config import BAD_JOBS

    return len(BAD_JOBS)


def refused_model_count() -> int:
    from tests.unit.test_model_families import REFUSED

    return len(REFUSED)


# (doc, a pattern whose group is a figure the code determines, the figure)
FIGURES = [
    ("docs/faults.md", r"\((\d+) cases\)", bad_job_count),
    ("docs/testing.md", r"(\d+) bad configs", bad_job_count),
    ("docs/testing.md", r"(\d+) refusals of models", refused_model_count),
]


@pytest.mark.parametrize("doc,pattern,figure", FIGURES)
def test_figures_about_the_tests_come_from_the_tests(doc: str, pattern: str, figure: Callable[[], int]) -> None:
    found = [int(value) for value in re.findall(pattern, (REPO / doc).read_text())]
    assert found, f"{doc}: no figure matches {pattern!r}"
    assert set(found) == {figure()}, f"{doc} says {found}, the tests have {figure()}"


def test_table_rows_skips_headers() -> None:
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\n| c |\n|---|\n| 5 |\n"
    assert table_rows(text) == ["| 1 | 2 |", "| 3 | 4 |", "| 5 |"]


@pytest.mark.parametrize(
    "doc", ["README.md", *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md"))]
)
def test_referenced_paths_exist(doc: str) -> None:
    missing = [path for path in PATH_REFERENCE.findall((REPO / doc).read_text()) if not (REPO / path).exists()]
    assert not missing, f"{doc} refers to missing paths: {missing}"


def test_every_config_field_is_documented_with_its_default() -> None:
    import dataclasses

    from lctrain.config import JobConfig

    doc = (REPO / "docs" / "configuration.md").read_text()

    def rows(prefix: str, section: object) -> list[str]:
        found = []
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value):  # a nested section: model.rope_scaling.type, ...
                found += rows(f"{prefix}{field.name}.", value)
                continue
            default = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            found.append(f"| `{prefix}{field.name}` | `{default}` |")
        return found

    for row in rows("", JobConfig()):
        assert row in doc, f"docs/configuration.md lacks the row {row}"
