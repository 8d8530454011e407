"""The two sides the GPU benchmarks compare, each run as one fresh process (``run``): lctrain's training step and a
plain Hugging Face loop. ``bench_gpu.py`` (speed) and ``bench_gpu_context.py`` (longest context) drive them.

- ``lctrain``: ``Trainer.train_step`` at world size 1 (an NCCL group of one on CUDA, gloo on CPU): USP attention,
  FSDP2, the chunked loss, fused AdamW; ``parallel.param_dtype=bfloat16`` on CUDA (fp32 on CPU); activation
  checkpointing ``full`` or ``none``; optionally ``parallel.cpu_offload`` and ``parallel.activation_offload``.
- ``hf``: ``LlamaForCausalLM`` with ``attn_implementation="sdpa"`` and fp32 weights, ``torch.autocast(bfloat16)`` on
  CUDA (none on CPU), ``loss = model(input_ids=x, labels=x).loss``, ``backward``, ``clip_grad_norm_(1.0)``,
  ``AdamW(fused=True)``; Hugging Face's gradient checkpointing (non-reentrant) for ``full``.

Both start from the same weights (lctrain's seeded init) and train on the same random rows: one document per row,
or packed with documents of ``doc_len`` tokens (lctrain skips attention across documents; the plain loop is given
the restarting ``position_ids``, from which transformers builds the document mask for sdpa). One process per run,
so that each peak and each allocator state is that run's own: ``python benchmarks/gpu_sides.py SPEC_JSON`` prints
``RESULT {json}``; ``run`` starts it and returns the result (an out-of-memory or a timeout is a result, not a
failure).

Memory: on CUDA the peak allocated and reserved bytes over the measured steps (``torch.cuda`` statistics, reset after
the warm-up); on CPU the resident-set peak over the measured steps less the resident set before the model was built
(VmHWM − VmRSS, ``report.reset_peak``): parameters, optimizer states, activations and buffers, as on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SIDES = ("lctrain", "hf")
ROWS = ("one-document", "packed")
CHECKPOINTING = ("none", "full")
RESULT_PREFIX = "RESULT "
# Llama-3.2-1B's sizes with an untied head (the shape)
SHAPE_DEFAULTS = {"hidden": 2048, "intermediate": 8192, "layers": 16, "heads": 32, "kv_heads": 8, "vocab": 128256}


def add_shape_args(parser: Any) -> None:
    """The model-shape and device flags both GPU benchmarks take."""
    group = parser.add_argument_group("model shape (default: Llama-3.2-1B with an untied head)")
    group.add_argument("--hidden", type=int, default=SHAPE_DEFAULTS["hidden"], help="model.hidden_size")
    group.add_argument("--intermediate", type=int, default=SHAPE_DEFAULTS["intermediate"], help="MLP width")
    group.add_argument("--layers", type=int, default=SHAPE_DEFAULTS["layers"], help="model.num_layers")
    group.add_argument("--heads", type=int, default=SHAPE_DEFAULTS["heads"], help="model.num_heads")
    group.add_argument("--kv-heads", type=int, default=SHAPE_DEFAULTS["kv_heads"], help="model.num_kv_heads")
    group.add_argument("--vocab", type=int, default=SHAPE_DEFAULTS["vocab"], help="model.vocab_size")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run with tiny shapes")
    parser.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU (default: known GPUs; none on CPU)")


def shape_of(args: Any) -> dict[str, int]:
    return {key: getattr(args, key) for key in SHAPE_DEFAULTS}


def num_params(shape: dict[str, int]) -> int:
    """Parameters of the untied Llama of ``shape`` (the planner's count, which a unit test keeps equal to HF's)."""
    from lctrain.planner import ModelSpec

    return spec_of(shape, ModelSpec).num_params


def spec_of(shape: dict[str, int], model_spec: Any) -> Any:
    return model_spec(
        "bench",
        shape["hidden"],
        shape["intermediate"],
        shape["layers"],
        shape["heads"],
        shape["kv_heads"],
        shape["vocab"],
        shape["hidden"] // shape["heads"],
    )


def run(spec: dict[str, Any], *, timeout_s: float, allocator: str | None = None) -> dict[str, Any]:
    """Run one side in a fresh process (``spec``: see ``worker``); ``allocator`` is its ``PYTORCH_CUDA_ALLOC_CONF``
    (None: the caller's environment, with lctrain's default when unset). Returns the worker's result, or
    ``{"ok": False, "error": ...}`` when the process timed out or failed without one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("PYTHONUNBUFFERED", "1")
    if allocator is not None:
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator
    elif "PYTORCH_CUDA_ALLOC_CONF" not in env and "PYTORCH_ALLOC_CONF" not in env:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # what lctrain's CLI sets
    command = [sys.executable, __file__, json.dumps(spec)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s", "wall_s": time.perf_counter() - started}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :]) | {"wall_s": time.perf_counter() - started}
    lines = proc.stderr.strip().splitlines() or ["(no output)"]
    return {
        "ok": False,
        "error": f"exit status {proc.returncode}: {lines[-1]}",  # the exception's message
        "stderr_tail": "\n".join(lines[-30:]),
        "wall_s": time.perf_counter() - started,
    }


# ---------------------------------------------------------------------------------------------------------------
# Inside the worker process
# ---------------------------------------------------------------------------------------------------------------


class LctrainSide:
    """``Trainer.train_step`` on a process group of one."""

    def __init__(self, spec: dict[str, Any], device: Any, run_dir: str):
        from lctrain.config import load_config
        from lctrain.runtime import init_distributed
        from lctrain.train.trainer import Trainer

        shape = spec["shape"]
        init_distributed(device, timeout_s=1800, host_collectives=spec["cpu_offload"])
        overrides = [
            f"model.hidden_size={shape['hidden']}",
            f"model.intermediate_size={shape['intermediate']}",
            f"model.num_layers={shape['layers']}",
            f"model.num_heads={shape['heads']}",
            f"model.num_kv_heads={shape['kv_heads']}",
            f"model.vocab_size={shape['vocab']}",
            "model.tie_word_embeddings=false",
            f"data.seq_len={spec['seq']}",
            f"train.device={device.type}",
            f"parallel.param_dtype={'bfloat16' if device.type == 'cuda' else 'float32'}",
            f"parallel.activation_checkpointing={spec['checkpointing']}",
            f"parallel.activation_offload={str(spec['activation_offload']).lower()}",
            f"parallel.cpu_offload={str(spec['cpu_offload']).lower()}",
            f"train.run_dir={run_dir}",
            "checkpoint.resume=none",
            "checkpoint.export_hf=false",
            "logging.progress_bar=false",
            "logging.plot=false",
        ]
        self.trainer = Trainer(load_config(overrides))
        self.packed = spec["rows"] == "packed"
        self.doc_len = spec["doc_len"]

    def step(self, input_ids: Any) -> tuple[float, float]:
        from report import one_document_batch, packed_batch

        batch = packed_batch(input_ids, self.doc_len) if self.packed else one_document_batch(input_ids)
        result = self.trainer.train_step([batch])  # ends reading back the loss: the device's work is done
        return result["loss"], result["grad_norm"]


class HFSide:
    """The plain loop of the module docstring."""

    def __init__(self, spec: dict[str, Any], device: Any):
        import torch

        from lctrain.config.schema import ModelConfig
        from lctrain.models import build_empty_model, materialize, model_config, random_init_source

        shape = spec["shape"]
        cfg = ModelConfig(
            hidden_size=shape["hidden"],
            intermediate_size=shape["intermediate"],
            num_layers=shape["layers"],
            num_heads=shape["heads"],
            num_kv_heads=shape["kv_heads"],
            vocab_size=shape["vocab"],
        )
        config = model_config(cfg, shape["vocab"])
        self.model = build_empty_model(config)  # LlamaForCausalLM, attn_implementation="sdpa"
        materialize(self.model, random_init_source(config, seed=0), device)  # fp32, lctrain's init (seed 0)
        self.model.train()
        if spec["checkpointing"] == "full":
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        self.device = device
        self.packed = spec["rows"] == "packed"
        self.doc_len = spec["doc_len"]

    def step(self, input_ids: Any) -> tuple[float, float]:
        import torch
        from report import packed_batch

        x = input_ids.to(self.device)
        extra = {}
        if self.packed:  # transformers builds the document mask from positions that restart at each document
            extra["position_ids"] = packed_batch(input_ids, self.doc_len)["position_ids"].to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = self.model(input_ids=x, labels=x, **extra).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), norm.item()


