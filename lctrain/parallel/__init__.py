"""Process groups and meshes: local spawning of CPU groups for tests and benchmarks (the mesh builder, FSDP and
pipeline functions arrive with the trainer)."""
