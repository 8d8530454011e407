"""The Hugging Face export of a trained, FSDP-sharded run loads with ``from_pretrained`` and computes what the
trained lctrain model computes.

One spawned gloo group of 2 ranks trains two small jobs for 3 steps each on a small jsonl corpus
(``testbed/corpus.py``), parameters FSDP-sharded over both ranks, and exports ``hf/``: ``parallel.ring=2`` with
untied embeddings and no activation checkpointing, and ``parallel.ulysses=2`` with tied embeddings and full activation
checkpointing (wrapped parameter names, one shared tensor) with Llama 3.2's ``llama3`` RoPE type. After
``trainer.train()`` each rank runs the trained, still sharded lctrain model (USP attention) on its zigzag shard of a
fixed 64-token input; the logit shards are all-gathered and unsharded on rank 0. The test process then loads
``run_dir/hf`` with ``AutoModelForCausalLM.from_pretrained`` (plain SDPA attention, one process) and compares its logits
on the same input: fp32, within 1e-5 absolute + 1e-5 relative (logits are O(1); observed: 5e-7 for ring=2, exactly equal
for ulysses=2). The exported weights differ from the seeded initial ones (training happened), and
``AutoTokenizer.from_pretrained(run_dir/"hf")`` loads the training tokenizer (same vocabulary, same token ids on a
sample text). Finally a fine-tuning job with ``model=hf model.path=<the ring=2 export>`` (ring=2, weights read shard by
shard from the safetensors file, the tokenizer taken from the same directory) computes, before any step, the exported
model's logits (same tolerance). Fine-tuning that export for one step with each RoPE scaling type transformers supports
for Llama (linear with a new ``rope_theta``, dynamic, yarn, llama3) writes the type, factor and base into the exported
``config.json`` (``rope_parameters``), and ``from_pretrained`` of it reproduces the sharded lctrain model's logits (same
tolerance), which the default RoPE would not (they differ by more than 1e-3; except dynamic, which up to
``max_position_embeddings`` uses the base frequencies).

Each other family, trained one step and exported, reloads with ``from_pretrained`` with the sliding windows it was
trained with in its ``config.json`` and the sharded model's logits (same tolerance), which the same weights without
the windows do not give: a random-init Mistral with ``model.sliding_window=8`` (ring 2), a random-init Qwen3 (q/k
norms; Ulysses 2), the mixtures of experts (a random-init Qwen3-MoE on Ulysses 2, a Mixtral with
``model.sliding_window=8`` on ring 2; 4 experts, top 2, their router loss in the step), a Qwen2 checkpoint loaded
with ``model.path`` whose layer 1 alone has a window of 8 (``use_sliding_window``, ``max_window_layers=1``; ring 2),
and that Mistral's export fine-tuned with
``model.sliding_window=0``, whose export has no window.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lctrain.attention import unshard_sequence
from lctrain.config import load_config
from lctrain.data import load_tokenizer
from lctrain.families import apply_sliding_window, layer_windows
from lctrain.models import random_init_source
from lctrain.testing import run_distributed
from testbed.corpus import corpus_overrides, write_corpus

WORLD = 2
SEQ_LEN = 64
SAMPLE_TEXT = "def export(model, out_dir):\n    return model.save_pretrained(out_dir)  # ok\n"
CASES = {
    "untied": ["parallel.ring=2", "model.tie_word_embeddings=false", "parallel.activation_checkpointing=none"],
    "tied_ac": [  # Llama 3.2's form: tied embeddings and the llama3 RoPE type
        "parallel.ulysses=2",
        "model.tie_word_embeddings=true",
        "parallel.activation_checkpointing=full",
        "model.rope_scaling.type=llama3",
        "model.rope_scaling.factor=8",
        "model.rope_scaling.original_max_position_embeddings=32",
        "model.max_position_embeddings=256",
    ],
}
WINDOW = 8
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.router_aux_loss_coef=0.1"]
# the other families, one step each: (overrides, the window of each of the 2 layers in the exported config.json);
# <root> is the test's directory (QWEN2_CHECKPOINT: a Qwen2 checkpoint with a window on layer 1 only)
QWEN2_CHECKPOINT = "qwen2_checkpoint"
FAMILY_CASES = {
    "mistral_window": (["parallel.ring=2", "model.family=mistral", f"model.sliding_window={WINDOW}"], [WINDOW, WINDOW]),
    "qwen3": (["parallel.ulysses=2", "model.family=qwen3"], [None, None]),
    "qwen2_layers": (["parallel.ring=2", "model=hf", f"model.path=<root>/{QWEN2_CHECKPOINT}"], [None, WINDOW]),
    # the mixtures of experts, with their router's load-balancing loss in the step
    "qwen3_moe": (["parallel.ulysses=2", "model.family=qwen3_moe", *MOE], [None, None]),
    "mixtral_window": (["parallel.ring=2", "model.family=mixtral", f"model.sliding_window={WINDOW}", *MOE], [8, 8]),
    # the Mistral export fine-tuned with its window turned off: the export says so
    "mistral_window_off": (
        ["parallel.ring=2", "model=hf", "model.path=<root>/family_mistral_window/hf", "model.sliding_window=0"],
        [None, None],
    ),
}
# fine-tuning the untied export with new RoPE settings (ring=2, one step): each type transformers supports for Llama
ROPE_CASES = {
    "linear": ["model.rope_theta=20000", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2"],
    "dynamic": ["model.rope_scaling.type=dynamic", "model.rope_scaling.factor=4", "model.max_position_embeddings=256"],
    "yarn": [
        "model.rope_theta=50000",
        "model.rope_scaling.type=yarn",
        "model.rope_scaling.factor=4",
        "model.rope_scaling.original_max_position_embeddings=64",
        "model.max_position_embeddings=256",
    ],
    "llama3": [
        "model.rope_scaling.type=llama3",
        "model.rope_scaling.factor=8",
        "model.rope_scaling.original_max_position_embeddings=32",
        "model.max_position_embeddings=256",
    ],
}
BASE = [
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    f"data.seq_len={SEQ_LEN}",
    "train.steps=3",
    "optim.warmup_steps=1",
    "optim.lr=1e-2",
    "checkpoint.every=0",
    "logging.progress_bar=false",
    "logging.plot=false",
]


def fixed_input(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1234))


def sharded_logits(trainer: Any) -> torch.Tensor:
    """The sharded lctrain model's logits on ``fixed_input``, gathered: ``[1, S, V]``."""
    ring, ulysses = trainer.dims.ring, trainer.dims.ulysses
    shard = functools.partial(trainer.place.shard, dim=1)
    input_ids = fixed_input(trainer.hf_config.vocab_size)
    with torch.no_grad():
        logits = trainer.model(
            input_ids=shard(input_ids),
            position_ids=shard(torch.arange(SEQ_LEN)[None]),
            logits_to_keep=0,  # all positions
        ).logits  # [1, S/(R·U), V]
    # world = ring × ulysses (dp = pp = 1): rank r·U + u holds ring rank r's part u, the order unshard expects
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, logits.contiguous())
    return unshard_sequence(shards, dim=1, ring_size=ring, ulysses_size=ulysses)


