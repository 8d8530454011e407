"""``lctrain.parallel.pipeline`` without processes: how layers are split and placed, and that the stage modules,
chained by hand, compute what the Hugging Face model computes.

- ``stage_layers``: balanced by count (earlier stages take the remainder) or at named split points.
- ``rank_stages``: looped placement (rank r holds r, r + pp, ...) and V placement (r and 2·pp − 1 − r).
- ``PipelineStageModule``: a tiny Llama (sdpa attention, one document per row) cut into 3 stages; stage 0 takes the
  token ids, the last returns the token-summed loss. Loss and every parameter gradient equal the whole model's
  (``model.model`` then ``chunked_cross_entropy``) within 1e-6 abs + 1e-5 rel; parameter names are the model's own;
  ``merge_stages`` holds every parameter once.
"""

from __future__ import annotations

import torch

from lctrain.config import load_config
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.parallel.pipeline import PipelineStageModule, merge_stages, rank_stages, step_inputs
from lctrain.rules import stage_layers
from lctrain.train.loss import chunked_cross_entropy


def test_stage_layers_balanced_and_named() -> None:
    assert stage_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_layers(8, 2, ["model.layers.6"]) == [range(0, 6), range(6, 8)]
    assert stage_layers(6, 3, ["model.layers.1", "model.layers.5"]) == [range(0, 1), range(1, 5), range(5, 6)]


def test_rank_stages_looped_and_v() -> None:
    assert [rank_stages(r, 2, 1, "1F1B") for r in range(2)] == [[0], [1]]
    assert [rank_stages(r, 4, 2, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [rank_stages(r, 4, 2, "ZBVZeroBubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_chained_stages_compute_the_models_loss_and_gradients() -> None:
    cfg = load_config(["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=5", "model.num_heads=4"])
    config = model_config(cfg.model, vocab_size=300)
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed=0), torch.device("cpu"))
    layers = stage_layers(5, 3, ["model.layers.2", "model.layers.4"])

    def loss(hidden: torch.Tensor, weight: torch.Tensor, row: dict) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, row["labels"], chunk_tokens=7)[0]

    stages = [PipelineStageModule(model, layers[i], stage_index=i, num_stages=3) for i in range(3)]
    input_ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    labels = torch.cat([input_ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    meta = {
        "position_ids": torch.arange(24)[None],
        "cu_seqlens": torch.tensor([[0, 24, -1]]),  # padded with -1, as the trainer pads a step's rows
        "doc_prefix": None,
        "head": loss,
        "row": {"labels": labels},
    }
    x = input_ids
    for stage in stages:
        x = stage(x, **meta)
    x.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad()
    hidden = model.model(input_ids=input_ids, position_ids=meta["position_ids"]).last_hidden_state
    expected, _ = chunked_cross_entropy(hidden, model.lm_head.weight, labels, chunk_tokens=7)
    expected.backward()
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())
    assert [name for name, _ in stages[0].named_parameters()][0] == "model.embed_tokens.weight"
    assert dict(merge_stages(stages[1:]).named_parameters()).keys() == {
        name
        for name in names
        if name.startswith(("model.layers.2.", "model.layers.3.", "model.layers.4.", "model.norm", "lm_head"))
    }


def test_step_inputs_stack_the_rows_of_a_step() -> None:
    """A step's micro-batches as a schedule's inputs: per-token fields concatenated, bounds and shared prefixes padded
    with -1, per-row lists stacked (ints as a host tensor, tensors padded: each row's item a prefix of its row)."""
    batch = {
        "input_ids": torch.arange(8).view(2, 4),
        "position_ids": torch.arange(8).view(2, 4),
        "labels": torch.arange(8).view(2, 4),
        "cu_seqlens": [torch.tensor([0, 4]), torch.tensor([0, 1, 3, 4])],
        "doc_prefix": [torch.tensor([-1]), torch.tensor([-1, 0, 0])],
        "pair_counts": [0, 1],
        "reference_logps": [torch.zeros(0, dtype=torch.float64), torch.tensor([-1.0, -2.0], dtype=torch.float64)],
    }
    second = {key: value[:1] for key, value in batch.items()}
    inputs = step_inputs([batch, second], ("labels", "pair_counts", "reference_logps"), torch.device("cpu"))
    assert inputs["input_ids"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    assert inputs["cu_seqlens"].tolist() == [[0, 4, -1, -1], [0, 1, 3, 4], [0, 4, -1, -1]]
    assert inputs["doc_prefix"].tolist() == [[-1, -1, -1], [-1, 0, 0], [-1, -1, -1]]
    row = inputs["row"]
    assert row["labels"].shape == (3, 4) and row["pair_counts"].tolist() == [0, 1, 0]
    assert row["reference_logps"].tolist() == [[-1.0, -1.0], [-1.0, -2.0], [-1.0, -1.0]]
    assert step_inputs([second], ("labels",), torch.device("cpu"))["doc_prefix"].shape == (1, 1)
    no_pairs = {key: batch[key] for key in ("input_ids", "position_ids", "labels", "cu_seqlens")}
    assert step_inputs([no_pairs], ("labels",), torch.device("cpu"))["doc_prefix"] is None
