"""The single-process reference that trainer parity tests compare against, and the helpers that run the trainer.

The reference is the plain model (same random init, sdpa attention) run on each document piece of each full row
as a sequence of its own (one right-padded batch per step; position ids as the packer gives them: 0 at a document
start, continuing for a document carried over from the previous row), over the rows that every dp rank's
``PackedLoader`` yields for every micro-batch of the step. Its loss is the token-summed cross-entropy over all of
them divided by their valid tokens, plus for a mixture of experts its router's load-balancing loss
(``router_aux_coef`` times the mean over the rows of transformers' ``load_balancing_loss_func`` of each whole row's
tokens, ``rows_router_loss``); then ``torch.nn.utils.clip_grad_norm_``, and AdamW with the trainer's parameter
groups (``build_optimizer``) and warmup + cosine schedule (``build_scheduler``).

The corpus is a jsonl file of short and long documents (cut from a stdlib source file), so packed rows hold several
documents and documents continue across rows; the reference asserts both. Other data (``data``: conversations, a
mixture) replaces it; the labels are the loader's, so masked tokens are left out of the reference's loss as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM

from lctrain.build import tokenizer_path
from lctrain.config import JobConfig, load_config
from lctrain.data import IGNORE_INDEX, PackedLoader, load_tokenizer
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.models.hf import hf_name
from lctrain.models.lora import adapter_source, apply_lora
from lctrain.models.moe import router_aux_coef
from lctrain.train.job import build_training_job
from lctrain.train.optim import build_optimizer, build_scheduler
from lctrain.train.trainer import Trainer

SEQ_LEN = 64
MAX_GRAD_NORM = 0.5  # below most steps' gradient norms: clipping is active
# a tiny gpt-oss: windows of 8 on every other layer, 4 experts, top 2, the router's load-balancing loss
GPT_OSS = (
    "model.family=gpt_oss",
    "model.sliding_window=8",
    "model.num_experts=4",
    "model.experts_per_token=2",
    "model.router_aux_loss_coef=0.1",
)


def job_config(
    workdir: str,
    run_dir: str,
    *,
    steps: int,
    num_layers: int = 2,
    batch_size: int = 1,
    grad_accum: int = 1,
    parallel: Sequence[str] = (),
    model: Sequence[str] = (),
    data: Sequence[str] = (),
) -> JobConfig:
    """The tiny fp32 job of the parity tests on ``<workdir>/corpus.jsonl``; ``parallel`` = ``parallel.*``
    overrides, ``model`` = ``model.*`` overrides (another family, a window, a checkpoint), ``data`` = ``data.*``
    overrides that replace the corpus (other files, ``data.sources``)."""
    return load_config(
        [
            "model.hidden_size=64",
            "model.intermediate_size=128",
            f"model.num_layers={num_layers}",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            *model,
            *(data or [f"data.paths=[{workdir}/corpus.jsonl]"]),
            f"data.seq_len={SEQ_LEN}",
            f"data.batch_size={batch_size}",
            *parallel,
            "optim.lr=2e-3",
            "optim.warmup_steps=5",
            f"optim.max_grad_norm={MAX_GRAD_NORM}",
            f"train.steps={steps}",
            f"train.grad_accum={grad_accum}",
            "train.loss_chunk_tokens=24",  # several chunks per rank, the last one partial
            "train.device=cpu",
            f"train.run_dir={run_dir}",
            "checkpoint.every=0",
            "checkpoint.resume=none",
            "checkpoint.export_hf=false",
            "logging.plot=false",
            "logging.progress_bar=false",
        ]
    )


def train_case(cfg: JobConfig) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """Per-step losses and gradient norms of ``Trainer.train()``, and the full gradients of the first step (with
    pipeline stages: of every stage, gathered to each rank)."""
    trainer = Trainer(build_training_job(cfg))
    grads: dict[str, torch.Tensor] = {}
    norms: list[float] = []
    optimizer_step = trainer.optimizer_step

    def capturing_optimizer_step(trained: torch.Tensor) -> torch.Tensor:
        if not grads:  # the first step's gradients, before clipping (full_tensor: a collective, every rank calls it)
            for name, param in trainer.model.named_parameters():
                if param.requires_grad:  # with LoRA: the adapters and trained copies
                    # a copy: on a mesh of one, full_tensor is the gradient itself, which clipping scales in place
                    grads[hf_name(name)] = param.grad.full_tensor().clone()
            if trainer.pp_group is not None:
                stages: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(trainer.pp_group))]
                dist.all_gather_object(stages, grads, group=trainer.pp_group)
                grads.update({name: grad for stage in stages for name, grad in stage.items()})
        norm = optimizer_step(trained)
        norms.append(norm.item())
        return norm

    trainer.optimizer_step = capturing_optimizer_step
    losses = trainer.train()
    return losses, norms, grads


def case_configs(job: Callable[..., JobConfig], workdir: str, cases: Iterable[str], resumed: str) -> dict:
    """The configs of ``cases_then_resumed``, made once in the test process and handed to the ranks (composing a
    config with Hydra costs about 0.3 s of CPU; each of 4 ranks composing its own was 4 times that):
    ``job(workdir, case)`` for every case, and under ``"resumed"`` ``resumed_configs`` of ``resumed`` as the run
    ``resumed``. ``job(workdir, case, run=..., steps=...)`` makes a case's config."""
    configs: dict = {case: job(workdir, case) for case in cases}
    configs["resumed"] = resumed_configs(job, workdir, resumed, "resumed")
    return configs


