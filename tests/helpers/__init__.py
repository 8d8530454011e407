"""What the test suites share: the corpus they train on, the single-process references (attention in float64, the
plain Hugging Face training loop), stand-ins for CUDA attention ops, and the tiny launched job with its watchers."""
