"""What a training step measures (``lctrain.train.meter``): its peak memory is the step's own (reset at its start,
on CPU through the resident set's high-water mark), MFU is tokens/s × FLOPs per token over the devices' peak, and
the FLOPs per token of a Hugging Face config count its sliding windows."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from lctrain.families import model_flops_per_token
from lctrain.flops import flops_per_token, mfu
from lctrain.train.meter import GIB, StepMemory, StepMeter

CPU = torch.device("cpu")


def test_the_cpu_peak_is_each_steps_own() -> None:
    """A step that touches 256 MiB, then one that touches nothing: the second step's peak is its own, not the
    run's (the process's peak resident set would keep the first one's)."""
    meter = StepMeter(CPU, tokens=1000, per_token=6e6, peak=None, devices=1)
    with meter.measure() as first:
        big = torch.ones(64 * 2**20)  # 256 MiB, written
        del big
    with meter.measure() as second:
        pass
    assert first["peak_mem_gib"] - second["peak_mem_gib"] >= 0.2, (first, second)
    with StepMemory(CPU, collect=True) as memory:
        block = torch.ones(32 * 2**20)  # 128 MiB
        del block
    assert 120 * 2**20 <= memory.growth <= memory.peak and memory.reserved is None


def test_a_steps_figures() -> None:
    meter = StepMeter(CPU, tokens=4096, per_token=6e6, peak=1e12, devices=2)
    with meter.measure() as figures:
        torch.ones(1000).sum()
    assert set(figures) == {"tokens_per_s", "mfu", "peak_mem_gib", "step_time_s"}
    assert figures["tokens_per_s"] == 4096 / figures["step_time_s"]
    assert figures["mfu"] == pytest.approx(figures["tokens_per_s"] * 6e6 / 2e12)
    assert 0 < figures["peak_mem_gib"] < 1024 * GIB
    assert mfu(1000.0, 6e6, 1e12, devices=2) == 1000 * 6e6 / 2e12 and mfu(1000.0, 6e6, None) is None


def test_model_flops_per_token_counts_each_layers_window() -> None:
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=100)
    assert model_flops_per_token(LlamaConfig(**sizes), 12345, 4096) == flops_per_token(12345, 3, 64, 4096)
    windowed = model_flops_per_token(MistralConfig(**sizes, sliding_window=512), 12345, 4096)
    assert windowed == flops_per_token(12345, 3, 64, 4096, [512] * 3) < flops_per_token(12345, 3, 64, 4096)
