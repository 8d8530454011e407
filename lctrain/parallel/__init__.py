"""Parallelism, applied by functions to an unmodified model: the job's parallel layout and its mesh (``dims``:
``ParallelDims``), pipeline stages and their schedule (``pipeline``), activation checkpointing and offload
(``activation_checkpointing``), FSDP2 over ``dp_cp`` (``fsdp``)."""
