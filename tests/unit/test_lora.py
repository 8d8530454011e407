"""LoRA through peft (``lctrain.models.lora``), without any process group: bad ``model.lora`` settings are refused
before anything runs, with one line naming the setting and the fix; ``apply_lora`` puts peft's layers on the empty
model with the names the checkpoints and the weight source expect; the adapters' initial values depend only on
the seed and the parameter name (not on the mesh, nor on the order they are asked for); the planner's LoRA states
by hand, and the LoRA recipes' headers against the planner; stages of a LoRA job hand on the merged model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lctrain.config import load_config
from lctrain.families import PROJECTIONS
from lctrain.models import build_empty_model, model_config, random_init_source
from lctrain.models.hf import hf_name
from lctrain.models.lora import adapter_source, apply_lora
from lctrain.train.trainer import check
from tests.unit.test_checkpoint_files import process_group  # noqa: F401  (a gloo group of one)

SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4"]
SMALL += ["model.num_kv_heads=2", "data.seq_len=128"]
LORA = ["model.lora.rank=4"]

# (overrides, substrings of the message)
BAD_LORA = {
    "negative_rank": (["model.lora.rank=-1"], ["model.lora.rank=-1 must be >= 1", "or 0 for full fine-tuning"]),
    "zero_alpha": ([*LORA, "model.lora.alpha=0"], ["model.lora.alpha=0.0 must be > 0", "alpha / rank"]),
    "dropout_range": ([*LORA, "model.lora.dropout=1.0"], ["model.lora.dropout=1.0 must be in [0, 1)"]),
    "dropout_with_checkpointing": (
        [*LORA, "model.lora.dropout=0.1", "parallel.activation_checkpointing=full"],
        ["model.lora.dropout=0.1 with parallel.activation_checkpointing=full", "set model.lora.dropout=0"],
    ),
    "dropout_with_chunked_mlp": (
        [*LORA, "model.lora.dropout=0.1", "parallel.mlp_chunk_tokens=32"],
        ["with parallel.mlp_chunk_tokens=32", "other dropout masks"],
    ),
    "unknown_target": (
        [*LORA, "model.lora.target_modules=[q_proj,qkv_proj]"],
        ["model.lora.target_modules has 'qkv_proj'", "model.family='llama' does not have", "q_proj, up_proj, v_proj"],
    ),
    "lm_head_target": (
        [*LORA, "model.lora.target_modules=[lm_head]"],
        ["'lm_head': the chunked loss computes the logits from the LM head's weight", "model.lora.trainable=[lm_head]"],
    ),
    "unknown_trainable": (
        [*LORA, "model.lora.trainable=[embeddings]"],
        ["model.lora.trainable has 'embeddings'", "may be embed_tokens, input_layernorm, lm_head, norm"],
    ),
    "trainable_target": (
        [*LORA, "model.lora.trainable=[q_proj]"],
        ["model.lora.trainable has 'q_proj', which gets adapters"],
    ),
    "tied_trainable_embeddings": (
        [*LORA, "model.tie_word_embeddings=true", "model.lora.trainable=[embed_tokens,norm]"],
        ["model.lora.trainable has 'embed_tokens'", "tie_word_embeddings", "leave embed_tokens out"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_LORA))
def test_bad_lora_settings_name_the_setting_and_fix(name: str) -> None:
    overrides, expected = BAD_LORA[name]
    with pytest.raises(ValueError) as error:
        check(load_config([*SMALL, *overrides]), 1)  # the check train runs before any process group
    message = str(error.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{name}: {part!r} not in {message!r}"


def lora_model(*overrides: str) -> torch.nn.Module:
    cfg = load_config([*SMALL, *LORA, *overrides])
    model = build_empty_model(model_config(cfg.model, 512))
    apply_lora(model, cfg.model.lora)
    return model


def test_apply_lora_adapts_the_projections_and_freezes_the_base() -> None:
    from peft.tuners.lora import LoraLayer

    model = lora_model("model.lora.trainable=[embed_tokens,norm]")
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert adapted == set(PROJECTIONS)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name or ".modules_to_save.default." in name for name in trainable)
    # norm matches every RMSNorm by suffix (peft's modules_to_save), as LongLoRA's "norm" does
    copies = {hf_name(name).replace("modules_to_save.default.", "") for name in trainable if "modules_to_save" in name}
    assert copies == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")
    }
    # the frozen weights keep their Hugging Face names (the checkpoint's or the random init's tensors)
    plain = {name for name, _ in build_empty_model(model.config).named_parameters()}
    assert {hf_name(name) for name, p in model.named_parameters() if not p.requires_grad} == plain
    assert all(p.is_meta for p in model.parameters())  # nothing allocated before the mesh is


def test_rank_zero_changes_nothing() -> None:
    cfg = load_config(SMALL)
    model = build_empty_model(model_config(cfg.model, 512))
    names = [name for name, _ in model.named_parameters()]
    apply_lora(model, cfg.model.lora)
    assert [name for name, _ in model.named_parameters()] == names
    assert all(p.requires_grad for p in model.parameters())


def test_adapter_init_depends_only_on_seed_and_name() -> None:
    config = model_config(load_config(SMALL).model, 512)
    base = random_init_source(config, seed=0)
    names = [
        (name, p.shape)
        for name, p in lora_model("model.lora.trainable=[norm]").named_parameters()
        if ".lora_" in name or "modules_to_save" in name
    ]
    first = {name: adapter_source(base, seed=0)(hf_name(name), shape) for name, shape in names}
    again = {name: adapter_source(base, seed=0)(hf_name(name), shape) for name, shape in reversed(names)}
    other_seed = adapter_source(base, seed=1)
    for name, shape in names:
        assert torch.equal(first[name], again[name]), name
        if ".lora_B." in name:
            assert not first[name].any()  # the adapted model starts as the base model
        elif ".lora_A." in name:  # peft's init: Kaiming-uniform, bound sqrt(1 / in_features)
            assert first[name].abs().max() <= shape[1] ** -0.5 and first[name].std() > 0
            assert not torch.equal(first[name], other_seed(hf_name(name), shape))
        else:  # a trained copy starts from the base weight
            assert torch.equal(first[name], base(hf_name(name).replace("modules_to_save.default.", ""), shape))


def test_planner_counts_lora_states_by_hand() -> None:
    """Llama-3-8B, rank 16 on every projection, embeddings and norms trained, bf16, 8 GPUs: fp32 states (12 bytes
    in the step, 16 at its end) for the trained parameters only, the frozen base in bf16 (2 bytes), all sharded."""
    from lctrain.planner import NAMED_MODELS, Layout, Workload, stage_memory

    model, layout = NAMED_MODELS["llama3-8b"], Layout(1, 1, 1, 8, "full")
    adapters = 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3)  # per layer
    trained = 32 * (adapters + 2 * 4096) + 128256 * 4096 + 4096  # + the embeddings and the final norm
    for seq_len, moment, state_bytes in ((131072, "backward", 12), (1024, "grads", 16)):
        work = Workload(seq_len, 8, lora_rank=16, lora_trainable=("embed_tokens", "norm"))
        estimate = stage_memory(model, layout, work)[0]
        assert estimate.phase == moment
        assert estimate.states == (trained * state_bytes + model.num_params * 2) / 8
        full = stage_memory(model, layout, Workload(seq_len, 8))[0]
        assert full.states > 3 * estimate.states


@pytest.mark.parametrize("recipe", ["llama3_8b_lora_128k", "llama3_8b_lora_1m"])
def test_lora_recipes_state_the_planners_prediction(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each LoRA recipe's header names the planner command behind its memory figure and marks it predicted; the
    command gives that figure, and the recipe trains what the command plans (rank, trainable modules, mesh)."""
    from tests.helpers.recipes import planned_recipe

    predicted, args, planned = planned_recipe(recipe, capsys)
    assert planned == predicted
    cfg = load_config([f"recipe={recipe}"])
    assert args["--lora-rank"] == str(cfg.model.lora.rank)
    assert args["--lora-trainable"].split(",") == cfg.model.lora.trainable
    assert args["--mesh"] == f"1,{cfg.parallel.dp},{cfg.parallel.ring},{cfg.parallel.ulysses}"
    assert int(args["--seq-len"]) == cfg.data.seq_len


