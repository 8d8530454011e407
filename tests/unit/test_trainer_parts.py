"""The trainer's single-process parts: LR schedule, optimizer groups, model build and weight sources, activation
checkpointing, metrics records and plot."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lctrain.config import LoggingConfig, ModelConfig, OptimConfig
from lctrain.flops import document_flops_per_token, flops_per_token
from lctrain.models import build_empty_model, materialize, model_config, random_init_source, safetensors_source
from lctrain.models.hf import hf_name
from lctrain.parallel.activation_checkpointing import apply_activation_checkpointing
from lctrain.train.metrics import MetricsLogger
from lctrain.train.optim import build_optimizer, build_scheduler, lr_factor

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    config = model_config(TINY, vocab_size=50)
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed), torch.device("cpu"))
    return model


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    factors = [lr_factor(s, warmup_steps=4, total_steps=14, min_lr_ratio=0.1) for s in range(14)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert factors[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 9)))
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))


def test_scheduler_applies_the_factor_to_every_group() -> None:
    model = tiny_model()
    cfg = OptimConfig(lr=1.0, warmup_steps=2, min_lr_ratio=0.0)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=4)
    seen = []
    for _ in range(4):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert seen == [[0.5, 0.5], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]


def test_weight_decay_only_on_matrices() -> None:
    decayed, plain = build_optimizer(tiny_model(), OptimConfig(weight_decay=0.1)).param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and plain["params"] and all(p.dim() == 1 for p in plain["params"])


def test_random_init_is_seeded_per_tensor_and_like_hugging_face() -> None:
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
    weight = a.model.embed_tokens.weight
    assert weight.std().item() == pytest.approx(TINY.init_std, rel=0.1)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight)
    # RoPE buffers survive the meta build and materialize
    rotary = a.model.rotary_emb
    expected = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # the default base
    torch.testing.assert_close(rotary.inv_freq, expected)


def test_safetensors_source_reads_a_saved_model_and_names_what_is_wrong(tmp_path: Path) -> None:
    model = tiny_model(3)
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, tmp_path / "model.safetensors")
    loaded = build_empty_model(model.config)
    materialize(loaded, safetensors_source(tmp_path), torch.device("cpu"))
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    read = safetensors_source(tmp_path)
    with pytest.raises(KeyError, match="no tensor 'missing.weight'"):
        read("missing.weight", torch.Size([1]))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(50, 32\), the model \(2, 2\)"):
        read("model.embed_tokens.weight", torch.Size([2, 2]))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        safetensors_source(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_config(ModelConfig(path=str(tmp_path / "nowhere")), vocab_size=50)


@pytest.mark.parametrize("mode,every,wrapped", [("none", 1, []), ("full", 1, [0, 1, 2]), ("selective", 2, [0, 2])])
def test_activation_checkpointing_wraps_the_chosen_layers(mode: str, every: int, wrapped: list[int]) -> None:
    model = tiny_model()
    input_ids = torch.randint(0, 50, (1, 12))
    before = model(input_ids=input_ids).logits
    apply_activation_checkpointing(model.model.layers, mode, every)
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer, CheckpointWrapper)] == wrapped
    assert {hf_name(n) for n, _ in model.named_parameters()} == {n for n, _ in tiny_model().named_parameters()}
    torch.testing.assert_close(model(input_ids=input_ids).logits, before)


def test_flops_per_token_counts_parameters_and_causal_attention() -> None:
    assert flops_per_token(1000, 3, 32, 64) == 6 * 1000 + 6 * 3 * 32 * 64


def test_windowed_flops_count_the_pairs_each_layer_sees() -> None:
    """Per layer 12·hidden × visible pairs per token: a sliding window of W keys gives Σ min(i, W) / S pairs per
    token, counted here by brute force (the formula's continuous S/2 vs (S+1)/2 aside, the same difference as the
    causal count's); a window no shorter than the row is plain causal attention."""
    seq, window, hidden = 4096, 512, 32
    visible = sum(min(i, window) for i in range(1, seq + 1)) / seq
    one_window = flops_per_token(0, 1, hidden, seq, [window]) / (12 * hidden)
    assert abs(one_window - visible) <= 0.5 * window / seq
    assert abs(flops_per_token(0, 1, hidden, seq) / (12 * hidden) - sum(range(1, seq + 1)) / seq) == 0.5
    assert flops_per_token(1000, 2, hidden, seq, [seq, None]) == flops_per_token(1000, 2, hidden, seq)
    mixed = flops_per_token(1000, 3, hidden, seq, [None, window, window])  # Qwen: the first layers without
    assert mixed == 6 * 1000 + flops_per_token(0, 1, hidden, seq) + 2 * flops_per_token(0, 1, hidden, seq, [window])
    with pytest.raises(ValueError, match="2 windows for 3 layers"):
        flops_per_token(1000, 3, hidden, seq, [None, window])


def test_document_flops_count_the_visible_attention_of_packed_rows() -> None:
    assert document_flops_per_token(1000, 3, 32, [64]) == flops_per_token(1000, 3, 32, 64)
    attention = flops_per_token(0, 3, 32, 64)
    assert document_flops_per_token(0, 3, 32, [16] * 4) == attention / 4  # 4 documents: 1/4 of the pairs
    assert document_flops_per_token(1000, 3, 32, [48, 16]) == 6 * 1000 + attention * (48**2 + 16**2) / 64**2


def test_metrics_jsonl_drops_steps_after_the_resumed_one_and_plots(tmp_path: Path) -> None:
    def record(loss: float) -> dict:
        return {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}

    cfg = LoggingConfig(every=2)
    first = MetricsLogger(cfg, tmp_path, rank=0, resume_step=0, job_config={})
    lines = [first.log(step, record(10.0 - step)) for step in range(1, 6)]
    assert lines[0] is None and lines[1].startswith("step 2 | loss 8.0000 | grad_norm 1.000 | lr 1.00e-03")
    resumed = MetricsLogger(cfg, tmp_path, rank=0, resume_step=3, job_config={})
    resumed.log(4, record(0.5))
    resumed.close()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in steps] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.5)]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    other_rank = MetricsLogger(cfg, tmp_path / "r1", rank=1, resume_step=0, job_config={})
    assert other_rank.log(2, record(1.0)) is None and not (tmp_path / "r1").exists()


