"""``lctrain plan`` (``lctrain/planner.py``): known answers computed by hand, the scaling of each memory term, the
layouts it refuses agree with ``check_job``, the S/R ≥ C/W condition flips where its formula says, and a written
recipe composes with Hydra and passes ``check_job`` for its launch line.

The memory estimate against measured peaks is ``benchmarks/validate_planner.py`` (real training jobs; not a test).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from lctrain import planner
from lctrain.planner import (
    FP32,
    HARDWARE,
    NAMED_MODELS,
    Hardware,
    Layout,
    ModelSpec,
    Workload,
    estimate_memory,
    layer_activation_bytes,
    layout_problems,
    load_model,
    main,
    meshes,
    plan_layouts,
    ring_step,
    stage_memory,
    step_time,
)
from lctrain.planner.memory import Lora
from lctrain.planner.report import describe
from tests.helpers.models import layer_saved_bytes

TINY = NAMED_MODELS["tiny"]
CPU = HARDWARE["cpu"]


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    main([*argv, "--json"])
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------------------------
# Models: parameter counts equal the Hugging Face models'
# ---------------------------------------------------------------------------------------------------------------


def hf_param_count(**sizes: object) -> int:
    from lctrain.models import ModelConfig, build_empty_model, model_config

    vocab = sizes.pop("vocab")
    model = build_empty_model(model_config(ModelConfig(**sizes), vocab))  # parameters on meta: nothing allocated
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "spec,sizes",
    [
        (TINY, {}),
        (dataclasses.replace(TINY, tied=True), {"tie_word_embeddings": True}),
        (dataclasses.replace(TINY, family="qwen2", qkv_bias=True), {"family": "qwen2"}),
        (dataclasses.replace(TINY, family="qwen3", qk_norm=True), {"family": "qwen3"}),
        (dataclasses.replace(TINY, family="mistral"), {"family": "mistral"}),
        (
            dataclasses.replace(TINY, family="qwen3", qk_norm=True, tied=True),
            {"family": "qwen3", "tie_word_embeddings": True},
        ),
    ],
    ids=["tiny", "tied", "qwen2_bias", "qwen3_qk_norm", "mistral", "qwen3_tied"],
)
def test_parameter_count_equals_the_hf_model(spec: ModelSpec, sizes: dict) -> None:
    tiny = {"hidden_size": 128, "intermediate_size": 352, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
    assert spec.num_params == hf_param_count(**tiny, **sizes, vocab=8192)


def test_tiny_by_hand_and_llama3_8b_published_count() -> None:
    # tiny: per layer q 128·128 + k, v 2·128·64 + o 128·128 + MLP 3·128·352 + norms 2·128 = 184,576
    assert TINY.layer_params == 184_576
    assert TINY.num_params == 2 * 8192 * 128 + 4 * 184_576 + 128 == 2_835_584
    assert NAMED_MODELS["llama3-8b"].num_params == 8_030_261_248  # Meta-Llama-3-8B's published count
    assert NAMED_MODELS["llama3.2-1b"].num_params == 1_235_814_400  # Llama-3.2-1B (tied embeddings)
    assert NAMED_MODELS["mistral-7b"].num_params == 7_241_732_096  # Mistral-7B-v0.1
    assert NAMED_MODELS["qwen2.5-7b"].num_params == 7_615_616_512  # Qwen2.5-7B (q/k/v biases)
    # Qwen3-8B: 8.19B, 6.95B without the embeddings (q/k norms: 2 · 128 weights per layer)
    assert NAMED_MODELS["qwen3-8b"].num_params == 8_190_735_360
    assert NAMED_MODELS["qwen3-8b"].num_params - 2 * 151936 * 4096 == 6_946_075_648


SMALL_HF = {"hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3, "num_attention_heads": 6}
# config.json fields beyond SMALL_HF, and the spec's (head_dim, kv_heads, qkv_bias, o_bias, qk_norm, tied)
HF_DIRECTORIES = {
    "llama_bias": (
        {"model_type": "llama", "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True, "mlp_bias": True},
        (32, 2, True, True, False, False),
    ),
    "llama3.2": (
        {"model_type": "llama", "num_key_value_heads": 2, "tie_word_embeddings": True},
        (16, 2, False, False, False, True),
    ),
    "mistral": (
        {"model_type": "mistral", "num_key_value_heads": 3, "sliding_window": 64},
        (16, 3, False, False, False, False),
    ),
    "qwen2": ({"model_type": "qwen2", "num_key_value_heads": 2}, (16, 2, True, False, False, False)),
    "qwen2_sliding": (
        {"model_type": "qwen2", "num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 64}
        | {"max_window_layers": 1},
        (16, 2, True, False, False, False),
    ),
    "qwen3": ({"model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 24}, (24, 2, False, False, True, False)),
    "qwen3_default_head_dim": ({"model_type": "qwen3", "num_key_value_heads": 2}, (128, 2, False, False, True, False)),
    "qwen3_bias": (
        {"model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 24, "attention_bias": True},
        (24, 2, True, True, True, False),
    ),
}


def test_the_planner_with_a_named_size_imports_neither_torch_nor_transformers() -> None:
    """``docs/planner.md``: it answers in well under a second (torch and transformers take seconds to import)."""
    code = (
        "import sys; from lctrain.planner import main; main(['--model', 'llama3-8b', '--seq-len', '131072']); "
        "assert not {'torch', 'transformers'} & set(sys.modules), 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "recommended:" in result.stdout, result.stderr


HF_WINDOWS = {"mistral": (64, 64, 64), "qwen2_sliding": (None, 64, 64)}


def test_hf_directory_of_a_model_lctrain_does_not_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**SMALL_HF, "model_type": "gemma2", "vocab_size": 500}))
    with pytest.raises(ValueError, match="'gemma2' model, which lctrain does not train: its attention soft-caps"):
        load_model(str(tmp_path))


def test_sliding_windows_count_in_the_step_time_and_mfu() -> None:
    """Mistral-7B-v0.1's 4,096-token window: at 32K the attention FLOPs are those of the window, so compute time and
    the MFU's FLOPs fall by the attention pairs the window removes, as the trainer counts them."""
    mistral = NAMED_MODELS["mistral-7b"]
    assert mistral.windows == (4096,) * 32
    layout, hw = Layout(pp=1, dp=1, ring=1, ulysses=8), HARDWARE["h100"]
    work = Workload(32768, gpus_per_node=8)
    plain = dataclasses.replace(mistral, windows=())
    windowed, full = (step_time(m, layout, hw, work, ring_step(m, layout, hw, work)) for m in (mistral, plain))
    attention_pairs = 32 * (32768 / 2 - (4096 - 4096**2 / (2 * 32768)))  # removed pairs per token, all layers
    removed = 12 * mistral.hidden * attention_pairs * 32768 / 8  # per GPU per step
    assert full.model_flops - windowed.model_flops == pytest.approx(removed)
    assert windowed.compute_s < full.compute_s