def cases_then_resumed(configs: dict) -> dict | None:
    """``train_case`` of every config of ``case_configs``, then ``resumed_case`` of its ``"resumed"`` pair (its
    results under ``"resumed"``). Rank 0 returns the results."""
    results = {case: train_case(cfg) for case, cfg in configs.items() if case != "resumed"}
    results["resumed"] = resumed_case(configs["resumed"])
    return results if dist.get_rank() == 0 else None


def resumed_configs(job: Callable[..., JobConfig], workdir: str, case: str, run: str) -> tuple[JobConfig, JobConfig]:
    """``case`` as the run ``run``: 2 steps with a checkpoint at step 2, then on to all its steps from that
    checkpoint (``checkpoint.resume=auto``)."""
    first = job(workdir, case, run=run, steps=2)
    first.checkpoint.every = 2
    again = job(workdir, case, run=run)
    again.checkpoint.resume = "auto"
    return first, again


def resumed_case(configs: tuple[JobConfig, JobConfig]) -> tuple:
    """The two runs of ``resumed_configs``, one after the other; ``train_case``'s results of the resumed part (its
    steps after the second)."""
    first, again = configs
    train_case(first)
    return train_case(again)


def world_job(configs: dict) -> dict | None:
    """Every case of one world size, one after the other on the same process group; rank 0 returns the results."""
    results = {case: train_case(cfg) for case, cfg in configs.items()}
    return results if dist.get_rank() == 0 else None


def document_pieces(
    batches: list[dict], keys: Sequence[str] = ("input_ids", "position_ids", "labels")
) -> tuple[torch.Tensor, ...]:
    """Every document piece of every row of ``batches``, each a sequence of its own, right-padded: by default input
    ids, position ids and labels ``[N, L]`` (padding: token 0, position 0, label -100), else the ``keys`` asked for
    (``sources``). Causal attention never lets a token see the padding after it, so each piece is computed as if
    alone."""
    pieces = [
        tuple(batch[key][row, a:b] for key in keys)
        for batch in batches
        for row, bounds in enumerate(batch["cu_seqlens"])
        for a, b in zip(bounds.tolist(), bounds[1:].tolist())
    ]
    pad = torch.nn.utils.rnn.pad_sequence
    return tuple(
        pad(column, batch_first=True, padding_value=IGNORE_INDEX if key == "labels" else 0)
        for key, column in zip(keys, zip(*pieces))
    )


@torch.no_grad()
def token_losses(model: torch.nn.Module, batches: list[dict]) -> dict[str, torch.Tensor]:
    """The cross-entropy of every trained label of ``batches`` (whole rows) under the plain ``model``, each piece a
    sequence of its own, with that token's document position and source: 1-D tensors ``loss`` (float64),
    ``position``, ``source``."""
    input_ids, position_ids, labels, sources = document_pieces(
        batches, ("input_ids", "position_ids", "labels", "sources")
    )
    hidden = model.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    valid = labels != IGNORE_INDEX
    logits = model.lm_head(hidden[valid]).double()
    return {
        "loss": F.cross_entropy(logits, labels[valid], reduction="none"),
        "position": position_ids[valid],
        "source": sources[valid].long(),
    }


@functools.cache
def reference(
    workdir: str,
    *,
    steps: int,
    dp: int,
    batch_size: int,
    grad_accum: int,
    num_layers: int = 2,
    model: tuple[str, ...] = (),
    data: tuple[str, ...] = (),
) -> tuple[list[float], list[float], dict]:
    """Losses, pre-clipping gradient norms and first-step gradients of the plain model over the same rows."""
    with one_thread():
        cfg = job_config(
            workdir,
            workdir,
            steps=steps,
            num_layers=num_layers,
            batch_size=batch_size,
            grad_accum=grad_accum,
            model=model,
            data=data,
        )
        return _reference(cfg, dp, continued=not data)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread inside (also a decorator): the parity models' tensors are tiny, so a second thread only
    spins, and the machine runs the ranks too. On 2 busy cores of an AMD EPYC a 64 x 128 linear layer on 50 tokens
    takes 0.9-6 ms with 2 threads and 0.03 ms with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_model(cfg: JobConfig) -> torch.nn.Module:
    """The plain Hugging Face model of a job with its initial weights: the checkpoint's as transformers'
    ``from_pretrained`` reads them (its own conversion of the checkpoint's layout, not lctrain's reader), or the
    seeded init."""
    hf_config = model_config(cfg.model, vocab_size=len(load_tokenizer(tokenizer_path(cfg))))
    model = build_empty_model(hf_config)
    apply_lora(model, cfg.model.lora)  # the single-process peft model, built as build_model builds it
    if cfg.model.path is not None:
        loaded = AutoModelForCausalLM.from_pretrained(cfg.model.path, config=hf_config, dtype=torch.float32)
        weights = loaded.state_dict()
        source = lambda name, shape: weights[name]  # noqa: E731
    else:
        source = random_init_source(hf_config, cfg.train.seed)
    materialize(model, adapter_source(source, cfg.train.seed), torch.device("cpu"))
    return model


