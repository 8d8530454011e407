"""Distributed checkpoints: ``<run_dir>/checkpoints/step_XXXXXXXX/``, written atomically, checksummed, and read
without running code from the files.

Modules: ``store`` (``Checkpointer``: save, load, resume points), ``checksums`` (``checksums.json``), ``safe_read``
(unpickling only DCP's metadata classes), ``compat`` (does a checkpoint fit the model), ``errors`` (one error on
every rank).

Model and optimizer state go through ``torch.distributed.checkpoint`` (each rank writes its shards; loading works
for any FSDP layout). What differs per rank (data loader position, RNG states) and the small plain state (step,
scheduler, the mesh) go to ``rank_XXXXX.pt``, read back with ``weights_only=True``. Everything is written into
``step_XXXXXXXX.tmp``; once every rank is done, rank 0 renames it to ``step_XXXXXXXX``. A directory without the
``.tmp`` suffix is therefore complete, and a crash mid-save leaves only a ``.tmp`` directory, which is never resumed
from and is deleted by the next save.

**Integrity.** DCP keeps no checksums: a flipped byte in a ``.distcp`` file would load silently. So before the
rename, the SHA-256 and size of every file of the checkpoint (the DCP data files, ``.metadata``, each
``rank_XXXXX.pt``) go into ``checksums.json``, which rank 0 writes last: a complete checkpoint always has it. The
hashing is spread over the ranks: rank 0 lists the files (DCP's ``__{rank}_{i}.distcp`` naming is private, so it
is not relied on) and each rank hashes its share, the largest files first to the least loaded rank, so that each
hashes about the same number of bytes. The check at load (``Checkpointer.verify``, run once per checkpoint by the
first ``read_extra`` or ``load``, before anything else is read from it) is split the same way. Each byte is hashed
once at save and once at load, across all ranks: 0.75 s per GB and rank on the 2-core development machine, files
in the page cache (a 0.8 GB checkpoint: 3.9 s to save, 0.6 s of it hashing; 0.6 s to verify, then 0.7 s to load,
which reads the files a second time, usually from the page cache). The results of all ranks are gathered, so every
rank raises the same error and none is left waiting in a collective: a file whose size or hash differs is a
``ValueError`` naming it as corrupted, a listed file that is gone is a ``FileNotFoundError`` naming it, and so is a
missing ``checksums.json`` (a checkpoint written before checksums, or damaged). ``load`` also checks that
``.metadata`` refers only to checksummed files.

**Mismatch.** ``load`` compares the checkpoint's keys and shapes with the model's before loading (across all
ranks, whatever each holds with pipeline parallelism): a weight of another shape, a weight the checkpoint lacks or
one the model lacks is a ``ValueError`` naming the checkpoint, the first such key (with both shapes) and the fix
(the ``model.*`` settings of the run that saved it). Whatever DCP still refuses (its ``CheckpointException``, a
``BaseException`` raised on every rank) becomes a ``ValueError`` naming the checkpoint.

**No code from the files.** Checksums cannot stop a malicious checkpoint: ``checksums.json`` lies beside the files
it vouches for. What matters is how the files are deserialized. In torch 2.13, DCP's ``FileSystemReader`` reads
``.metadata`` with plain ``pickle.load`` and its ``DefaultLoadPlanner`` reads non-tensor entries (the optimizer's
hyperparameters) with ``torch.load(weights_only=False)``: either would run any code a crafted file asks for, and
torch offers no safe option for them. ``load`` therefore reads ``.metadata`` with an unpickler, an
unpickler that resolves only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths, and the non-tensor
entries with ``weights_only=True`` (``WeightsOnlyLoadPlanner``); DCP already reads tensor data with
``weights_only=True``, and so does ``read_extra``.
"""

from lctrain.checkpoint.checksums import MANIFEST
from lctrain.checkpoint.store import Checkpointer, checkpoint_step, complete_checkpoints, step_dir_name

__all__ = ["MANIFEST", "Checkpointer", "checkpoint_step", "complete_checkpoints", "step_dir_name"]
