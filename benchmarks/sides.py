"""The two sides the comparison benchmarks run, built from one ``JobConfig`` in the process that trains: the same
model, initial weights, optimizer, schedule, clipping and rows on both (``docs/benchmarks.md``)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lctrain.config import JobConfig
from lctrain.data import IGNORE_INDEX, load_tokenizer
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.runtime import resolve_device
from lctrain.train.meter import proc_bytes
from lctrain.train.optim import build_optimizer, build_scheduler

SIDES = ("lctrain", "hf")
ROWS = ("one-document", "packed")


def random_rows(vocab_size: int, batch: int, seq: int, seed: int) -> Tensor:
    """Random tokens ``[batch, seq]``, the same for every ``seed`` on every side and rank."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def document_lengths(seq: int, doc_len: int) -> list[int]:
    """The documents of a packed row of ``seq`` tokens cut every ``doc_len`` tokens (the last one may be shorter)."""
    return [min(doc_len, seq - start) for start in range(0, seq, doc_len)]


def packed_batch(input_ids: Tensor, doc_len: int | None, shard: Callable[[Tensor], Tensor] = lambda x: x) -> dict:
    """A trainer micro-batch of the rows ``input_ids`` ``[B, S]`` packed with documents of ``doc_len`` tokens (None:
    one), cut to this rank's part by ``shard``."""
    batch, seq = input_ids.shape
    lengths = document_lengths(seq, doc_len or seq)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    labels[:, bounds[1:-1] - 1] = IGNORE_INDEX
    positions = torch.cat([torch.arange(length) for length in lengths]).expand(batch, seq)
    parts = {"input_ids": shard(input_ids), "labels": shard(labels), "position_ids": shard(positions)}
    return parts | {"cu_seqlens": [bounds.clone() for _ in range(batch)]}


class LctrainSide:
    """``Trainer`` on the default process group (``docs/benchmarks.md``); ``spec["precompute"]``: the (seq, seed) of
    every step it will take, whose reference log-probs a preference objective precomputes."""

    def __init__(self, cfg: JobConfig, spec: dict[str, Any]):
        from lctrain.train.job import build_training_job
        from lctrain.train.trainer import Trainer  # imported here: a process that runs the other side never needs it

        self.trainer = Trainer(build_training_job(cfg))
        self.model, self.hf_config = self.trainer.model, self.trainer.hf_config
        self.spec, self.in_use = spec, None
        if spec.get("rows") == "loader":
            self.batches = iter(self.trainer.loader)
        forward_loss, device = self.trainer.forward_loss, self.trainer.device

        def noted(*args: Any) -> Tensor:  # noting the memory in use when it returns (CUDA: allocated; CPU: resident)
            result = forward_loss(*args)
            self.in_use = torch.cuda.memory_allocated(device) if device.type == "cuda" else proc_bytes("VmRSS")
            return result

        self.trainer.forward_loss = noted
        if spec.get("precompute"):
            from lctrain.train.reference import ReferenceCache

            cache = ReferenceCache(Path(cfg.train.run_dir) / "reference.pt", "precomputed")
            self.trainer.objective.precompute_reference([[self.batch(*step)] for step in spec["precompute"]], cache)

    def batch(self, seq: int, seed: int) -> dict:
        """This rank's part of step ``seed``'s rows of ``seq`` tokens (a pair's row: the job's ``data.seq_len``)."""
        spec, place = self.spec, self.trainer.place
        if spec.get("rows") == "loader":
            return next(self.batches)
        if spec.get("rows") == "pairs":
            from testbed.pairs import pack_pairs, shard_rows

            rng, lengths = random.Random(seed), (spec["pair"]["prompt"], *[spec["pair"]["completion"]] * 2)
            pair = tuple([rng.randrange(1, 250) for _ in range(n)] for n in lengths)  # random prompt and two answers
            row = pack_pairs([pair], self.trainer.cfg.data.seq_len, shared=spec["pair"]["shared"])
            return shard_rows([row], place)
        rows = random_rows(self.hf_config.vocab_size, spec.get("batch", 1), seq, seed)
        return packed_batch(rows, spec.get("doc_len"), lambda x: place.shard(x, dim=1).contiguous())

    def step(self, batch: dict) -> dict[str, Any]:
        """One step (``part``) on ``batch``: its loss and gradient norm; with ``parts`` the seconds of each."""
        trainer, part, self.in_use = self.trainer, self.spec.get("part", "train_step"), None
        if part == "train_step":
            result = trainer.train_step([batch])
            return {"loss": result["loss"], "grad_norm": result["grad_norm"], "in_use": self.in_use}
        started = time.perf_counter()
        totals = trainer.forward_backward([batch])
        if part == "forward_backward":
            trainer.optimizer.zero_grad(set_to_none=True)
            return {"loss": None, "grad_norm": None, "in_use": self.in_use}
        middle = time.perf_counter()
        grad_norm = trainer.optimizer_step(totals.trained).item()
        seconds = {"forward_backward_s": middle - started, "optimizer_s": time.perf_counter() - middle}
        return {"loss": None, "grad_norm": grad_norm, **seconds}


class HFSide:
    """The plain loop of the module docstring, on ``train.device``."""

    def __init__(self, cfg: JobConfig, spec: dict[str, Any]):
        self.device = resolve_device(cfg.train.device)
        self.hf_config = model_config(cfg.model, len(load_tokenizer(cfg.data.tokenizer)))
        self.model = build_empty_model(self.hf_config)  # AutoModelForCausalLM.from_config(..., sdpa)
        materialize(self.model, random_init_source(self.hf_config, cfg.train.seed), self.device)
        self.model.train()
        if self.model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"the HF side's attention is {self.model.config._attn_implementation!r}, not sdpa")
        if cfg.parallel.activation_checkpointing == "full":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else float("inf")
        self.spec = spec

    def batch(self, seq: int, seed: int) -> dict:
        input_ids = random_rows(self.hf_config.vocab_size, self.spec.get("batch", 1), seq, seed)
        batch = {"input_ids": input_ids.to(self.device)}
        if self.spec.get("doc_len"):  # transformers builds the document mask from positions that restart there
            batch["position_ids"] = packed_batch(input_ids, self.spec["doc_len"])["position_ids"].to(self.device)
        return batch

    def step(self, batch: dict) -> dict[str, Any]:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(**batch, labels=batch["input_ids"]).loss  # shifted inside, mean over B·(S−1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.item(), "grad_norm": grad_norm.item()}


def lm_step(model: torch.nn.Module, input_ids: Tensor, _round: int = 0) -> None:
    """One forward and backward of a Hugging Face model's language-model loss, the gradients then dropped."""
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    model.zero_grad(set_to_none=True)