@pytest.mark.parametrize("case", list(HF_DIRECTORIES))
def test_hf_directory_is_read_like_transformers(case: str, tmp_path: Path) -> None:
    from lctrain.models import ModelConfig, build_empty_model, model_config

    fields, expected = HF_DIRECTORIES[case]
    (tmp_path / "config.json").write_text(json.dumps({**SMALL_HF, **fields, "vocab_size": 500}))
    spec = load_model(str(tmp_path))
    assert spec.path == str(tmp_path) and spec.family == fields["model_type"]
    assert (spec.head_dim, spec.kv_heads, spec.qkv_bias, spec.o_bias, spec.qk_norm, spec.tied) == expected
    assert spec.windows == HF_WINDOWS.get(case, ())  # the windows transformers gives each layer (layer_windows)
    model = build_empty_model(model_config(ModelConfig(path=str(tmp_path)), 500))
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="neither a named size"):
        load_model(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "family,layout,words",
    [
        ("mixtral", "published", "the published layout"),
        ("qwen3_moe", "fused", "transformers' fused in-memory layout"),
        ("qwen3", "published", "its one layout"),
    ],
)
def test_the_plan_says_which_layout_a_checkpoint_has(family: str, layout: str, words: str, tmp_path: Path) -> None:
    from tests.helpers.checkpoints import hf_model, save_checkpoint

    save_checkpoint(hf_model(family), tmp_path, layout=layout)
    model = load_model(str(tmp_path))
    assert model.layout.startswith(words)
    assert f"weights: {tmp_path.resolve()}, {words}" in describe(
        model, HARDWARE["h100"], Workload(4096, gpus_per_node=8)
    )
    for file in tmp_path.glob("*.safetensors"):  # no weights: nothing said
        file.unlink()
    assert load_model(str(tmp_path)).layout is None


