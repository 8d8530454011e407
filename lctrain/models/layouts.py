"""Checkpoint layouts: how a Hugging Face checkpoint's tensors map to the model's, read and written with
transformers' own conversions.

transformers 5 holds some weights in memory under other names and shapes than its checkpoints: a mixture of
experts' experts are one 3D tensor per projection (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj``), where the **published** layout (every checkpoint on the Hub, and what ``save_pretrained``
writes by default) has one tensor per expert (Qwen3-MoE's ``mlp.experts.0.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.0.w1.weight``). ``from_pretrained`` converts on load with the transforms transformers
declares per model type (``transformers.conversion_mapping.get_model_conversion_mapping``: renames, per-expert
tensors stacked and concatenated) and reverts them on save. lctrain applies those transforms and writes none of its
own: a family for which transformers declares none (Llama, Mistral, Qwen2, Qwen3) has one layout, its in-memory
names being its published ones.

- **Reading** (``checkpoint_source``): the checkpoint's tensor names (its index, or its files' headers) are renamed
  as ``from_pretrained`` renames them and grouped by the model tensor each group makes; a model tensor is read when
  ``materialize`` asks for it (its sources memory-mapped and converted then, one full tensor at a time, on every rank
  for its own shard, as for a plain checkpoint), so no rank reads the whole model. A checkpoint in transformers'
  **fused** layout (its in-memory names: ``save_pretrained(save_original_format=False)``, or lctrain's export with
  ``checkpoint.export_layout=fused``) passes the renames unchanged and loads through the same code. Before any
  weight is read, every model tensor must have its sources, else one line names the first missing tensor, the
  layouts tried and the fix (``CheckpointLayoutError``).
- **Dequantizing** (``dequantizer``): gpt-oss's published experts are MXFP4 (``*_blocks``, ``*_scales``);
  transformers' own MXFP4 dequantization converts them on read, as ``from_pretrained`` with
  ``Mxfp4Config(dequantize=True)`` does, and the model trains and exports full-precision weights.
- **Writing** (``to_layout``): full tensors under the model's names to the published layout (transformers' reverse
  transforms, as ``save_pretrained`` applies them) or kept fused.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor
from transformers import Mxfp4Config, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)
from transformers.quantizers import AutoHfQuantizer, HfQuantizer

logger = logging.getLogger("lctrain")

TensorSource = Callable[[str, torch.Size], Tensor]
WEIGHTS_NAME = "model.safetensors"
# what a checkpoint read is, in the log line and the planner's table
LAYOUT_WORDS = {
    "published": "the published layout (converted on load as from_pretrained converts it)",
    "fused": "transformers' fused in-memory layout",
    "single": "its one layout (transformers declares no conversion for the family)",
}


class CheckpointLayoutError(ValueError):
    """A checkpoint whose tensors do not make the model: named in one line with the layouts tried and the fix."""


def checkpoint_files(path: str | Path, setting: str = "model.path") -> dict[str, Path]:
    """Each tensor name of the Hugging Face checkpoint in ``path`` (the job's ``setting``) and the ``*.safetensors``
    file holding it: from ``model.safetensors.index.json`` (a sharded checkpoint) or the files' headers. A file that
    cannot be read, or an index naming a missing file, is named."""
    path = Path(path)
    index = path / f"{WEIGHTS_NAME}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointLayoutError(f"{index} is not a safetensors index ({error}): write it again") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise FileNotFoundError(f"{index} names {file.name}, which is not in {path}")
        return files
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        files.update(dict.fromkeys(_tensor_names(file), file))
    if not files:
        raise FileNotFoundError(f"{setting}={str(path)!r} has no *.safetensors weights")
    return files


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise CheckpointLayoutError(f"{file} is not a readable safetensors file ({error})") from None


@dataclass
class _Group:
    """The checkpoint tensors that make one or more model tensors: a renamed tensor (``converter`` None) or the
    sources of a transformers ``WeightConverter`` (in checkpoint order, with the source pattern each matched)."""

    converter: WeightConverter | None
    sources: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint name, source pattern)


@dataclass
class LayoutPlan:
    """Which checkpoint tensors make each model tensor (``groups`` by the name transformers gives each group, and
    ``made_by``: model tensor name -> that group's name), and what the checkpoint is: ``layout`` is ``published``
    (transformers' conversion of the model type applied), ``fused`` (the model's in-memory names, where the type
    declares a conversion) or ``single`` (the type declares none: both layouts are the same)."""

    model_type: str
    groups: dict[str, _Group]
    made_by: dict[str, str]
    layout: str
    unused: list[str]  # checkpoint tensors that make no model tensor (e.g. a vision tower beside a language model)


@dataclass(frozen=True)
class Reading:
    """How a checkpoint of another kind than the model is read: ``quantizer`` dequantizes it (``dequantizer``),
    ``key_mapping`` renames its tensors (``from_pretrained``'s option of that name: an image-text checkpoint's
    language model, ``families.LANGUAGE_MODELS``)."""

    quantizer: HfQuantizer | None = None
    key_mapping: dict[str, str] | None = None


def conversions(model: PreTrainedModel, *, legacy: bool, reading: Reading | None = None) -> list:
    """transformers' transforms from the published layout to ``model``'s in-memory one, for its model type and its
    sub-models: ``from_pretrained``'s, with (``legacy``) the renames of old checkpoints' names it also applies, and
    ``reading``'s renames and dequantization."""
    reading = reading or Reading()
    return get_model_conversion_mapping(
        model, key_mapping=reading.key_mapping, hf_quantizer=reading.quantizer, add_legacy=legacy
    )


def dequantizer(quantization: dict | None) -> HfQuantizer | None:
    """transformers' quantizer that dequantizes a pre-quantized checkpoint of ``quantization`` (its config.json's
    ``quantization_config``) as it loads, as ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
    does: gpt-oss's MXFP4 experts (``*_blocks`` and ``*_scales``) become full-precision weights. None: an unquantized
    checkpoint; another quantization is refused by ``lctrain.config.checks.check_model_features``."""
    if not quantization or quantization.get("quant_method") != "mxfp4":
        return None
    return AutoHfQuantizer.from_config(Mxfp4Config(dequantize=True), pre_quantized=True)


def plan_checkpoint(
    names: list[str], model: PreTrainedModel, source: str, reading: Reading | None = None
) -> LayoutPlan:
    """Map the checkpoint tensor ``names`` onto ``model`` (empty, on meta) as ``from_pretrained`` does (read as
    ``reading`` says). Raises ``CheckpointLayoutError`` naming the first model tensor no checkpoint tensor makes.
    ``source`` names the checkpoint in messages (``model.path='...'``)."""
    transforms = conversions(model, legacy=True, reading=reading)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    expected = {name: tensor for name, tensor in model.state_dict().items()}
    prefix = model.base_model_prefix
    groups: dict[str, _Group] = {}
    made_by: dict[str, str] = {}
    unused, converted = [], False
    for name in sorted(names, key=dot_natural_key):
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        if renamed not in expected and name in expected:  # from_pretrained's fallback: the name is the model's own
            renamed, pattern = rename_source_key(name, [], [], prefix, expected)
        if renamed not in expected:
            unused.append(name)
            continue
        converted |= renamed != name or pattern is not None
        if pattern is None:
            groups[renamed] = _Group(None, [(name, name)])
            made_by[renamed] = renamed
            continue
        group = groups.setdefault(renamed, _Group(copy.deepcopy(by_pattern[pattern])))
        group.sources.append((name, pattern))
        for target in group.converter.target_patterns:  # a one-to-many conversion makes each of its targets
            made_by[renamed.replace(group.converter.target_patterns[0], target)] = renamed
    own = conversions(model, legacy=False)
    layout = "published" if converted else ("fused" if own else "single")
    plan = LayoutPlan(model.config.model_type, groups, made_by, layout, unused)
    _check_complete(plan, model, names, own, source)
    return plan


def _check_complete(plan: LayoutPlan, model: PreTrainedModel, names: list[str], own: list, source: str) -> None:
    """Every parameter of ``model`` (tied ones once) made by some checkpoint tensor, else one line naming the first
    missing one. ``own``: the model type's conversions (no legacy renames)."""
    for name, _ in model.named_parameters():
        if name in plan.made_by:
            continue
        tried = (
            f"transformers' published layout of {plan.model_type} (its conversion: {'; '.join(map(_describe, own))}) "
            f"and its fused in-memory layout"
            if own
            else f"the one layout of {plan.model_type} (transformers' in-memory names are its published names)"
        )
        near = difflib.get_close_matches(name, names, n=1, cutoff=0)[0]
        raise CheckpointLayoutError(
            f"{source}: no tensor of the checkpoint makes {name!r} (tried {tried}; the nearest it has is {near!r}): "
            f"is it a {plan.model_type} checkpoint written by transformers' save_pretrained, as its config.json says? "
            f"Point model.path at a checkpoint whose weights match its config.json"
        )


def _describe(transform: WeightRenaming | WeightConverter) -> str:
    """A transform's patterns in a line: ``a + b -> c``."""
    return f"{' + '.join(transform.source_patterns)} -> {', '.join(transform.target_patterns)}"


def checkpoint_source(
    files: dict[str, Path], model: PreTrainedModel, source: str, reading: Reading | None = None
) -> tuple[TensorSource, LayoutPlan]:
    """Full model tensors by name from the checkpoint whose tensors are in ``files`` (``checkpoint_files``), in any
    layout ``plan_checkpoint`` reads (as ``reading`` says), and the plan. ``model``: the
    job's model, empty (on meta), of which only the names, shapes and config are read. Each call ``read(name,
    shape)`` reads and converts that tensor's sources (a one-to-many conversion's other outputs are kept until they
    are asked for); a shape other than ``shape`` is named."""
    plan = plan_checkpoint(list(files), model, source, reading)
    if plan.unused:
        logger.warning(
            "%s: %d tensors of the checkpoint are not part of the %s model and are not read (first: %s)",
            source,
            len(plan.unused),
            plan.model_type,
            plan.unused[0],
        )
    made: dict[str, Tensor] = {}  # outputs of a one-to-many conversion not asked for yet

    def open_tensor(name: str) -> Callable[[], Tensor]:
        def load() -> Tensor:
            with safe_open(files[name], "pt") as f:
                return f.get_tensor(name)

        return load

    def read(name: str, shape: torch.Size) -> Tensor:
        if name not in plan.made_by:
            raise KeyError(f"{source}: the {plan.model_type} model has no tensor {name!r}")
        if name not in made:
            group_name = plan.made_by[name]
            group = plan.groups[group_name]
            if group.converter is None:
                made[name] = open_tensor(group.sources[0][0])()
            else:
                converter = copy.deepcopy(group.converter)
                for checkpoint_name, pattern in group.sources:
                    converter.add_tensor(group_name, checkpoint_name, pattern, open_tensor(checkpoint_name))
                try:
                    outputs = converter.convert(group_name, model=model, config=model.config)
                except Exception as error:  # transformers' conversion ops raise what torch raises
                    cause = str(error).strip().splitlines()[-1]
                    raise CheckpointLayoutError(
                        f"{source}: {name}{_origin(name, group)} cannot be made ({cause}): the checkpoint's "
                        f"config.json does not describe its weights"
                    ) from None
                for target, tensor in outputs.items():
                    made[target] = tensor[0] if isinstance(tensor, list) else tensor
        tensor = made.pop(name)
        if tensor.shape != shape:
            raise CheckpointLayoutError(
                f"{source}: {name}{_origin(name, plan.groups[plan.made_by[name]])} has shape {tuple(tensor.shape)}, "
                f"the model {tuple(shape)}: the checkpoint's config.json does not describe its weights"
            )
        return tensor

    return read, plan


def _origin(name: str, group: _Group) -> str:
    """`` (made from a, b, ...)``: the checkpoint tensors a model tensor is converted from; '' for its own name."""
    sources = [checkpoint_name for checkpoint_name, _ in group.sources]
    return "" if sources == [name] else f" (made from {', '.join(sources[:2])}{', ...' * (len(sources) > 2)})"


def to_layout(tensors: dict[str, Tensor], model: PreTrainedModel, layout: str) -> dict[str, Tensor]:
    """Full tensors under ``model``'s in-memory names (all of the model's, or a pipeline stage's) in ``layout``:
    ``published`` applies transformers' reverse conversions as ``save_pretrained`` does (per-expert tensors, the
    family's published names), ``fused`` keeps them. ``model`` (empty) gives the conversions."""
    if layout == "fused":
        return tensors
    published = revert_weight_conversion(model, tensors)
    # a reverse conversion's outputs (new names) are views of the fused tensor; safetensors stores each on its own
    return {name: tensor if name in tensors else tensor.clone() for name, tensor in published.items()}