def test_every_stage_but_the_last_of_a_lora_job_exports_the_merged_model(tmp_path: Path) -> None:
    """The next stage starts from the previous one's ``hf/``: with LoRA the merged model, whatever
    ``checkpoint.export_merged`` says; a stage that exports the adapter only is finished once ``adapter/`` is
    written."""
    from lctrain.train.stages import stage_configs, stage_finished

    stages = "[{train.steps: 2}, {train.steps: 3}]"
    cfg = load_config([*SMALL, *LORA, "checkpoint.export_merged=false", f"train.stages={stages}"])
    cfg.train.run_dir = str(tmp_path)
    first, last = stage_configs(cfg)
    assert first.checkpoint.export_merged and not last.checkpoint.export_merged
    assert last.model.path == f"{tmp_path}/stage_0/hf"
    (Path(last.train.run_dir) / "checkpoints" / "step_00000003" / ".metadata").parent.mkdir(parents=True)
    (Path(last.train.run_dir) / "checkpoints" / "step_00000003" / ".metadata").write_bytes(b"")
    assert not stage_finished(last)
    (Path(last.train.run_dir) / "adapter").mkdir()
    (Path(last.train.run_dir) / "adapter" / "adapter_config.json").write_text("{}")
    assert stage_finished(last)


@pytest.mark.usefixtures("process_group")
def test_fsdp_keeps_the_frozen_base_in_param_dtype_and_trains_fp32_adapters() -> None:
    """FSDP2 on a group of one with ``param_dtype`` bf16: the frozen weights are stored in bf16 (half the bytes of
    fp32), the trained ones in fp32 with fp32 gradients after a backward in bf16; the frozen ones get none."""
    from torch.distributed.device_mesh import init_device_mesh

    from lctrain.models import materialize
    from lctrain.parallel.fsdp import apply_fsdp

    model = lora_model("model.lora.trainable=[norm]")
    apply_fsdp(model, init_device_mesh("cpu", (1,)), param_dtype=torch.bfloat16)
    config = model.config
    materialize(model, adapter_source(random_init_source(config, 0), 0), torch.device("cpu"))
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    model(input_ids=torch.randint(0, config.vocab_size, (1, 16))).logits.float().square().mean().backward()
    assert all((p.grad is None) is (not p.requires_grad) for p in params.values())
    assert {p.grad.dtype for p in params.values() if p.grad is not None} == {torch.float32}