# ---------------------------------------------------------------------------------------------------------------
# Memory: what a layer keeps, by hand and as autograd saves it; how each term scales
# ---------------------------------------------------------------------------------------------------------------


def test_layer_activations_by_hand() -> None:
    # fp32: norms 2·(128·(4 + 2·4) + 4) = 3080; q and out 2·128·4 = 1024; k, v 2·64·4 = 512; lse 4·4 = 16;
    # MLP 4·352·4 = 5632
    assert layer_activation_bytes(TINY, 4, 1) == 3080 + 1024 + 512 + 16 + 5632 == 10_264
    # bf16 with Ulysses 4 (> 2 KV heads: replicated to 4): the output after the all-to-all back is one more q-sized
    # tensor; k, v 2·(4·32)·2 = 512
    assert layer_activation_bytes(TINY, 2, 4) == 2 * (128 * 8 + 4) + 3 * 128 * 2 + 512 + 16 + 4 * 352 * 2
    assert layer_activation_bytes(TINY, 4, 1, mlp_chunked=True) == 10_264 - 5632


@pytest.mark.parametrize(
    "family,lora", [("llama", None), ("qwen3", None), ("llama", Lora(8)), ("qwen3", Lora(8, ("norm",)))]
)
def test_layer_activations_equal_what_autograd_saves(family: str, lora: Lora | None) -> None:
    """One patched decoder layer, fp32, one process: the bytes of every tensor autograd keeps (parameters and RoPE
    cos/sin, shared by all layers, left out) equal the formula exactly (Qwen3: with its q/k norms; with LoRA adapters
    on every projection, frozen or trained norms)."""
    from lctrain.models import (
        LoraConfig,
        ModelConfig,
        build_empty_model,
        materialize,
        model_config,
        patch_attention,
        random_init_source,
    )
    from lctrain.models.lora import adapter_source, apply_lora

    sizes = ModelConfig(family=family, hidden_size=128, intermediate_size=352, num_heads=4, num_kv_heads=2)
    hf = model_config(sizes, 8192)
    spec = dataclasses.replace(TINY, family=family, qk_norm=family == "qwen3")
    model = build_empty_model(hf)
    if lora is not None:
        apply_lora(model, LoraConfig(rank=lora.rank, trainable=list(lora.trainable)))
    materialize(model, adapter_source(random_init_source(hf, 0), 0), torch.device("cpu"))
    patch_attention(model, ulysses_group=None, ring_group=None)
    assert layer_saved_bytes(model, tokens=256) == 256 * layer_activation_bytes(spec, 4, 1, lora=lora)


def memory(layout: Layout, seq_len: int = 65536, **work: object) -> planner.MemoryEstimate:
    return estimate_memory(NAMED_MODELS["llama3-8b"], layout, Workload(seq_len, gpus_per_node=8, **work))


def test_activations_halve_when_ring_doubles() -> None:
    for ac in ("none", "full"):  # at 1M tokens the peak is in the backward for both rings
        one, two = memory(Layout(1, 1, 2, 4, ac), 1 << 20), memory(Layout(1, 1, 4, 4, ac), 1 << 20)
        assert one.phase == two.phase == "backward"
        assert two.activations == pytest.approx(one.activations / 2)
        assert two.recompute == pytest.approx(one.recompute / 2)


def test_states_shard_over_dp_ring_ulysses() -> None:
    model = NAMED_MODELS["llama3-8b"]
    one = memory(Layout(1, 1, 1, 1))
    base = one.states
    # in the backward: fp32 weights and AdamW's two moments; the sharded gradients do not exist yet
    assert one.phase == "backward" and base == model.num_params * 12
    for layout in (Layout(1, 2, 1, 1), Layout(1, 1, 2, 1), Layout(1, 1, 1, 2)):
        assert memory(layout).states == pytest.approx(base / 2)
    assert memory(Layout(1, 2, 2, 2)).states == pytest.approx(base / 8)


