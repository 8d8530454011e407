"""Does a checkpoint fit the model? Keys and shapes compared before loading, across all ranks, so that a checkpoint of
another model is refused on every rank with the first mismatching key, both shapes and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lctrain.checkpoint.checksums import MANIFEST
from lctrain.checkpoint.errors import ERRORS, Problem, all_gather, config_hint, fix_hint
from lctrain.checkpoint.safe_read import read_metadata


def _shape(size: Any) -> str:
    return str(list(size))


def _describe(key: str) -> str:
    """A DCP key as the message names it: ``model.<HF name>`` for weights, ``optim.<flat key>`` for the rest."""
    top, _, name = key.partition(".")
    return f"weight {name}" if top == "model" else f"optimizer entry {name}"


def _local_mismatches(path: Path, files: frozenset[str], state: dict[str, Any]) -> tuple[list[Problem], list[str]]:
    """This rank's first key that does not fit the checkpoint (at most one problem), and its weight keys."""
    metadata = read_metadata(path)
    outside = sorted({info.relative_path for info in metadata.storage_data.values()} - files)
    if outside:
        message = (
            f"{path / '.metadata'} refers to {outside[0]}, which is not among the files checksummed in "
            f"{path / MANIFEST}: the checkpoint is damaged; {fix_hint(path)}"
        )
        return [((0,), "ValueError", message)], []
    saved = metadata.state_dict_metadata
    expected = {f"{top}.{key}": value for top in ("model", "optim") for key, value in state[top].items()}  # as DCP's
    problems: list[Problem] = []
    for index, (key, value) in enumerate(expected.items()):
        if not isinstance(value, torch.Tensor):
            continue  # plain optimizer hyperparameters: DCP checks those
        order = (1 if key.startswith("model.") else 3, dist.get_rank(), index)
        md = saved.get(key)
        if md is None:
            problems.append((order, "ValueError", f"it has no {_describe(key)}, which this model has"))
        elif not isinstance(md, TensorStorageMetadata):
            problems.append((order, "ValueError", f"its {_describe(key)} is not a tensor"))
        elif list(md.size) != list(value.shape):
            message = f"its {_describe(key)} has shape {_shape(md.size)} and this model's {_shape(value.shape)}"
            problems.append((order, "ValueError", message))
        else:
            continue
        break  # the first one of this rank
    # the checkpoint's weights that no rank's model may have (the union is known after the gather)
    unknown = [key for key in saved if key.startswith("model.") and key not in expected]
    return problems, unknown


def check_matches(path: Path, files: frozenset[str], state: dict[str, Any]) -> None:
    """Raise on every rank if the checkpoint does not hold exactly this model's weights (the union of all ranks'
    with pipeline parallelism), with these shapes. Collective."""
    try:
        local = _local_mismatches(path, files, state)
    except ValueError as error:
        local = ([((0,), "ValueError", str(error))], [])
    except Exception as error:  # keep the collective going whatever happens
        local = ([((0,), "ValueError", f"{path} cannot be checked against this model: {error!r}")], [])
    gathered = all_gather(local)
    problems = [problem for rank_problems, _ in gathered for problem in rank_problems]
    if not problems:  # a weight of the checkpoint that no rank's model has
        unknown = set.intersection(*(set(keys) for _, keys in gathered))
        first = next((key for key in gathered[0][1] if key in unknown), None)
        if first is not None:
            problems.append(((2,), "ValueError", f"it holds {_describe(first)}, which this model does not have"))
    if problems:
        order, kind, message = min(problems)
        if order[0] != 0:
            message = (
                f"{path} does not match this model: {message}. A checkpoint loads only into the model it was saved "
                f"from: the model.* settings must match the run that saved it{config_hint(path)}"
            )
        raise ERRORS[kind](message)
