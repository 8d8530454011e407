"""Validation's position buckets (the loss by position in the row); its settings are checked with the config's
(``tests/unit/test_config.py::test_bad_validation_settings_name_the_setting``)."""

from __future__ import annotations


def test_position_buckets_are_powers_of_four_up_to_the_row() -> None:
    from lctrain.train.validate import position_buckets

    assert position_buckets(131072) == [0, 4096, 16384, 65536, 131072]
    assert position_buckets(524288) == [0, 4096, 16384, 65536, 262144, 524288]
    assert position_buckets(1024) == [0, 64, 256, 1024]  # short rows: the first bucket is seq_len / 16
    assert position_buckets(8192) == [0, 256, 1024, 4096, 8192]
    assert position_buckets(64) == [0, 4, 16, 64]