def test_short_sequences_peak_at_the_end_of_the_step() -> None:
    """At 1K tokens activations are small: the peak comes at the end of the backward, when the sharded fp32 gradients
    exist beside the weights and AdamW's moments, while the root's gradients are unsharded (bf16 + their fp32 cast
    for the reduce-scatter) beside the gathered root. Fused AdamW then updates in place (no temporary)."""
    model = NAMED_MODELS["llama3-70b"]
    step = estimate_memory(model, Layout(1, 8, 1, 1), Workload(1024, gpus_per_node=8))
    assert step.phase == "grads" and step.states == pytest.approx(model.num_params * 16 / 8)
    big_vocab = dataclasses.replace(NAMED_MODELS["llama3-8b"], vocab=1_000_000)
    grads = estimate_memory(big_vocab, Layout(1, 8, 1, 1), Workload(1024, gpus_per_node=8))
    root = 2 * big_vocab.embed_params + big_vocab.hidden
    assert grads.phase == "grads" and grads.states == pytest.approx(big_vocab.num_params * 16 / 8)
    assert grads.gathered == pytest.approx(root * 2 + 2 * big_vocab.layer_params * 2 + root * (2 + 4))


def test_checkpointing_keeps_only_layer_inputs() -> None:
    model = NAMED_MODELS["llama3-8b"]
    tokens = (1 << 20) // 8

    def at_1m(layout: Layout, **work: object) -> planner.MemoryEstimate:
        estimate = memory(layout, 1 << 20, **work)
        assert estimate.phase == "backward"
        return estimate

    none, full = at_1m(Layout(1, 1, 2, 4, "none")), at_1m(Layout(1, 1, 2, 4, "full"))
    per_layer = layer_activation_bytes(model, 2, 4, ring=2)  # the ring keeps its last step's K/V too
    assert none.activations - full.activations == pytest.approx(32 * tokens * (per_layer - model.hidden * 2))
    assert (none.recompute, full.recompute) == (0, tokens * per_layer)
    selective = at_1m(Layout(1, 1, 2, 4, "selective", ac_every=4))  # layers 0, 4, ..., 28 checkpointed
    assert selective.activations - full.activations == pytest.approx(24 * tokens * (per_layer - model.hidden * 2))
    offloaded = at_1m(Layout(1, 1, 2, 4, "full"), offload=True)
    assert full.activations - offloaded.activations == pytest.approx(32 * tokens * model.hidden * 2)