@pytest.mark.usefixtures("process_group")
def test_export_of_a_tied_model_on_a_mesh_of_one_leaves_the_model_as_trained(tmp_path: Path) -> None:
    """Tied embeddings, trained norms, FSDP2 on a group of one (which gathers a parameter without copying it): the
    merged export and the adapter on the base model give the trained model's logits, and the model, after its
    export, still does (peft merges in place: into copies)."""
    from peft import PeftModel
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lctrain.models import materialize
    from lctrain.models.lora import export_lora
    from lctrain.parallel.fsdp import apply_fsdp

    cfg = load_config([*SMALL, *LORA, "model.tie_word_embeddings=true", "model.lora.trainable=[norm]"])
    config = model_config(cfg.model, 512)
    model = build_empty_model(config)
    apply_lora(model, cfg.model.lora)
    apply_fsdp(model, init_device_mesh("cpu", (1,)))
    materialize(model, adapter_source(random_init_source(config, 0), 0), torch.device("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:  # as if trained
                noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel()))
                param.to_local().add_(noise / 20)  # a mesh of one: the local shard is the whole tensor
    input_ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
        export_lora(model, config, cfg.model.lora, tmp_path, base_path=None, merged=True)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        base = AutoModelForCausalLM.from_config(config)
        materialize(base, random_init_source(config, 0), torch.device("cpu"))
        base.tie_weights()  # materialize unties a plain model's parameters: the base is the tied one
        untrained = base(input_ids=input_ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
        assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
        for logits in (merged(input_ids=input_ids), adapted(input_ids=input_ids), model(input_ids=input_ids)):
            torch.testing.assert_close(logits.logits, trained, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(untrained, trained, atol=1e-3)