def test_validation_records_print_and_plot(tmp_path: Path) -> None:
    """A step that validates carries val_loss, val_tokens and val_loss_by_position in metrics.jsonl, prints its line
    even off the logging cadence, and the run gets val_loss.png beside loss.png."""
    base = {"grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": None, "peak_mem_gib": 0.1}
    metrics = MetricsLogger(LoggingConfig(every=10), tmp_path, rank=0, resume_step=0, job_config={})
    for step in range(1, 7):
        record = {**base, "loss": 8.0 - step}
        if step % 3 == 0:
            by_position = {"0-64": 6.0 - step / 3, "64-256": 5.5 - step / 3, "256-1024": None}
            record.update({"val_loss": 5.0 - step / 3, "val_tokens": 1000, "val_loss_by_position": by_position})
        line = metrics.log(step, record)
        assert (line is not None) == (step % 3 == 0)
    assert line.endswith(" | val_loss 3.0000")
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[5]["val_loss_by_position"] == {"0-64": 4.0, "64-256": 3.5, "256-1024": None}
    assert "val_loss" not in records[0]
    assert (tmp_path / "val_loss.png").read_bytes()[:4] == b"\x89PNG"


def test_position_buckets_are_powers_of_four_up_to_the_row() -> None:
    from lctrain.train.validate import position_buckets

    assert position_buckets(131072) == [0, 4096, 16384, 65536, 131072]
    assert position_buckets(524288) == [0, 4096, 16384, 65536, 262144, 524288]
    assert position_buckets(1024) == [0, 64, 256, 1024]  # short rows: the first bucket is seq_len / 16
    assert position_buckets(8192) == [0, 256, 1024, 4096, 8192]
    assert position_buckets(64) == [0, 4, 16, 64]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["train.val_every=-1"], "train.val_every=-1 must be >= 0 (0 = only at the end)"),
        (["train.val_rows=0"], "train.val_rows=0 must be >= 1"),
        (
            ["parallel.pp=2", "data.val_sources=[{name: v, split: validation}]"],
            "data.val_sources with parallel.pp=2: validation runs without a pipeline",
        ),
    ],
)
def test_bad_validation_settings_name_the_setting(overrides: list[str], expected: str) -> None:
    from lctrain.config import load_config
    from lctrain.train.trainer import check_validation

    with pytest.raises(ValueError, match=re.escape(expected)):
        check_validation(load_config(overrides))


def test_every_config_field_is_documented_with_its_default() -> None:
    import dataclasses

    from lctrain.config import JobConfig

    doc = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()

    def rows(prefix: str, section: object) -> list[str]:
        found = []
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value):  # a nested section: model.rope_scaling.type, ...
                found += rows(f"{prefix}{field.name}.", value)
                continue
            default = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            found.append(f"| `{prefix}{field.name}` | `{default}` |")
        return found

    for row in rows("", JobConfig()):
        assert row in doc, f"docs/configuration.md lacks the row {row}"


@pytest.mark.parametrize("mode", ["offline", "disabled"])
def test_weights_and_biases_offline_writes_a_local_run_and_disabled_nothing(tmp_path: Path, mode: str) -> None:
    metrics = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": None, "peak_mem_gib": 0.1}
    logger = MetricsLogger(LoggingConfig(wandb=mode, plot=False), tmp_path, rank=0, resume_step=0, job_config={})
    logger.log(1, metrics)
    logger.close()
    runs = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    if mode == "offline":
        assert len(runs) == 1 and runs[0].stat().st_size > 0
    else:
        assert not (tmp_path / "wandb").exists()


def test_log_lines_go_through_the_progress_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Log lines are written with ``tqdm.write``, which clears rank 0's progress bar, prints, and redraws it: the
    bar and the per-step lines never overwrite each other."""
    import lctrain.runtime

    written: list[str] = []
    monkeypatch.setattr(lctrain.runtime.tqdm, "write", lambda text, file=None, **kwargs: written.append(text))
    root_handlers = logging.getLogger().handlers[:]
    try:
        lctrain.runtime.setup_logging(0)
        logging.getLogger("lctrain").info("step 1 | loss 1.0")
    finally:
        logging.getLogger().handlers[:] = root_handlers
    assert len(written) == 1 and written[0].startswith("[rank0] ") and written[0].endswith("step 1 | loss 1.0")
