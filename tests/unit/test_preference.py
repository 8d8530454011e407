"""The preference objective in one process: the chunked per-token log-probs, every loss type through the ``Trainer``
against TRL's formulas on the plain model (a reference given by path, so rewards are not zero), the shared layout
against the unshared one, the first step with the reference = the policy, and each bad setting in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lctrain.config import ObjectiveConfig, load_config
from lctrain.train.loss import chunked_token_logprobs
from testbed.corpus import write_corpus
from tests.helpers.preference_training import (
    BETA,
    LABEL_SMOOTHING,
    LOSS_TYPES,
    expected_losses,
    other_model,
    packed_rows,
    preference_job,
    run_losses,
    step_pairs,
)


@pytest.fixture
def world_of_one():  # noqa: ANN201
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64])
def test_chunked_token_logprobs_equal_log_softmax(chunk_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (13,), generator=generator)
    upstream = torch.randn(13, generator=generator, dtype=torch.float64)
    logps = chunked_token_logprobs(hidden, weight, labels, chunk_tokens=chunk_tokens)
    expected = F.log_softmax(hidden @ weight.t(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(logps.double(), expected, atol=1e-6, rtol=1e-6)
    grads = torch.autograd.grad((logps.double() * upstream).sum(), (hidden, weight))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, atol=1e-6, rtol=1e-6)


def job(tmp_path: Path, **objective):  # noqa: ANN003, ANN201
    write_corpus(tmp_path / "corpus.jsonl", 20)
    objective = {"beta": BETA, "label_smoothing": LABEL_SMOOTHING, **objective}
    return preference_job(str(tmp_path), str(tmp_path / "run"), objective=objective, batch_size=2)


def assert_matches(result: tuple, expected: tuple, name: str) -> None:
    (loss, report, grads), (want_loss, want_metrics, want_grads) = result, expected
    assert math.isclose(loss, want_loss, rel_tol=1e-5, abs_tol=1e-7), (name, loss, want_loss)
    for metric, value in want_metrics.items():
        assert math.isclose(report[metric], value, rel_tol=1e-5, abs_tol=1e-6), (name, metric, report[metric], value)
    assert grads.keys() == want_grads.keys()
    for key, grad in want_grads.items():
        torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{name} {k}: {m}")


def test_every_loss_type_matches_trl_and_sharing_changes_nothing(world_of_one, tmp_path: Path) -> None:  # noqa: ANN001
    cfg = job(tmp_path, reference="path", reference_path=str(tmp_path / "reference"))
    reference = other_model(cfg, tmp_path / "reference")
    pairs_by_row = step_pairs(2, fits_unshared=True)
    pairs = [pair for row in pairs_by_row for pair in row]
    expected = expected_losses(cfg, pairs, LOSS_TYPES, reference)
    shared = run_losses(cfg, packed_rows(pairs_by_row), LOSS_TYPES)
    unshared = run_losses(cfg, packed_rows(pairs_by_row, shared=False), LOSS_TYPES[:2])
    for types in LOSS_TYPES:
        assert_matches(shared[tuple(types)], expected[tuple(types)], "+".join(types))
        assert shared[tuple(types)][1]["rewards/margins"] != 0
    for types in LOSS_TYPES[:2]:
        assert_matches(
            unshared[tuple(types)],
            shared[tuple(types)][:1]
            + ({k: v for k, v in shared[tuple(types)][1].items() if "/" in k}, shared[tuple(types)][2]),
            "unshared",
        )


def test_first_step_with_the_initial_policy_as_reference_is_ln2(world_of_one, tmp_path: Path) -> None:  # noqa: ANN001
    cfg = job(tmp_path)
    loss, report, _ = run_losses(cfg, packed_rows(step_pairs(2)), [["sigmoid"]])[("sigmoid",)]
    assert loss == pytest.approx(math.log(2), rel=1e-7)
    assert report["rewards/chosen"] == report["rewards/rejected"] == report["rewards/margins"] == 0.0
    assert report["rewards/accuracies"] == 0.0 and report["pairs"] == 4


BAD = {
    "objective.name=ppo": "objective.name='ppo' must be one of lm, dpo",
    "objective.loss_type=[kto]": "objective.loss_type=['kto']: give distinct terms among",
    "objective.loss_weights=[1.0,2.0]": "objective.loss_weights=[1.0, 2.0]: give one weight per objective.loss_type",
    "objective.beta=0": "objective.beta=0.0 must be > 0",
    "objective.label_smoothing=0.5": "objective.label_smoothing=0.5 must be in [0, 0.5)",
    "objective.reference=sft": "objective.reference='sft' must be one of initial, path, none",
    "objective.reference=path": "objective.reference=path with objective.reference_path=None: set both",
    "objective.reference=none": "objective.loss_type=['sigmoid'] with objective.reference=none: sigmoid compare",
}


@pytest.mark.parametrize("override", list(BAD))
def test_bad_setting_is_one_line_naming_it(override: str) -> None:
    with pytest.raises(Exception) as error:
        load_config(["objective.name=dpo", override])
    assert BAD[override] in str(error.value) and "\n" not in str(error.value).strip()


def test_reference_free_losses_need_no_reference() -> None:
    assert not ObjectiveConfig(name="dpo", loss_type=["simpo", "orpo", "sft"], reference="none").needs_reference
    assert ObjectiveConfig(name="dpo", loss_type=["sigmoid", "sft"]).needs_reference
    assert not ObjectiveConfig().needs_reference  # lm


def test_a_reference_path_without_weights_is_refused_before_any_process_group(tmp_path: Path) -> None:
    from lctrain.build import prepare_model

    cfg = job(tmp_path, reference="path", reference_path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"objective.reference_path='.*missing' has no \*\.safetensors"):
        prepare_model(cfg, 1)


def test_validation_pairs_give_trl_metrics(world_of_one, tmp_path: Path) -> None:  # noqa: ANN001
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer
    from testbed.pairs import shard_rows

    cfg = job(tmp_path, reference="path", reference_path=str(tmp_path / "reference"), loss_type=["sigmoid", "sft"])
    reference = other_model(cfg, tmp_path / "reference")
    pairs_by_row = step_pairs(3)
    trainer = Trainer(build_training_job(cfg))
    rows = [shard_rows([row]) for row in packed_rows(pairs_by_row)]
    result = trainer.objective.validate(rows, trainer.hidden_states, dp_rank=0, dp=1)
    pairs = [pair for row in pairs_by_row for pair in row]
    (loss, metrics, _) = expected_losses(cfg, pairs, [["sigmoid", "sft"]], reference)[("sigmoid", "sft")]
    assert result["val_pairs"] == len(pairs) and math.isclose(result["val_loss"], loss, rel_tol=1e-5)
    for name, value in metrics.items():
        assert math.isclose(result[f"val_{name}"], value, rel_tol=1e-5, abs_tol=1e-6), name


def test_precomputed_reference_gives_the_same_step_and_is_checked(world_of_one, tmp_path: Path) -> None:  # noqa: ANN001
    from lctrain.train.job import build_training_job
    from lctrain.train.reference import ReferenceCache
    from lctrain.train.trainer import Trainer
    from testbed.pairs import shard_rows

    cfg = job(tmp_path, reference="path", reference_path=str(tmp_path / "reference"))
    other_model(cfg, tmp_path / "reference")
    trainer = Trainer(build_training_job(cfg))
    batch = shard_rows(packed_rows(step_pairs(2)))
    computed = trainer.forward_backward([batch])
    trainer.optimizer.zero_grad(set_to_none=True)
    path = tmp_path / "cache" / "dp0.pt"
    trainer.objective.precompute_reference([[batch]], ReferenceCache(path, "this reference"))
    assert trainer.objective.reference is None and path.is_file()  # the model dropped, the cache kept
    looked_up = trainer.forward_backward([batch])
    assert looked_up.loss.item() == computed.loss.item() and torch.equal(looked_up.sums, computed.sums)
    with pytest.raises(ValueError, match="holds the reference log-probs of this reference, not of"):
        ReferenceCache.load(path, "another reference")
    batch["pair_ids"] = [ids * 0 - 7 for ids in batch["pair_ids"]]
    with pytest.raises(ValueError, match="pair -7 has no reference log-probs in .*dp0.pt"):
        trainer.forward_backward([batch])


def test_a_precomputed_reference_serves_the_pairs_under_other_paths(
    world_of_one, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """The reference log-probs a run saved by pair id, with its corpus named by an absolute path, are looked up by a
    run that names the same file by a relative path or through a symlink: nothing is computed again, the step is the
    first run's bitwise."""
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer
    from testbed.corpus import write_pair_corpus

    write_pair_corpus(tmp_path / "pairs.jsonl", 12)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "pairs.jsonl")
    monkeypatch.chdir(tmp_path)
    objective = {"reference": "path", "reference_path": str(tmp_path / "reference"), "precompute_reference": True}
    steps = []
    for paths in (str(tmp_path / "pairs.jsonl"), "pairs.jsonl", "./link.jsonl"):
        cfg = preference_job(str(tmp_path), str(tmp_path / "run"), objective=objective, data=[f"data.paths=[{paths}]"])
        if not steps:
            other_model(cfg, tmp_path / "reference")
        training_job = build_training_job(cfg)
        trainer = Trainer(training_job)
        assert trainer.objective.reference is None and trainer.objective.cache is not None
        assert training_job.base.reference is None  # the frozen model not kept by the job either
        cache = tmp_path / "run" / "reference_logps" / "dp0.pt"
        saved = cache.stat().st_mtime_ns
        step = trainer.forward_backward([next(iter(trainer.loader))])
        steps.append((step.loss.item(), step.sums.tolist(), saved))
    assert steps[1] == steps[2] == steps[0]  # the same step, from the cache the first run saved