def test_cpu_offload_moves_the_sharded_states_to_the_host_on_cuda_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``parallel.cpu_offload``: no sharded weights, gradients or AdamW states in device memory, in any phase; on a
    CPU device nothing moves. The written recipe sets it and composes."""
    layout = Layout(1, 1, 2, 4, "full")
    for seq_len in (1024, 1 << 20):  # the peak at the end of the step, and in the backward
        kept, offloaded = memory(layout, seq_len), memory(layout, seq_len, cpu_offload=True)
        assert kept.states > 0 and offloaded.states == 0
        assert kept.total - kept.states <= offloaded.total < kept.total
        on_cpu = dict(dtype_bytes=4, device="cpu")
        assert memory(layout, seq_len, cpu_offload=True, **on_cpu) == memory(layout, seq_len, **on_cpu)
    name = f"planned_{uuid.uuid4().hex[:8]}"
    recipe = tmp_path / "recipes" / f"{name}.yaml"
    report = run_json(capsys, [*LLAMA_1M, "--gpu", "h100", "--cpu-offload", "--write-recipe", str(recipe)])
    assert report["workload"]["cpu_offload"] is True
    assert all(plan["memory_gib"]["states"] == 0 for plan in report["plans"])
    _, cfg = load_written(recipe)
    assert cfg.parallel.cpu_offload is True
    check_written(cfg, 64, 8, NAMED_MODELS["llama3-8b"])


def test_pipeline_first_stage_holds_pp_micro_batches() -> None:
    def stages(batch: int) -> list[planner.MemoryEstimate]:
        return stage_memory(NAMED_MODELS["llama3-8b"], Layout(2, 1, 1, 4, "full"), Workload(65536, 8, batch=batch))

    one, four = stages(1), stages(4)
    assert four[0].activations == pytest.approx(2 * one[0].activations)  # 1F1B: stage 0 holds pp micro-batches
    assert four[1].activations == pytest.approx(one[1].activations)  # the last stage one


def test_loss_chunk_term_by_hand() -> None:
    # fp32, one process, 4 chunks: 3 fp32 [chunk, vocab] buffers (this chunk's logits, logsumexp's temporary, the
    # previous chunk's logits) + the fp32 head-gradient accumulator + the loss's input and its gradient
    work = Workload(4096, gpus_per_node=1, dtype_bytes=4, loss_chunk_tokens=1024)
    forward = estimate_memory(TINY, Layout(1, 1, 1, 1), work)
    expected = 3 * 1024 * 8192 * FP32 + 8192 * 128 * FP32 + 2 * 4096 * 128 * FP32
    assert forward.phase == "forward" and forward.loss == expected  # the peak is in the loss, not the backward
    one_chunk = estimate_memory(TINY, Layout(1, 1, 1, 1), dataclasses.replace(work, loss_chunk_tokens=4096))
    assert one_chunk.loss == 2 * 4096 * 8192 * FP32 + 8192 * 128 * FP32 + 2 * 4096 * 128 * FP32


# ---------------------------------------------------------------------------------------------------------------
# Layouts lctrain refuses: the planner's reasons agree with check_job
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout,work,reason",
    [
        (Layout(1, 1, 1, 8), Workload(4096, gpus_per_node=4, nodes=2), "does not divide the 4 GPUs per node"),
        (Layout(1, 1, 1, 8), Workload(4096, gpus_per_node=8), "does not divide the 4 attention heads"),
        (Layout(1, 2, 2, 2), Workload(1004, gpus_per_node=8), "data.seq_len=1004 is not divisible by 8"),
        (Layout(2, 1, 2, 2), Workload(4096, gpus_per_node=8), "needs at least as many micro-batches as stages (2)"),
        (Layout(8, 1, 1, 1), Workload(4096, gpus_per_node=8, batch=8), "but the model has only 4 layers"),
    ],
)
def test_refused_with_the_reason(layout: Layout, work: Workload, reason: str) -> None:
    problems = layout_problems(TINY, layout, work)
    assert any(reason in p for p in problems), problems


def test_kv_heads_and_memory_reasons() -> None:
    odd = dataclasses.replace(TINY, heads=12, kv_heads=6)
    assert any("one must divide the other" in p for p in layout_problems(odd, Layout(1, 1, 1, 4), Workload(64, 4)))
    small = dataclasses.replace(HARDWARE["h100"], mem_gib=16)
    plans = plan_layouts(NAMED_MODELS["llama3-8b"], small, Workload(1 << 20, gpus_per_node=8), mesh=(1, 8, 1, 1))
    assert "more than the 13.6 GiB usable" in plans[0].problems[-1]  # 16 GiB less 15 % headroom


@pytest.fixture(scope="module")
def base_job() -> object:
    from lctrain.config import load_config

    return load_config([])


@pytest.mark.parametrize("seq_len,heads,kv_heads", [(4096, 4, 2), (40, 4, 2), (4096, 8, 1), (4096, 6, 3)])
@pytest.mark.parametrize("per_node", [4, 8])
def test_planner_refuses_exactly_what_check_job_refuses(
    base_job: object, seq_len: int, heads: int, kv_heads: int, per_node: int
) -> None:
    from lctrain.config import check_job

    sizes = dataclasses.replace(base_job.model, num_heads=heads, num_kv_heads=kv_heads)
    base = dataclasses.replace(base_job, model=sizes)
    model = dataclasses.replace(TINY, heads=heads, kv_heads=kv_heads)
    work = Workload(seq_len, gpus_per_node=per_node, nodes=8 // per_node, batch=2)
    for pp, dp, ring, ulysses in meshes(8):
        layout = Layout(pp, dp, ring, ulysses)
        cfg = dataclasses.replace(
            base,
            parallel=dataclasses.replace(base.parallel, pp=pp, dp=dp, ring=ring, ulysses=ulysses),
            data=dataclasses.replace(base.data, seq_len=seq_len, batch_size=2),
        )
        try:
            check_job(
                cfg,
                8,
                num_heads=heads,
                num_kv_heads=kv_heads,
                num_layers=4,
                tied_embeddings=False,
                vocab_size=8192,
                local_world_size=per_node,
            )
            refused = None
        except ValueError as error:
            refused = str(error)
        problems = layout_problems(model, layout, work)
        assert bool(problems) == (refused is not None), (layout, problems, refused)


# ---------------------------------------------------------------------------------------------------------------
# The ring step: S/R ≥ C/W
# ---------------------------------------------------------------------------------------------------------------


def test_ring_hides_exactly_from_the_threshold() -> None:
    """llama3-8b, bf16, C = 100 TFLOP/s, W = 10 GB/s: S/R* = max(Hkv, U)/Hq · max(e, (e + 4)/2.5) · C/W
    = 8/32 · 2.4 · 1e4 = 6000 tokens (the backward, which also sends fp32 dK/dV, binds)."""
    model = NAMED_MODELS["llama3-8b"]
    hw = Hardware("test", tflops=100, mem_gib=80, intra_gbps=10, inter_gbps=10)
    layout = Layout(1, 1, 8, 1)
    below, above = (
        ring_step(model, layout, hw, Workload(8 * piece, gpus_per_node=4, nodes=2, mfu=1.0, link_efficiency=1.0))
        for piece in (5984, 6016)
    )
    assert below.threshold_tokens == pytest.approx(6000)
    assert (below.link, below.hidden, above.hidden) == ("inter", False, True)
    # by hand at S/R = 6016: forward 4·D·Hq·(S/R)²/2 FLOPs vs K, V of S/R tokens × Hkv·D in bf16
    assert above.compute_fwd_s == pytest.approx(4 * 128 * 32 * 6016**2 / 2 / 1e14)
    assert above.comm_fwd_s == pytest.approx(2 * 6016 * 8 * 128 * 2 / 1e10)
    assert above.comm_bwd_s == pytest.approx(3 * above.comm_fwd_s)  # + dK, dV in fp32
    # the same ring inside one node runs over NVLink
    inside = ring_step(model, layout, hw, Workload(8 * 6016, gpus_per_node=8, mfu=1.0, link_efficiency=1.0))
    assert inside.link == "intra"


def test_windowed_layers_send_only_their_edges() -> None:
    """gpt-oss-20b at 128K on a ring of 8 (slow links: nothing hides): its 12 full layers run the whole ring, its 12
    128-token layers only fetch 2 · 127 rows of the piece per pass, so the ring's exposed time per layer is half the
    all-full model's plus the edges, by hand."""
    from lctrain.planner.timing import ring_layer_s

    model = NAMED_MODELS["gpt-oss-20b"]
    hw = Hardware("test", tflops=1000, mem_gib=80, intra_gbps=1, inter_gbps=1)
    layout = Layout(1, 1, 8, 1)
    ring = ring_step(model, layout, hw, Workload(131072, gpus_per_node=8, mfu=1.0, link_efficiency=1.0))
    full = ring_layer_s(dataclasses.replace(model, windows=()), layout, ring, 0.0)
    assert full == pytest.approx(7 * (ring.exposed_fwd_s + ring.exposed_bwd_s)) and full > 0
    edges = 2 * 127 / ring.tokens_per_rank * (ring.comm_fwd_s + ring.comm_bwd_s)
    assert ring_layer_s(model, layout, ring, 0.0) == pytest.approx((full + edges) / 2)


