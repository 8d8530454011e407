"""The parallel degrees and the rules they impose: ``ParallelDims`` (world size, layout, Ulysses inside a node,
the sequence divisor) and the head and sequence-length rules of ``lctrain/rules.py``, each error naming the setting."""

import pytest

from lctrain.parallel.dims import ParallelDims
from lctrain.rules import check_sequence_length, check_ulysses_heads


def test_degrees_must_multiply_to_the_world_size() -> None:
    ParallelDims(pp=1, dp=2, ring=2, ulysses=2).check_world_size(8)
    with pytest.raises(ValueError, match=r"pp x dp x ring x ulysses = 1 x 2 x 2 x 1 = 4, but the job has 8"):
        ParallelDims(dp=2, ring=2).check_world_size(8)
    with pytest.raises(ValueError, match="parallel.ring=0 must be >= 1"):
        ParallelDims(ring=0)
    with pytest.raises(ValueError, match="parallel.layout='striped' must be one of"):
        ParallelDims(layout="striped")


def test_dims_answer_the_layout_questions() -> None:
    dims = ParallelDims(pp=2, dp=3, ring=4, ulysses=2)
    assert (dims.world_size, dims.cp, dims.dp_cp, dims.sequence_divisor) == (48, 8, 24, 16)
    assert ParallelDims(ring=4, ulysses=2, layout="contiguous").sequence_divisor == 8
    assert dims.degrees() == {"pp": 2, "dp": 3, "ring": 4, "ulysses": 2}  # what a checkpoint records
    assert str(dims) == "pp=2 dp=3 ring=4 ulysses=2"
    dims.check_ulysses_inside_nodes(4)
    with pytest.raises(ValueError, match="parallel.ulysses=2 does not divide the 3 processes per node"):
        dims.check_ulysses_inside_nodes(3)
    with pytest.raises(ValueError, match=r"data.seq_len=24 is not divisible by 16 \(2·ring·ulysses"):
        dims.check_sequence_length(24)


def test_model_and_sequence_rules_name_the_setting() -> None:
    with pytest.raises(ValueError, match="parallel.ulysses=4 does not divide the 6 attention heads"):
        check_ulysses_heads(6, 6, 4)
    with pytest.raises(ValueError, match="parallel.ulysses=4 and the 3 key/value heads"):
        check_ulysses_heads(12, 3, 4)
    check_ulysses_heads(8, 2, 4)  # key/value heads replicated
    with pytest.raises(ValueError, match=r"data.seq_len=100 is not divisible by 8 \(2·ring·ulysses"):
        check_sequence_length(100, layout="zigzag", ring=2, ulysses=2)
    check_sequence_length(100 - 100 % 4, layout="contiguous", ring=2, ulysses=2)
