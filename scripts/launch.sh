#!/usr/bin/env bash
# Start `lctrain train` on this node with torchrun; every argument goes to `lctrain train` (recipe=NAME, overrides).
#
#   scripts/launch.sh recipe=tiny_cpu                                  # one node, NPROC_PER_NODE processes
#   NNODES=2 MASTER_ADDR=node01 scripts/launch.sh recipe=NAME ...      # run the same line on every node
#
# Environment (all optional on one node):
#   NPROC_PER_NODE  processes on this node (default: auto, one per GPU, else one per CPU core)
#   NNODES          nodes in the job (default 1: torchrun --standalone)
#   MASTER_ADDR     with NNODES > 1: the host of the c10d rendezvous (any one node of the job; required)
#   MASTER_PORT     its port (default 29500)
#   RDZV_ID         a job id shared by the nodes (default lctrain-$MASTER_ADDR-$MASTER_PORT)
#   PYTORCH_CUDA_ALLOC_CONF  CUDA allocator settings (default expandable_segments:True, which long sequences need,
#                   unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set; `lctrain` itself does the same)
# Node ranks come from the rendezvous; the ranks of one node are consecutive, so Ulysses groups (adjacent ranks)
# stay inside a node when parallel.ulysses divides NPROC_PER_NODE (lctrain refuses other meshes).
set -euo pipefail

if [[ -z "${PYTORCH_CUDA_ALLOC_CONF+set}" && -z "${PYTORCH_ALLOC_CONF+set}" ]]; then
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
fi
nproc="${NPROC_PER_NODE:-auto}"
nnodes="${NNODES:-1}"
launcher=(torchrun --nproc-per-node "$nproc")
if [[ "$nnodes" == 1 ]]; then
    launcher+=(--standalone)
else
    : "${MASTER_ADDR:?NNODES=$nnodes needs MASTER_ADDR, the rendezvous host (one node of the job)}"
    port="${MASTER_PORT:-29500}"
    launcher+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$port")
    launcher+=(--rdzv-id "${RDZV_ID:-lctrain-$MASTER_ADDR-$port}")
fi
exec "${launcher[@]}" -m lctrain train "$@"