def _reference(cfg: JobConfig, dp: int, *, continued: bool) -> tuple[list[float], list[float], dict]:
    model = reference_model(cfg)
    model.train()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_path(cfg))  # as the trainer reads it
    loaders = [iter(PackedLoader(data, dp_rank=d, dp_size=dp)) for d in range(dp)]
    losses, norms, grads = [], [], {}
    cu_seqlens, first_positions = [], []
    for _ in range(cfg.train.steps):
        batches = [next(loader) for _ in range(cfg.train.grad_accum) for loader in loaders]
        cu_seqlens += [bounds for batch in batches for bounds in batch["cu_seqlens"]]
        first_positions += [batch["position_ids"][:, 0] for batch in batches]
        input_ids, position_ids, labels = document_pieces(batches)
        routed = router_aux_coef(model.config) > 0
        output = model.model(input_ids=input_ids, position_ids=position_ids, output_router_logits=routed or None)
        valid = labels != IGNORE_INDEX
        logits = model.lm_head(output.last_hidden_state[valid])  # the valid positions only: the full logits are large
        loss = F.cross_entropy(logits.float(), labels[valid], reduction="sum") / valid.sum()
        if routed:
            scope = cfg.train.router_aux_scope
            aux = rows_router_loss(model, batches, output.router_logits, pooled=scope == "global")
            loss = loss + router_aux_coef(model.config) * aux
        loss.backward()
        if not grads:
            grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    # the data must exercise packing: most rows hold several documents, and some continue a document
    several = sum(len(bounds) > 2 for bounds in cu_seqlens)
    assert several >= len(cu_seqlens) // 2, f"only {several} of {len(cu_seqlens)} rows hold several documents"
    if continued:  # text documents continue across rows (conversations never do)
        assert (torch.cat(first_positions) > 0).any(), "no row continues a document from the previous row"
    return losses, norms, grads


def rows_router_loss(
    model: torch.nn.Module, batches: list[dict], router_logits: tuple[torch.Tensor, ...], *, pooled: bool = False
) -> Tensor:
    """The mean over the rows of ``batches`` of transformers' ``load_balancing_loss_func`` of each row's tokens (every
    token of the row, padding included), or with ``pooled`` the function of all of their tokens at once, from the
    router logits of ``document_pieces(batches)`` (per MoE layer ``[pieces · L, E]``, the pieces right-padded to
    ``L``)."""
    lengths = [b - a for batch in batches for bounds in batch["cu_seqlens"] for a, b in zip(bounds[:-1], bounds[1:])]
    pieces_per_row = [len(bounds) - 1 for batch in batches for bounds in batch["cu_seqlens"]]
    longest = max(lengths)
    # per layer, each piece's own tokens: [pieces · L, E] -> pieces of [length, E]
    layers = [
        [logits.view(len(lengths), longest, -1)[i, :n] for i, n in enumerate(lengths)] for logits in router_logits
    ]
    balance = importlib.import_module(type(model).__module__).load_balancing_loss_func
    if pooled:
        pieces_per_row = [sum(pieces_per_row)]
    losses, start = [], 0
    for count in pieces_per_row:
        row = tuple(torch.cat(pieces[start : start + count]) for pieces in layers)
        losses.append(balance(row, row[0].shape[-1], model.config.num_experts_per_tok))
        start += count
    return torch.stack(losses).mean()


def assert_first_step_matches(result: tuple, expected: tuple) -> None:
    """The first step's loss within 1e-5 relative and every parameter's full gradient within 1e-5 abs + 1e-4 rel."""
    (losses, _, grads), (ref_losses, _, ref_grads) = result, expected
    assert abs(losses[0] - ref_losses[0]) <= 1e-5 * abs(ref_losses[0]), (losses[0], ref_losses[0])
    assert grads.keys() == ref_grads.keys()  # every parameter (of every pipeline stage), under the HF names
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def assert_curve_matches(result: tuple, expected: tuple, steps: int) -> None:
    """Every step's loss within 1e-5 relative and pre-clipping gradient norm within 1e-3 relative; clipping acts."""
    (losses, norms, _), (ref_losses, ref_norms, _) = result, expected
    assert len(losses) == len(norms) == steps
    assert max(ref_norms) > MAX_GRAD_NORM, "clipping never acts: lower MAX_GRAD_NORM"
    as_float64 = functools.partial(torch.tensor, dtype=torch.float64)
    torch.testing.assert_close(as_float64(losses), as_float64(ref_losses), atol=0, rtol=1e-5)
    torch.testing.assert_close(as_float64(norms), as_float64(ref_norms), atol=0, rtol=1e-3)