def test_a_step_without_a_pair_is_logged_as_such(world_of_one, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """A preference step whose rows hold no pair (a mixture's text, padding) skips its update and says why in the
    objective's unit; a row without a pair beside one with pairs trains."""
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer
    from testbed.pairs import pack_pairs, shard_rows

    trainer = Trainer(build_training_job(job(tmp_path)))
    without_pairs = pack_pairs([], 64)
    with caplog.at_level("WARNING", logger="lctrain"):
        result = trainer.train_step([shard_rows([without_pairs, without_pairs])])
    assert result["pairs"] == 0 and result["grad_norm"] == 0.0
    assert any("step 1: no preference pair in this step on any rank" in r.getMessage() for r in caplog.records)
    result = trainer.train_step([shard_rows([*packed_rows(step_pairs(1)), without_pairs])])
    assert result["pairs"] == 1 and result["grad_norm"] > 0


DPO_RECIPES = ["llama31_8b_instruct_dpo_lora_128k", "llama31_8b_instruct_dpo_128k", "llama31_8b_instruct_dpo_lora_3m"]


@pytest.mark.parametrize("recipe", DPO_RECIPES)
def test_dpo_recipes_state_the_planners_prediction(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each DPO recipe's header names the planner command behind its memory figure (with its reference model), the
    command gives that figure, and the recipe trains what it plans (LoRA rank, reference, mesh, length)."""
    from tests.helpers.recipes import planned_recipe

    predicted, args, planned = planned_recipe(recipe, capsys)
    assert planned == predicted
    cfg = load_config([f"recipe={recipe}"])
    assert ("--offload" in args) == cfg.parallel.activation_offload
    assert cfg.objective.name == "dpo" and cfg.objective.reference == "initial"
    assert args["--reference"] == ("adapters" if cfg.model.lora.rank else "copy")
    assert args.get("--lora-rank", "0") == str(cfg.model.lora.rank)
    assert args["--mesh"] == f"1,{cfg.parallel.dp},{cfg.parallel.ring},{cfg.parallel.ulysses}"
    assert int(args["--seq-len"]) == cfg.data.seq_len


@pytest.mark.parametrize(
    "objective,formats,expected",
    [
        ("dpo", ["preference", "chat"], "objective.name=dpo trains on preference pairs, and data has chat sources"),
        ("dpo", ["text"], "objective.name=dpo trains on preference pairs, and data has text sources"),
        ("lm", ["chat", "preference"], "objective.name=lm would train the language-modelling loss on both answers"),
    ],
)
def test_the_objective_and_the_kinds_of_its_data_must_agree(objective: str, formats: list[str], expected: str) -> None:
    from lctrain.config.checks import check_objective_data

    with pytest.raises(ValueError, match=expected):
        check_objective_data(objective, formats)
    check_objective_data(objective, ["preference"] if objective == "dpo" else ["text", "chat"])


def test_the_trainers_check_reads_the_kinds_of_the_data(tmp_path: Path) -> None:
    """``lctrain train``'s check (before any process group) opens the sources and refuses pairs under the LM loss."""
    from lctrain.train.trainer import check
    from testbed.corpus import corpus_overrides, write_pair_corpus

    overrides = [*corpus_overrides(write_pair_corpus(tmp_path / "pairs.jsonl")), "data.format=auto"]
    with pytest.raises(ValueError, match="data has preference pairs"):
        check(load_config(overrides), 1)
    check(load_config([*overrides, "objective.name=dpo"]), 1)


def test_dpo_with_a_router_load_balancing_loss_is_refused() -> None:
    from transformers import Qwen3MoeConfig

    from lctrain.config.checks import check_model_job

    config = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True, vocab_size=256,
    )  # fmt: skip
    cfg = load_config(["model.family=qwen3_moe", "objective.name=dpo"])
    with pytest.raises(ValueError, match="set model.router_aux_loss_coef=0"):
        check_model_job(cfg, 1, config, 256)
