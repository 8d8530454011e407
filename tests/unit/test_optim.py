"""The optimizer and its schedule: linear warm-up then cosine decay to the floor, applied to every parameter group;
weight decay on matrices only."""

from __future__ import annotations

import math

import pytest

from lctrain.config import OptimConfig
from lctrain.train.optim import build_optimizer, build_scheduler, lr_factor
from tests.helpers.models import tiny_model


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
