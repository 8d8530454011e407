"""lctrain's benchmarks: each prints its figures as markdown; run from the repository root as
``python -m benchmarks.NAME`` (``--help``). Their shared parts and their method: ``docs/benchmarks.md``; what they
share with the tests lives in ``testbed/``."""