def _outermost(events: list, prefix: str) -> list:
    """The profiler's ranges named ``prefix...`` that lie inside no other such range."""
    outer = []
    for event in events:
        if not event.name.startswith(prefix):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(prefix):
            parent = parent.cpu_parent
        if parent is None:
            outer.append(event)
    return outer


def profile_step(step: Any, device: Any, top: int) -> dict[str, Any]:
    """One step under ``torch.profiler``: the ``top`` kernels (CUDA; operators by self time on CPU) and FSDP2's share
    (its outermost ``FSDP::*`` ranges: the kernel time launched inside them over all kernel time of the step, and
    their host time over the step's wall time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        wall_us = (time.perf_counter() - started) * 1e6
    events = prof.events()
    fsdp = _outermost([e for e in events if e.device_type == torch.autograd.DeviceType.CPU], "FSDP::")
    result: dict[str, Any] = {"wall_ms": wall_us / 1e3, "fsdp_host_ms": sum(e.cpu_time_total for e in fsdp) / 1e3}
    result["fsdp_host_share"] = result["fsdp_host_ms"] * 1e3 / wall_us
    if cuda:
        kernels: dict[str, list[float]] = {}
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
        total_us = sum(sum(times) for times in kernels.values())
        result["kernel_ms"] = total_us / 1e3
        result["fsdp_kernel_ms"] = sum(e.device_time_total for e in fsdp) / 1e3
        result["fsdp_kernel_share"] = result["fsdp_kernel_ms"] * 1e3 / total_us if total_us else None
        ranked = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:top]
        result["top"] = [(name, sum(times) / 1e3, len(times), sum(times) / total_us) for name, times in ranked]
    else:
        averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
        total_us = sum(a.self_cpu_time_total for a in averages)
        averages = averages[:top]
        result["top"] = [
            (a.key, a.self_cpu_time_total / 1e3, a.count, a.self_cpu_time_total / total_us) for a in averages
        ]
    return result


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One side in this process. ``spec``: side, device, shape, seq, checkpointing, rows, doc_len, cpu_offload,
    activation_offload, warmup (steps), warmup_seq (their length; default seq), steps (measured), profile_top (0:
    no profile), fsdp_share (profile one more step for FSDP2's share)."""
    import torch
    from report import peak_since_reset, reset_peak

    from lctrain.train.metrics import peak_flops

    device = torch.device(spec["device"], 0) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result: dict[str, Any] = {"ok": True, "error": None, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result["peak_flops"] = peak_flops(device, None)  # a known GPU's dense bf16 peak; None on CPU
    rss_base = reset_peak()
    vocab, seq = spec["shape"]["vocab"], spec["seq"]

    def rows(index: int, length: int) -> torch.Tensor:
        return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(index))

    try:
        with tempfile.TemporaryDirectory(prefix="bench_gpu_") as run_dir:
            side = LctrainSide(spec, device, run_dir) if spec["side"] == "lctrain" else HFSide(spec, device)
            for index in range(spec["warmup"]):
                side.step(rows(1000 + index, spec.get("warmup_seq") or seq))
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            reset_peak()
            result["step_s"], result["loss"], result["grad_norm"] = [], [], []
            for index in range(spec["steps"]):
                started = time.perf_counter()
                loss, norm = side.step(rows(index, seq))
                result["step_s"].append(time.perf_counter() - started)
                result["loss"].append(loss)
                result["grad_norm"].append(norm)
            if device.type == "cuda":
                result["peak_allocated"] = torch.cuda.max_memory_allocated(device)
                result["peak_reserved"] = torch.cuda.max_memory_reserved(device)
            else:
                result["peak_allocated"] = peak_since_reset() - rss_base
                result["peak_reserved"] = None
            if spec["profile_top"] or spec["fsdp_share"]:
                try:
                    result["profile"] = profile_step(lambda: side.step(rows(99, seq)), device, spec["profile_top"])
                except Exception as error:  # noqa: BLE001 (a profiler that cannot run must not lose the figures)
                    result["profile"] = {"error": f"{type(error).__name__}: {error}"}
    except torch.cuda.OutOfMemoryError:
        result.update(ok=False, error="out of memory")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return result


if __name__ == "__main__":  # benchmarks/ is on sys.path (the script's directory): report.py imports
    outcome = worker(json.loads(sys.argv[1]))
    print(RESULT_PREFIX + json.dumps(outcome), flush=True)
