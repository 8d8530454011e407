"""lctrain's benchmarks: each prints its figures as markdown (``docs/benchmarks.md``). Run from the repository root
as ``python -m benchmarks.NAME`` (``--help`` describes each).

Their shared parts: ``jobs`` (the jobs they run, named once), ``sides`` (lctrain's training step and the plain
Hugging Face loop), ``runs`` (a side in processes of its own, step by step, each step measured), ``memory`` (the
memory figures of a process), ``search`` (the longest sequence that fits), ``rings`` (lctrain's ring and
PyTorch's, pass by pass) and ``report`` (command, machine line, tables). What they share with the tests (the tiny
job, the generated corpus, network-namespace hosts) lives in ``testbed/``."""
