"""The preference objective run through the ``Trainer`` on hand-packed pair rows, and the single-process expectation
from TRL's formulas (``tests/helpers/pairs.py``) on the unshared layout with the plain Hugging Face model.

The pairs (64-token rows, ids below the tiny tokenizer's vocabulary) cover: a long prompt whose answers sit at the end
of the row (with ring 2 x Ulysses 2 the ranks holding the row's first half hold no completion token), a short pair
that lies wholly inside one rank's shard, and a one-token prompt (no shared-prefix document).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lctrain.config import JobConfig, ObjectiveConfig
from lctrain.models.hf import hf_name
from lctrain.train.job import build_training_job
from lctrain.train.preference import PreferenceLoss
from lctrain.train.reference import ReferenceCache
from lctrain.train.trainer import Trainer
from testbed.pairs import Pair, Row, pack_pairs, shard_rows
from tests.helpers.pairs import sequence_logps, trl_loss, trl_metrics
from tests.helpers.reference_training import SEQ_LEN, job_config, one_thread, reference_model

LOSS_TYPES = (["sigmoid"], ["ipo"], ["hinge"], ["robust"], ["simpo"], ["orpo"], ["sigmoid", "sft"])
BETA, LABEL_SMOOTHING = 0.1, 0.2


def random_pair(rng: random.Random, prompt: int, chosen: int, rejected: int) -> Pair:
    def ids(n: int) -> list[int]:
        return [rng.randrange(1, 250) for _ in range(n)]

    return ids(prompt), ids(chosen), ids(rejected)


def step_pairs(rows: int, seed: int = 0, *, fits_unshared: bool = False) -> list[list[Pair]]:
    """``rows`` rows of pairs: row 0 a long prompt with its answers at the end (none in the row's first half), row 1
    a short pair, a middle one and a one-token prompt; later rows alternate. ``fits_unshared``: prompts short enough
    that the unshared layout fits in a row too."""
    rng = random.Random(seed)
    long_prompt = 20 if fits_unshared else 40
    shapes = [
        [(long_prompt, 5, 6)],
        [(4, 3, 3), (6 if fits_unshared else 12, 8, 5), (1, 4, 4)],
    ]
    return [[random_pair(rng, *shape) for shape in shapes[i % 2]] for i in range(rows)]


def preference_job(workdir: str, run_dir: str, *, objective: dict, parallel: Sequence[str] = (), **kwargs) -> JobConfig:
    """The tiny fp32 parity job (``reference_training.job_config``) with the preference objective ``objective``."""
    cfg = job_config(workdir, run_dir, steps=1, parallel=parallel, **kwargs)
    cfg.objective = ObjectiveConfig(name="dpo", **objective)
    return cfg


def rank_micro_batches(cfg: JobConfig, trainer: Trainer, rows: Sequence[Row]) -> list[dict]:
    """This rank's micro-batches of a step's ``rows``: micro-batch m of dp rank d holds rows ``(m·dp + d)·B ...``."""
    dp, d, size = cfg.parallel.dp, trainer.mesh.dp_rank, cfg.data.batch_size
    starts = [(m * dp + d) * size for m in range(cfg.train.grad_accum)]
    return [shard_rows(rows[s : s + size], trainer.place, cfg.parallel.layout) for s in starts]


ADAPTER_B = 0.05  # every lora_B entry, so that the adapted policy differs from its base (the reference)


def run_losses(
    cfg: JobConfig,
    rows: Sequence[Row],
    loss_types: Sequence[Sequence[str]],
    *,
    adapters: bool = False,
    precompute: bool = False,
) -> dict | None:
    """For each loss combination: the step's loss, the objective's report and the full gradients (HF names), from
    ``Trainer.forward_backward`` over the step's ``rows`` (no optimizer step). Rank 0 returns them. ``adapters``:
    every ``lora_B`` set to ``ADAPTER_B`` first; ``precompute``: the reference's log-probs of the rows precomputed
    first (``PreferenceLoss.precompute_reference``), the steps looking them up."""
    trainer = Trainer(build_training_job(cfg))
    if adapters:
        set_adapters(trainer.model)
    batches = rank_micro_batches(cfg, trainer, rows)
    outer = trainer.objective
    base = getattr(outer, "inner", outer)  # a mixture of experts' objective wraps it (``RouterBalancedLoss``)
    reference, cache = base.reference, None
    if precompute:
        cache = ReferenceCache(Path(cfg.train.run_dir) / "reference_logps.pt", "the test's reference")
        base.precompute_reference([batches], cache)
    results = {}
    for types in loss_types:
        objective = PreferenceLoss(
            dataclasses.replace(cfg.objective, loss_type=list(types)),
            trainer.loader.names,
            group=base.group,
            cp_group=base.cp_group,
            device=base.device,
            chunk_tokens=base.chunk_tokens,
            reference=reference,
            last_stage=base.last_stage,
        )
        if cache is not None:
            objective.use_cache(cache)
        if outer is base:
            trainer.objective = objective
        else:
            outer.inner = objective
        step = trainer.forward_backward(batches)
        shares = torch.cat([step.loss.view(1).double(), step.sums])
        dist.all_reduce(shares)
        grads = {
            hf_name(name): param.grad.full_tensor()
            for name, param in trainer.model.named_parameters()
            if param.requires_grad
        }
        if trainer.pp_group is not None:  # every stage's gradients
            stages: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(trainer.pp_group))]
            dist.all_gather_object(stages, grads, group=trainer.pp_group)
            grads = {name: grad for stage in stages for name, grad in stage.items()}
        trainer.optimizer.zero_grad(set_to_none=True)
        report = trainer.objective.report(step.counts.tolist(), shares[1:].tolist())
        results[tuple(types)] = (shares[0].item(), report, grads)
    return results if dist.get_rank() == 0 else None


def set_adapters(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.fill_(ADAPTER_B)


def world_cases(cases: dict) -> dict | None:
    """Every case (name -> (cfg, rows, loss types, adapters, precompute)) on one process group, one after the
    other."""
    results = {
        name: run_losses(cfg, rows, types, adapters=adapters, precompute=precompute)
        for name, (cfg, rows, types, adapters, precompute) in cases.items()
    }
    return results if dist.get_rank() == 0 else None


@one_thread()
def expected_losses(
    cfg: JobConfig,
    pairs: Sequence[Pair],
    loss_types: Sequence[Sequence[str]],
    reference: torch.nn.Module | None,
    *,
    adapters: bool = False,
) -> dict:
    """The same from the plain single-process model of ``cfg`` on every ``[prompt, answer]`` alone, TRL's formulas."""
    policy_model = reference_model(cfg)
    if adapters:
        set_adapters(policy_model)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref, _ = sequence_logps(reference, pairs)
    results = {}
    for types in loss_types:
        policy, counts = sequence_logps(policy_model, pairs)
        loss = sum(trl_loss(t, policy, ref, counts, beta=BETA, label_smoothing=LABEL_SMOOTHING) for t in types)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in policy_model.named_parameters() if p.requires_grad}
        policy_model.zero_grad(set_to_none=True)
        reference_free = all(t in ("simpo", "orpo", "sft") for t in types)
        metrics = trl_metrics(policy.detach(), None if reference_free else ref, counts, BETA)
        results[tuple(types)] = (loss.item(), metrics, grads)
    return results


def base_model(cfg: JobConfig, seed: int = 0) -> torch.nn.Module:
    """The plain model of ``cfg`` without adapters, its weights from ``train.seed + seed``."""
    lora = dataclasses.replace(cfg.model.lora, rank=0)
    train = dataclasses.replace(cfg.train, seed=cfg.train.seed + seed)
    return reference_model(dataclasses.replace(cfg, train=train, model=dataclasses.replace(cfg.model, lora=lora)))


def other_model(cfg: JobConfig, path: Path) -> torch.nn.Module:
    """A model of ``cfg``'s architecture with other weights (seed + 1, no adapters), also saved as a Hugging Face
    directory at ``path`` (a reference given by path)."""
    model = base_model(cfg, seed=1)
    model.save_pretrained(path)
    return model


def packed_rows(pairs_by_row: Sequence[Sequence[Pair]], *, shared: bool = True) -> list[Row]:
    return [pack_pairs(pairs, SEQ_LEN, shared=shared) for pairs in pairs_by_row]
