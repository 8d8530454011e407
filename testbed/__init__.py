"""What the tests and the benchmarks both run lctrain on: ``corpus`` (small deterministic jsonl corpora),
``jobs`` (the tiny CPU job) and ``hosts`` (network-namespace hosts with rate-limited links). It imports lctrain
only, never ``tests`` or ``benchmarks``; both of those import it."""
