"""Distributed checkpoints: ``<run_dir>/checkpoints/step_XXXXXXXX/``, written atomically (a ``.tmp`` directory
renamed once every rank is done), checksummed (``checksums.json``, checked before anything is read), compared with
the model before loading, and read without running code from the files. ``docs/checkpoints.md`` explains each.

Modules: ``store`` (``Checkpointer``: save, load, resume points), ``checksums`` (``checksums.json``), ``safe_read``
(unpickling only DCP's metadata classes), ``compat`` (does a checkpoint fit the model), ``errors`` (one error on
every rank).
"""

from lctrain.checkpoint.checksums import MANIFEST
from lctrain.checkpoint.store import Checkpointer, checkpoint_step, complete_checkpoints, step_dir_name

__all__ = ["MANIFEST", "Checkpointer", "checkpoint_step", "complete_checkpoints", "step_dir_name"]