def train_and_logits(root: str) -> dict[str, Any] | None:
    """Each case: train, export, then the trained sharded model's logits on ``fixed_input`` (full, on rank 0).
    Then a fine-tuning job loads the ``untied`` export with ``model.path`` (sharded, its own tokenizer)."""
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    out: dict[str, Any] = {}
    corpus = corpus_overrides(Path(root) / "corpus.jsonl")
    for name, overrides in CASES.items():
        cfg = load_config([*BASE, *corpus, *overrides, f"train.run_dir={Path(root) / name}"])
        trainer = Trainer(build_training_job(cfg))
        out[name] = {"losses": trainer.train(), "logits": sharded_logits(trainer)}
    hf_dir = Path(root) / "untied" / "hf"
    cfg = load_config(
        [*BASE, *corpus, "parallel.ring=2", "model=hf", f"model.path={hf_dir}", f"train.run_dir={root}/ft"]
    )
    trainer = Trainer(build_training_job(cfg))
    out["finetune"] = {"logits": sharded_logits(trainer), "tokenizer": trainer.tokenizer.name_or_path}
    for name, overrides in ROPE_CASES.items():
        run_dir = Path(root) / f"rope_{name}"
        model = ["parallel.ring=2", "model=hf", f"model.path={hf_dir}", "train.steps=1", *overrides]
        trainer = Trainer(build_training_job(load_config([*BASE, *corpus, *model, f"train.run_dir={run_dir}"])))
        trainer.train()
        out[f"rope_{name}"] = {"logits": sharded_logits(trainer)}
    for name, (overrides, _) in FAMILY_CASES.items():
        model = [item.replace("<root>", root) for item in overrides]
        run_dir = Path(root) / f"family_{name}"
        trainer = Trainer(
            build_training_job(load_config([*BASE, *corpus, "train.steps=1", *model, f"train.run_dir={run_dir}"]))
        )
        trainer.train()
        out[f"family_{name}"] = {"logits": sharded_logits(trainer)}
    return out if dist.get_rank() == 0 else None


def write_qwen2_checkpoint(path: Path) -> None:
    """A small Qwen2 checkpoint (seeded weights, the embedded tokenizer) with a sliding window on layer 1 only."""
    tokenizer = load_tokenizer(None)
    config = AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer) + 64,  # padded, as Qwen's are (transformers reloads it as a Qwen2Tokenizer: +1)
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("export")
    write_corpus(root / "corpus.jsonl")
    write_qwen2_checkpoint(root / QWEN2_CHECKPOINT)
    return root, run_distributed(train_and_logits, WORLD, str(root))[0]


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_reproduces_trained_logits(trained: tuple[Path, dict[str, Any]], case: str) -> None:
    root, results = trained
    hf_dir = root / case / "hf"
    assert "lctrain" not in (hf_dir / "config.json").read_text()  # no custom attention implementation saved
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings is (case == "tied_ac")
    with torch.no_grad():
        expected = model(input_ids=fixed_input(model.config.vocab_size)).logits
    torch.testing.assert_close(results[case]["logits"], expected, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(torch.tensor(results[case]["losses"])))


