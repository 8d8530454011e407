"""What the test suites share: the single-process references (attention in float64, the plain Hugging Face training
loop), stand-ins for CUDA attention ops, and the tiny launched job with its watchers. The corpus they train on and
the tiny job it shrinks come from ``testbed/``, which the benchmarks use too."""
