"""The tiny CPU job: ``recipe=tiny_cpu`` without its outputs, the base of the benchmarks' CPU jobs
(``benchmarks/jobs.py``) and of the job the launch and cluster tests start (``tests/helpers/jobs.py``). A job is a
list of Hydra overrides for ``lctrain.config.load_config``; later overrides win."""

from __future__ import annotations

# no Hugging Face export, loss plot, progress bar or validation: outputs that a measured or tested job does not need
QUIET = ("checkpoint.export_hf=false", "logging.plot=false", "logging.progress_bar=false", "data.val_sources=[]")


def tiny_job(*changes: str) -> list[str]:
    """``recipe=tiny_cpu`` (a small Llama on the embedded corpus, ring 2 × Ulysses 2) without its outputs, then
    ``changes``."""
    return ["recipe=tiny_cpu", *QUIET, *changes]
