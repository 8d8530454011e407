"""What the tests and the benchmarks both run lctrain on: ``corpus`` (small deterministic jsonl corpora),
``jobs`` (the tiny CPU job) and ``hosts`` (network-namespace hosts with rate-limited links). It imports neither
``tests`` nor ``benchmarks``; both import it."""
