"""Validation's settings and its position buckets (the loss by position in the row)."""

from __future__ import annotations

import re

import pytest


def test_position_buckets_are_powers_of_four_up_to_the_row() -> None:
    from lctrain.train.validate import position_buckets

    assert position_buckets(131072) == [0, 4096, 16384, 65536, 131072]
    assert position_buckets(524288) == [0, 4096, 16384, 65536, 262144, 524288]
    assert position_buckets(1024) == [0, 64, 256, 1024]  # short rows: the first bucket is seq_len / 16
    assert position_buckets(8192) == [0, 256, 1024, 4096, 8192]
    assert position_buckets(64) == [0, 4, 16, 64]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["train.val_every=-1"], "train.val_every=-1 must be >= 0 (0 = only at the end)"),
        (["train.val_rows=0"], "train.val_rows=0 must be >= 1"),
        (
            ["parallel.pp=2", "data.val_sources=[{name: v, split: validation}]"],
            "data.val_sources with parallel.pp=2: validation runs without a pipeline",
        ),
    ],
)
def test_bad_validation_settings_name_the_setting(overrides: list[str], expected: str) -> None:
    from lctrain.config import load_config
    from lctrain.train.trainer import check_validation

    with pytest.raises(ValueError, match=re.escape(expected)):
        check_validation(load_config(overrides))