# ---------------------------------------------------------------------------------------------------------------
# The command: JSON, table, recipe
# ---------------------------------------------------------------------------------------------------------------

LLAMA_1M = ["--model", "llama3-8b", "--seq-len", "1048576", "--gpus-per-node", "8", "--nodes", "8"]


def test_llama3_8b_at_1m_on_64_gpus_recommends_a_layout(capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, LLAMA_1M)
    chosen = report["recommended"]
    lay = chosen["layout"]
    print(json.dumps({k: chosen[k] for k in ("layout", "memory_gib", "ring_step")}, indent=1))
    assert lay["pp"] * lay["dp"] * lay["ring"] * lay["ulysses"] == 64 and 8 % lay["ulysses"] == 0
    assert chosen["feasible"] and chosen["ring_step"]["hidden"]
    assert chosen["memory_gib"]["total"] <= report["usable_gib"]
    assert report["plans"][0] == chosen and all(p["feasible"] for p in report["plans"][:5])
    assert report["model"]["num_params"] == 8_030_261_248


def test_plan_command_prints_the_table_and_refuses_a_mesh_of_another_size(capsys: pytest.CaptureFixture[str]) -> None:
    from lctrain.cli import main as cli_main

    cli_main(["plan", "--model", "tiny", "--seq-len", "8192", "--gpus-per-node", "4", "--gpu", "cpu", "--all"])
    out = capsys.readouterr().out
    assert "recommended: pp=1" in out
    assert "refused: parallel.pp_schedule=1F1B needs at least as many micro-batches" in out
    with pytest.raises(SystemExit, match="multiplies to 2, not the 4 GPUs"):
        main(["--model", "tiny", "--seq-len", "64", "--gpus-per-node", "4", "--mesh", "1,1,2,1"])


