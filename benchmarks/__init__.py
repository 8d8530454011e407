"""lctrain's benchmarks: each prints its figures as markdown (``docs/benchmarks.md``). Run from the repository root
as ``python -m benchmarks.NAME`` (``--help`` describes each).

Their shared parts: ``jobs`` (the jobs they run, named once), ``sides`` (lctrain's training step and the plain
Hugging Face loop), ``runs`` (sides in processes or groups of their own, step by step, each step measured),
``timing`` (sides in rounds, the slowest rank, the median), ``memory`` (a process's memory beyond a step's, which
is ``lctrain.train.meter.StepMemory``), ``search`` (the longest sequence that fits), ``rings`` (the attention
inputs, lctrain's ring and PyTorch's pass by pass, the ring's traffic from its plan) and ``report`` (command,
machine line, tables). What they share with the tests (the tiny job, the generated corpus, network-namespace hosts)
lives in ``testbed/``."""
