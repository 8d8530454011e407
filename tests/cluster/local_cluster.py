"""A slurm cluster on this machine, to try a recipe with ``scripts/slurm/train.sbatch`` before submitting it to a
real one: munged, slurmctld and two slurmd nodes (``tests/cluster/harness.py``), all files in one directory.
Needs root and Debian's packages (``apt-get install slurmctld slurmd slurm-client munge``).

    sudo .venv/bin/python -m tests.cluster.local_cluster up      # prints the SLURM_CONF line to export
    export SLURM_CONF=/tmp/lctrain-cluster/slurm.conf
    NPROC_PER_NODE=2 sbatch --nodes=2 --gpus-per-node=0 scripts/slurm/train.sbatch recipe=tiny_cpu
    squeue; scancel JOBID
    sudo .venv/bin/python -m tests.cluster.local_cluster down    # cancels the jobs, stops the daemons, removes it

``up --dir DIR`` chooses the directory (default /tmp/lctrain-cluster); ``--cpus N`` the CPUs of each node.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tests.cluster.harness import SlurmCluster, unavailable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lctrain-cluster"))
    parser.add_argument("--cpus", type=int, default=2, help="CPUs of each node (default 2)")
    args = parser.parse_args()
    state = args.dir / "cluster.json"
    if args.action == "up":
        reason = unavailable()
        if reason:
            sys.exit(f"local_cluster: {reason}")
        if state.exists():
            sys.exit(f"local_cluster: a cluster already runs in {args.dir} (local_cluster.py down --dir {args.dir})")
        if args.dir.exists() and any(args.dir.iterdir()):
            sys.exit(f"local_cluster: {args.dir} exists and is not empty; choose another --dir")
        cluster = SlurmCluster(args.dir, cpus_per_node=args.cpus)
        try:
            cluster.start()
        except BaseException:
            cluster.stop()
            raise
        print(f"slurm cluster up: nodes {', '.join(cluster.nodes)} ({args.cpus} CPUs each), files in {args.dir}")
        print(f"export SLURM_CONF={cluster.conf}")
    elif not state.exists():
        sys.exit(f"local_cluster: no cluster in {args.dir}")
    elif args.action == "status":
        print(json.dumps(json.loads(state.read_text()), indent=1))
    else:
        SlurmCluster.attach(args.dir).stop()
        print(f"slurm cluster in {args.dir} stopped and removed")


if __name__ == "__main__":
    main()