def load_written(recipe: Path) -> tuple[list[str], object]:
    from lctrain.config import load_config

    # <workdir>/recipes/<name>.yaml: the user's own recipe, launched by name from <workdir>
    lines = recipe.read_text().splitlines()
    cwd = os.getcwd()
    os.chdir(recipe.parent.parent)
    try:
        return lines, load_config([f"recipe={recipe.stem}"])
    finally:
        os.chdir(cwd)


def check_written(cfg: object, world: int, per_node: int, model: ModelSpec) -> None:
    from lctrain.config import check_job

    check_job(
        cfg,
        world,
        num_heads=model.heads,
        num_kv_heads=model.kv_heads,
        num_layers=model.layers,
        tied_embeddings=model.tied,
        vocab_size=8192,  # the default tokenizer's
        local_world_size=per_node,
    )


def test_written_recipe_composes_and_passes_check_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"planned_{uuid.uuid4().hex[:8]}"
    recipe = tmp_path / "recipes" / f"{name}.yaml"
    report = run_json(capsys, [*LLAMA_1M, "--gpu", "h200", "--write-recipe", str(recipe)])
    lay = report["recommended"]["layout"]
    lines, cfg = load_written(recipe)
    assert lines[0] == "# @package _global_"
    assert lines[1] == f"# sbatch --nodes=8 scripts/slurm/train.sbatch recipe={name}"  # the script's 8 GPUs/node
    par = cfg.parallel
    assert (par.pp, par.dp, par.ring, par.ulysses) == (lay["pp"], lay["dp"], lay["ring"], lay["ulysses"])
    assert par.activation_checkpointing == lay["ac"]
    assert (cfg.data.seq_len, cfg.model.hidden_size, cfg.model.vocab_size) == (1048576, 4096, 128256)
    check_written(cfg, 64, 8, NAMED_MODELS["llama3-8b"])


def test_launch_line_names_gpus_per_node_only_when_the_script_would_not() -> None:
    sbatch = (Path(__file__).resolve().parents[2] / "scripts/slurm/train.sbatch").read_text()
    assert f"#SBATCH --gpus-per-node={planner.SBATCH_GPUS_PER_NODE}\n" in sbatch
    model, hw = NAMED_MODELS["tiny"], HARDWARE["h100"]
    for per_node, expected in ((8, "sbatch --nodes=2 scripts"), (4, "sbatch --nodes=2 --gpus-per-node=4 scripts")):
        work = Workload(4096, gpus_per_node=per_node, nodes=2)
        plan = plan_layouts(model, hw, work, mesh=(1, 2 * per_node // 4, 1, 4))[0]
        text = planner.recipe_text(model, plan, hw, work, name="x", command="plan")
        assert text.splitlines()[1] == f"# {expected}/slurm/train.sbatch recipe=x"


def test_written_recipe_for_a_model_directory_and_one_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    config |= {"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192}
    (model_dir / "config.json").write_text(json.dumps(config))
    name = f"planned_{uuid.uuid4().hex[:8]}"
    recipe = tmp_path / "recipes" / f"{name}.yaml"
    argv = ["--model", str(model_dir), "--seq-len", "8192", "--gpus-per-node", "4", "--gpu", "cpu"]
    report = run_json(capsys, [*argv, "--mesh", "1,1,2,2", "--activation-checkpointing", "full"])
    assert report["plans"][0]["layout"] == {"pp": 1, "dp": 1, "ring": 2, "ulysses": 2, "ep": 1, "ac": "full"} | {
        "ac_every": 2
    }
    main([*argv, "--mesh", "1,1,2,2", "--activation-checkpointing", "full", "--write-recipe", str(recipe)])
    lines, cfg = load_written(recipe)
    match = re.fullmatch(r"# torchrun --standalone --nproc-per-node (\d+) -m lctrain train recipe=(\S+)", lines[1])
    assert match and match.groups() == ("4", name)
    assert cfg.model.path == str(model_dir.resolve())
    assert (cfg.parallel.ring, cfg.parallel.ulysses, cfg.parallel.activation_checkpointing) == (2, 2, "full")
    check_written(cfg, 4, 4, load_model(str(model_dir)))
