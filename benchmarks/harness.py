"""What the CPU benchmarks share: the two training sides they compare (lctrain's ``Trainer.train_step`` and the
plain Hugging Face loop on the same model, weights, optimizer and schedule), the job config they run, and memory
a watchdog that ends a step that cannot fit (the resident-set helpers are in ``report.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from report import one_document_batch, peak_since_reset
from torch import Tensor

from lctrain.attention import shard_sequence
from lctrain.config import JobConfig, load_config
from lctrain.data import load_tokenizer
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.train.optim import build_optimizer, build_scheduler

MALLOC_MMAP_THRESHOLD = "65536"
ABORT_EXIT_CODE = 3
# every job: the tiny model, no checkpoints, no exports, no plots; the run directory is a temporary one
JOB_OVERRIDES = (
    "recipe=tiny_cpu",
    "train.device=cpu",
    "checkpoint.every=0",
    "checkpoint.resume=none",
    "checkpoint.export_hf=false",
    "logging.plot=false",
    "logging.progress_bar=false",
    "logging.wandb=disabled",
)


@contextlib.contextmanager
def malloc_env(*, for_memory: bool) -> Iterator[None]:
    """Processes spawned inside get ``MALLOC_MMAP_THRESHOLD_`` (memory measurements) or glibc's default (timings:
    the low threshold turns every large allocation into fresh page faults, which would time the allocator)."""
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if for_memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MALLOC_MMAP_THRESHOLD
    try:
        yield
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


def log(message: str) -> None:
    """Progress on stderr; stdout is the markdown report."""
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Memory (inside a process)
# ---------------------------------------------------------------------------------------------------------------


class BudgetWatchdog:
    """Polls VmHWM while a step runs; past ``base + budget`` it writes ``marker`` (JSON: the growth seen) and ends
    the process with ``ABORT_EXIT_CODE``: the step cannot fit, and the rest of it would only cost time and memory."""

    def __init__(self, base: int, budget: int, marker: Path, interval_s: float = 0.005):
        self.base, self.budget, self.marker, self.interval_s = base, budget, marker, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            growth = peak_since_reset() - self.base
            if growth > self.budget:
                self.marker.write_text(json.dumps({"growth": growth}))
                os._exit(ABORT_EXIT_CODE)

    def __enter__(self) -> BudgetWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------------------------------
# The two sides (inside a process)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rows:
    """Full rows of one micro-batch: random tokens ``[B, S]``, one document per row."""

    input_ids: Tensor

    @staticmethod
    def synthetic(vocab_size: int, batch: int, seq: int, seed: int) -> Rows:
        generator = torch.Generator().manual_seed(seed)
        return Rows(torch.randint(0, vocab_size, (batch, seq), generator=generator))


def job_config(overrides: Sequence[str], *, seq: int, batch: int, run_dir: str) -> JobConfig:
    return load_config(
        [*JOB_OVERRIDES, f"data.seq_len={seq}", f"data.batch_size={batch}", f"train.run_dir={run_dir}", *overrides]
    )


class LctrainSide:
    """``Trainer.train_step`` on the default process group; each rank feeds its zigzag shard of the rows."""

    def __init__(self, cfg: JobConfig):
        from lctrain.train.trainer import Trainer  # imported here: the parent process never needs it

        self.trainer = Trainer(cfg)
        self.vocab_size = self.trainer.hf_config.vocab_size
        mesh = self.trainer.mesh
        self.coords = {
            "ring_rank": mesh.get_local_rank("ring"),
            "ring_size": cfg.parallel.ring,
            "ulysses_rank": mesh.get_local_rank("ulysses"),
            "ulysses_size": cfg.parallel.ulysses,
            "layout": cfg.parallel.layout,
        }

    def step(self, rows: Rows) -> tuple[float, float]:
        """One optimizer step; (loss, grad norm)."""

        def shard(x: Tensor) -> Tensor:
            return shard_sequence(x, dim=1, **self.coords).contiguous()

        micro_batch = one_document_batch(rows.input_ids, shard)
        result = self.trainer.train_step([micro_batch])
        return result["loss"], result["grad_norm"]


class BaselineSide:
    """The plain Hugging Face + PyTorch loop: same model, weights, optimizer, schedule and clipping."""

    def __init__(self, cfg: JobConfig):
        hf_config = model_config(cfg.model, len(load_tokenizer(cfg.data.tokenizer)))
        self.vocab_size = hf_config.vocab_size
        self.model = build_empty_model(hf_config)  # AutoModelForCausalLM.from_config(..., attn_implementation="sdpa")
        materialize(self.model, random_init_source(hf_config, cfg.train.seed), torch.device("cpu"))
        self.model.train()
        if self.model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"baseline attention is {self.model.config._attn_implementation!r}, not sdpa")
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else float("inf")

    def step(self, rows: Rows) -> tuple[float, float]:
        loss = self.model(input_ids=rows.input_ids, labels=rows.input_ids).loss  # shifted inside, mean over B·(S−1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm.item()


def build_side(side: str, cfg: JobConfig) -> LctrainSide | BaselineSide:
    return LctrainSide(cfg) if side == "lctrain" else BaselineSide(cfg)
