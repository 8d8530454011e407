"""Scores computed on the training mesh: every rank runs the model on its shard of each sequence, computes logits only
at the labelled positions it holds, and the ranks sum small per-sample tensors. No rank ever holds a whole sequence's
hidden states or logits.

Order of work per sequence (``S`` tokens, this rank's part ``S / (R·U)``):

1. ``input_ids``, ``labels``, ``position_ids`` (and the global token index) are cut by the rank's
   ``SequencePlace`` on the global sequence, exactly as the packed loader shards training rows (labels shifted
   before sharding).
2. ``model(...)`` with ``logits_to_keep`` empty; a hook keeps the final hidden states ``[1, S/(R·U), H]``.
3. Logits ``hidden @ lm_head.T`` in fp32 at this rank's labelled positions only (the root FSDP module keeps the
   LM head gathered after its forward, as in training).
4. Per-sample sums (correct answer tokens, answer tokens, log-probabilities; the argmax token at each answer index)
   are all-reduced over ``dp_cp``: summed over the context-parallel ranks they are the sequence's totals, and data-
   parallel ranks fill disjoint samples (sample ``i`` belongs to dp rank ``i mod dp``).

FSDP all-gathers parameters over ``dp_cp`` in every forward, so every rank runs the same number of forwards: a dp
rank with fewer samples than the others runs one more forward whose results it drops.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.build import Job, PreparedModel, build_job, prepare_model, tokenizer_path
from lctrain.config import JobConfig
from lctrain.config.schema import EvalConfig, ObjectiveConfig
from lctrain.data import IGNORE_INDEX, PackedLoader
from lctrain.eval.passkey import PasskeySample, passkey_sample, sample_key
from lctrain.train.ruler_suite import SuiteScorer, check_job_suite
from lctrain.train.validate import dp_turns, score_rows

logger = logging.getLogger("lctrain")


def check_eval(cfg: JobConfig) -> None:
    """The eval lengths against the mesh: each one cut whole over the context-parallel ranks (``EvalConfig``
    checks its own settings)."""
    dims = cfg.parallel.dims()
    for name, lengths in (("eval.lengths", cfg.eval.lengths), ("eval.perplexity_lengths", cfg.eval.perplexity_lengths)):
        for length in lengths:
            dims.check_sequence_length(length, setting=name)


def eval_config(cfg: JobConfig) -> JobConfig:
    """The eval job's settings checked (a model to evaluate, no pipeline but for the ruler suite alone, the eval
    settings against the mesh, the ruler suite's earlier curves), as a copy whose ``data.seq_len`` is the longest
    evaluated sequence (the model and the mesh are checked against it) and without an objective (a training
    recipe's reference model is neither read nor built)."""
    if cfg.model.path is None:
        raise ValueError("eval needs a model: model.path=<a Hugging Face directory>, e.g. runs/tiny_cpu/hf")
    if cfg.parallel.pp > 1 and set(cfg.eval.tasks) - {"ruler"}:
        raise ValueError(
            f"eval does not support parallel.pp={cfg.parallel.pp} for passkey and perplexity: evaluate them with "
            f"parallel.pp=1 and the same dp, ring and ulysses (fold the pipeline ranks into parallel.dp or "
            f"parallel.ring), or set eval.tasks=[ruler]"
        )
    check_eval(cfg)
    checked = copy.deepcopy(cfg)
    ruler_lengths = cfg.ruler.suite_lengths(cfg.data.seq_len) if "ruler" in cfg.eval.tasks else []
    missing = [path for path in cfg.ruler.compare if not Path(path).is_file()] if ruler_lengths else []
    if missing:
        raise FileNotFoundError(f"ruler.compare: no such file {missing[0]!r} (a ruler.json of an earlier eval)")
    checked.data.seq_len = max([*cfg.eval.lengths, *perplexity_lengths(cfg.eval), *ruler_lengths])
    checked.objective = ObjectiveConfig()
    return checked


def prepare_eval(cfg: JobConfig, world_size: int) -> PreparedModel:
    """Every check of an eval job, before any process group exists (``eval_config``, then the job against the
    model, and the ruler suite against the model's positions)."""
    prepared = prepare_model(eval_config(cfg), world_size)
    if "ruler" in cfg.eval.tasks:
        check_job_suite(cfg, prepared.tokenizer, prepared.config.max_position_embeddings)
    return prepared


def perplexity_lengths(cfg: EvalConfig) -> list[int]:
    return list(cfg.perplexity_lengths or cfg.lengths)


def build_eval_job(cfg: JobConfig) -> Job:
    """The model of ``model.path`` on the job's mesh (USP attention, FSDP over ``dp_cp``, no optimizer), built as
    the trainer builds it (``lctrain.build.build_job``), on an initialized default process group; every check first
    (``prepare_eval``)."""
    return build_job(eval_config(cfg), training=False)


class Evaluator:
    """Scores an eval job (``build_eval_job``): passkey retrieval and perplexity (``parallel.pp > 1`` refused), and
    the ruler suite (``suite``)."""

    def __init__(self, job: Job):
        cfg = self.cfg = job.cfg
        self.rank = dist.get_rank()
        self.device, self.dims, self.place = job.device, job.mesh.dims, job.mesh.place
        self.tokenizer_path, self.tokenizer = tokenizer_path(cfg), job.prepared.tokenizer
        # dp_cp: where parameters are sharded and per-sample sums reduced
        self.dp_cp_group, self.dp_rank, self.dp = job.mesh.dp_cp, job.mesh.dp_rank, job.mesh.dims.dp
        self.samples: dict[tuple[int, float], list[PasskeySample]] = {}
        if "passkey" in cfg.eval.tasks:
            ev = cfg.eval
            for length in ev.lengths:
                for depth in ev.depths:
                    keys = [sample_key(ev.seed, length, depth, i, ev.digits) for i in range(ev.samples)]
                    self.samples[length, depth] = [passkey_sample(self.tokenizer, length, depth, k) for k in keys]
        self.model = job.model.model  # as the trainer builds it, without activation checkpointing: no backward
        self.final_hidden_states = job.model.hidden_states
        # the ruler suite, through the pipeline's stages too
        self.suite = SuiteScorer(job) if "ruler" in cfg.eval.tasks else None
        logger.info(
            "eval %s on mesh %s (%s), device %s: %s",
            cfg.model.path,
            self.dims,
            self.dims.layout,
            self.device,
            ", ".join(cfg.eval.tasks),
        )

    def shard(self, x: Tensor) -> Tensor:
        """This rank's part of ``[1, S]`` (the layout of training)."""
        return self.place.shard(x, dim=1)

    @torch.no_grad()
    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The final hidden states ``[1, S_local, H]`` of this rank's shard (``input_ids``/``position_ids``
        ``[1, S_local]``; ``cu_seqlens`` the global row's document bounds)."""
        return self.final_hidden_states(input_ids.to(self.device), position_ids.to(self.device), cu_seqlens)

    def _my_items(self, count: int) -> Iterator[tuple[int, bool]]:
        """(index, keep) for this dp rank (``dp_turns``)."""
        return dp_turns(count, self.dp_rank, self.dp)

    @torch.no_grad()
    def passkey(self) -> list[dict[str, Any]]:
        """One dict per (length, depth) cell: accuracy (every answer token is the argmax), token accuracy, mean
        log-probability of the answer, and each sample's key, needle depth, prediction and scores."""
        cells = []
        for (length, depth), samples in self.samples.items():
            width = max(len(s.answer_ids) for s in samples)
            # per sample: correct answer tokens, answer tokens, summed log-prob; the argmax token per answer index.
            # On the device: the collectives of NCCL take device tensors.
            sums = torch.zeros(len(samples), 3, dtype=torch.float64, device=self.device)
            predicted = torch.zeros(len(samples), width, dtype=torch.int64, device=self.device)
            positions = torch.arange(length)[None]
            cu_seqlens = torch.tensor([0, length], dtype=torch.int32)  # one document: the whole sample
            for index, keep in self._my_items(len(samples)):
                sample = samples[index]
                hidden = self.hidden_states(self.shard(sample.input_ids[None]), self.shard(positions), cu_seqlens)
                if not keep:
                    continue
                labels = self.shard(sample.labels[None])[0]
                where = labels != IGNORE_INDEX  # the answer positions this rank holds (often none)
                targets = labels[where].to(self.device)
                weight = self.model.lm_head.weight  # gathered by the root's forward (the sharded one before it)
                logits = hidden[0, where.to(self.device)].float() @ weight.float().t()  # [answer tokens here, V]
                logprobs = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)
                argmax = logits.argmax(dim=-1)
                sums[index, 0] = (argmax == targets).sum()
                sums[index, 1] = len(targets)
                sums[index, 2] = logprobs.double().sum()
                # answer index of each labelled position here: its global position - (answer start - 1)
                answer_index = self.shard(positions)[0][where] - (sample.answer_start - 1)
                predicted[index, answer_index.to(self.device)] = argmax
            dist.all_reduce(sums, group=self.dp_cp_group)  # cp: partial sums of a sample; dp: disjoint samples
            dist.all_reduce(predicted, group=self.dp_cp_group)
            sums, predicted = sums.cpu(), predicted.cpu()
            records = []
            for sample, (correct, total, logprob), guess in zip(samples, sums.tolist(), predicted):
                assert total == len(sample.answer_ids), (total, len(sample.answer_ids))
                records.append(
                    {
                        "key": sample.key,
                        "needle_depth": round(sample.needle_depth, 4),
                        "correct": correct == total,
                        "correct_tokens": int(correct),
                        "answer_tokens": int(total),
                        "logprob": logprob,
                        "predicted": self.tokenizer.decode(guess[: int(total)]),
                    }
                )
            cells.append(
                {
                    "length": length,
                    "depth": depth,
                    "accuracy": sum(r["correct"] for r in records) / len(records),
                    "token_accuracy": sum(r["correct_tokens"] for r in records)
                    / sum(r["answer_tokens"] for r in records),
                    "answer_logprob": sum(r["logprob"] for r in records) / len(records),
                    "samples": records,
                }
            )
            logger.info(
                "passkey length %d depth %.2f: accuracy %.2f, token accuracy %.2f, log P(answer) %.3f",
                length,
                depth,
                cells[-1]["accuracy"],
                cells[-1]["token_accuracy"],
                cells[-1]["answer_logprob"],
            )
        return cells

    @torch.no_grad()
    def perplexity(self) -> list[dict[str, Any]]:
        """One dict per length: the token-mean negative log-likelihood and its exp over ``eval.perplexity_rows``
        packed rows of the job's documents (``data.*``). Rows are packed with ``truncate=True``, so each starts at a
        document start (position 0) and every token is predicted from its document's tokens in the row. Every dp
        rank reads the same rows and scores rows ``dp_rank, dp_rank + dp, ...``: the result does not depend on
        the mesh."""
        results = []
        rows = self.cfg.eval.perplexity_rows
        for length in perplexity_lengths(self.cfg.eval):
            data = replace(self.cfg.data, seq_len=length, batch_size=1, truncate=True, tokenizer=self.tokenizer_path)
            loader = iter(PackedLoader(data, dp_rank=0, dp_size=1, place=self.place))
            batches = [next(loader) for _ in range(rows)]
            totals = score_rows(
                self.final_hidden_states,
                batches,
                dp_rank=self.dp_rank,
                dp=self.dp,
                group=self.dp_cp_group,
                device=self.device,
                chunk_tokens=self.cfg.train.loss_chunk_tokens,
            )
            nll, tokens = totals[0].tolist()  # summed NLL, predicted tokens
            mean = nll / max(tokens, 1)
            results.append({"length": length, "rows": rows, "tokens": int(tokens), "nll": mean, "ppl": math.exp(mean)})
            logger.info("perplexity at length %d: %.3f (NLL %.4f over %d tokens)", length, math.exp(mean), mean, tokens)
        return results