@pytest.mark.parametrize("case", list(CASES))
def test_exported_weights_are_the_trained_ones(trained: tuple[Path, dict[str, Any]], case: str) -> None:
    root, _ = trained
    hf_dir = root / case / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    saved = load_file(hf_dir / "model.safetensors")
    assert ("lm_head.weight" in saved) is (case == "untied")
    assert not any("_checkpoint_wrapped_module" in name or "_fsdp" in name for name in saved)
    init = random_init_source(model.config, seed=0)  # train.seed defaults to 0
    for name, param in model.named_parameters():
        if "norm" not in name:  # norms start at ones; a few steps of AdamW move them a little
            assert not torch.allclose(param, init(name, param.shape), atol=1e-4), f"{name} was not trained"
    if case == "tied_ac":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("rope_type", list(ROPE_CASES))
def test_rope_scaling_is_exported_and_reproduced_by_transformers(
    trained: tuple[Path, dict[str, Any]], rope_type: str
) -> None:
    root, results = trained
    hf_dir = root / f"rope_{rope_type}" / "hf"
    rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    overrides = dict(item.split("=") for item in ROPE_CASES[rope_type])
    assert rope["rope_type"] == rope_type and rope["factor"] == float(overrides["model.rope_scaling.factor"])
    assert rope["rope_theta"] == float(overrides.get("model.rope_theta", 10000.0))
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.model.rotary_emb.rope_type == rope_type
    with torch.no_grad():
        expected = model(input_ids=fixed_input(model.config.vocab_size)).logits
    torch.testing.assert_close(results[f"rope_{rope_type}"]["logits"], expected, atol=1e-5, rtol=1e-5)
    if rope_type == "dynamic":
        return  # up to max_position_embeddings (here all 64 positions) dynamic RoPE uses the base frequencies
    default = AutoModelForCausalLM.from_pretrained(hf_dir, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with torch.no_grad():  # the RoPE settings matter: without them the same weights give other logits
        assert not torch.allclose(default(input_ids=fixed_input(model.config.vocab_size)).logits, expected, atol=1e-3)


def test_exported_tokenizer_is_the_training_tokenizer(trained: tuple[Path, dict[str, Any]]) -> None:
    root, _ = trained
    exported = AutoTokenizer.from_pretrained(root / "untied" / "hf")
    original = load_tokenizer(None)
    assert len(exported) == len(original)
    ids = exported(SAMPLE_TEXT)["input_ids"]
    assert ids == original(SAMPLE_TEXT)["input_ids"] and len(ids) > 5
    assert exported.decode(ids, skip_special_tokens=True) == original.decode(ids, skip_special_tokens=True)
    config = json.loads((root / "untied" / "hf" / "config.json").read_text())
    assert config["vocab_size"] >= len(exported)


def test_finetuning_loads_the_export_shard_by_shard(trained: tuple[Path, dict[str, Any]]) -> None:
    root, results = trained
    hf_dir = root / "untied" / "hf"
    assert results["finetune"]["tokenizer"] == str(hf_dir)  # data.tokenizer unset: the model's own
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        expected = model(input_ids=fixed_input(model.config.vocab_size)).logits
    torch.testing.assert_close(results["finetune"]["logits"], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_export_of_each_family_reloads_with_its_windows_and_logits(
    trained: tuple[Path, dict[str, Any]], case: str
) -> None:
    root, results = trained
    hf_dir = root / f"family_{case}" / "hf"
    windows = FAMILY_CASES[case][1]
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.config.model_type == case.removesuffix("_window_off").removesuffix("_window").split("_layers")[0]
    assert layer_windows(model.config) == windows  # the exported config.json says which windows were trained
    with torch.no_grad():
        expected = model(input_ids=fixed_input(model.config.vocab_size)).logits
    torch.testing.assert_close(results[f"family_{case}"]["logits"], expected, atol=1e-5, rtol=1e-5)
    if any(windows):  # the windows matter: without them the same weights give other logits
        config = AutoConfig.from_pretrained(hf_dir)
        apply_sliding_window(config, 0)  # model.sliding_window=0
        assert not any(layer_windows(config))
        unwindowed = AutoModelForCausalLM.from_pretrained(hf_dir, config=config)
        with torch.no_grad():
            assert not torch.allclose(
                unwindowed(input_ids=fixed_input(model.config.vocab_size)).logits, expected, atol=1e-3
            )
