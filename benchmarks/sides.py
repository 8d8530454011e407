"""The two sides the comparison benchmarks run, built from one ``JobConfig`` in the process that trains (a fresh
process or a rank of a spawned group: ``runs.py``): the same model, initial weights (lctrain's seeded init),
optimizer, schedule, clipping and rows on both.

- ``lctrain``: ``Trainer(build_training_job(cfg)).train_step([batch])`` on the default process group: USP attention,
  FSDP2 (also at world size 1), the chunked loss, ``parallel.*`` as configured (bf16 on CUDA, fp32 on CPU by
  default); each rank feeds its zigzag shard of the rows.
- ``hf``: the plain Hugging Face + PyTorch loop in one process: ``LlamaForCausalLM`` (sdpa attention, fp32 weights,
  under ``torch.autocast(bfloat16)`` on CUDA), ``loss = model(input_ids=x, labels=x).loss`` (full logits, Hugging
  Face's loss), ``backward``, ``clip_grad_norm_`` to ``optim.max_grad_norm``, lctrain's AdamW (fused, the same
  parameter groups) and schedule; Hugging Face's gradient checkpointing (non-reentrant) when
  ``parallel.activation_checkpointing`` is ``full``.

Rows: random tokens ``[B, S]``, one document per row, or packed with documents of ``doc_len`` tokens (lctrain skips
attention across documents; the plain loop is given the restarting ``position_ids``, from which transformers builds
the document mask for sdpa).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lctrain.config import JobConfig
from lctrain.data import IGNORE_INDEX, load_tokenizer
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.runtime import resolve_device
from lctrain.train.optim import build_optimizer, build_scheduler

SIDES = ("lctrain", "hf")
ROWS = ("one-document", "packed")


def random_rows(vocab_size: int, batch: int, seq: int, seed: int) -> Tensor:
    """Random tokens ``[batch, seq]``, the same for every ``seed`` on every side and rank."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def document_lengths(seq: int, doc_len: int) -> list[int]:
    """The documents of a packed row of ``seq`` tokens cut every ``doc_len`` tokens (the last one shorter if
    ``doc_len`` does not divide ``seq``)."""
    return [min(doc_len, seq - start) for start in range(0, seq, doc_len)]


def packed_batch(input_ids: Tensor, doc_len: int | None, shard: Callable[[Tensor], Tensor] = lambda x: x) -> dict:
    """A trainer micro-batch of the full rows ``input_ids`` ``[B, S]``, each packed with documents of ``doc_len``
    tokens (``document_lengths``; None: one document per row): labels shifted within each document (a document's
    last token predicts nothing), positions restarting at 0 at each document start, cut to this rank's part by
    ``shard``."""
    batch, seq = input_ids.shape
    lengths = document_lengths(seq, doc_len or seq)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    labels[:, bounds[1:-1] - 1] = IGNORE_INDEX
    positions = torch.cat([torch.arange(length) for length in lengths]).expand(batch, seq)
    return {
        "input_ids": shard(input_ids),
        "labels": shard(labels),
        "position_ids": shard(positions),
        "cu_seqlens": [bounds.clone() for _ in range(batch)],
    }


class LctrainSide:
    """``Trainer.train_step`` on the default process group; each rank feeds its shard of the rows."""

    def __init__(self, cfg: JobConfig):
        from lctrain.train.job import build_training_job
        from lctrain.train.trainer import Trainer  # imported here: a process that runs the other side never needs it

        self.trainer = Trainer(build_training_job(cfg))
        self.model, self.hf_config = self.trainer.model, self.trainer.hf_config
        self.place = self.trainer.place

    def shard(self, x: Tensor) -> Tensor:
        return self.place.shard(x, dim=1).contiguous()

    def step(self, input_ids: Tensor, doc_len: int | None = None) -> tuple[float, float]:
        """One optimizer step on the full rows ``input_ids`` (documents of ``doc_len``); (loss, grad norm), read back
        at the end: the device's work is done."""
        result = self.trainer.train_step([packed_batch(input_ids, doc_len, self.shard)])
        return result["loss"], result["grad_norm"]


class HFSide:
    """The plain loop of the module docstring, on ``train.device``."""

    def __init__(self, cfg: JobConfig):
        self.device = resolve_device(cfg.train.device)
        self.hf_config = model_config(cfg.model, len(load_tokenizer(cfg.data.tokenizer)))
        self.model = build_empty_model(
            self.hf_config
        )  # AutoModelForCausalLM.from_config(..., attn_implementation="sdpa")
        materialize(self.model, random_init_source(self.hf_config, cfg.train.seed), self.device)
        self.model.train()
        if self.model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"the HF side's attention is {self.model.config._attn_implementation!r}, not sdpa")
        if cfg.parallel.activation_checkpointing == "full":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else float("inf")

    def step(self, input_ids: Tensor, doc_len: int | None = None) -> tuple[float, float]:
        x = input_ids.to(self.device)
        extra = {}
        if doc_len:  # transformers builds the document mask from positions that restart at each document
            extra["position_ids"] = packed_batch(input_ids, doc_len)["position_ids"].to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=x, labels=x, **extra).loss  # shifted inside, mean over B·(S−1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm.item()


def build_side(side: str, cfg: JobConfig) -> LctrainSide | HFSide:
    return LctrainSide(cfg) if side == "lctrain" else HFSide(cfg)
