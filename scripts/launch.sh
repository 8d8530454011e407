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
#                   unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set; `lctrain` itself does the same:
#                   lctrain.cli.ALLOCATOR_SETTINGS, which tests/distributed/test_launch.py keeps equal to this one)
#   RDZV_TIMEOUT    seconds the nodes have to join the rendezvous (default 600); then it fails, naming what to check
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
    exec "${launcher[@]}" --standalone -m lctrain train "$@"
fi

: "${MASTER_ADDR:?NNODES=$nnodes needs MASTER_ADDR, the rendezvous host (one node of the job)}"
port="${MASTER_PORT:-29500}"
rdzv_id="${RDZV_ID:-lctrain-$MASTER_ADDR-$port}"
rdzv_timeout="${RDZV_TIMEOUT:-600}"
launcher+=(--nnodes "$nnodes" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$port" --rdzv-id "$rdzv_id")
launcher+=(--rdzv-conf "join_timeout=$rdzv_timeout")

# torchrun runs as a child, so that a failed rendezvous can be named afterwards (torchrun itself ends with a bare
# RendezvousTimeoutError traceback, which it also writes to TORCHELASTIC_ERROR_FILE); SIGTERM and SIGINT are passed
# on to it, and its exit status is this script's.
error_file="$(mktemp "${TMPDIR:-/tmp}/lctrain-launch.XXXXXX")"
trap 'rm -f "$error_file"' EXIT
TORCHELASTIC_ERROR_FILE="$error_file" "${launcher[@]}" -m lctrain train "$@" &
torchrun_pid=$!
trap 'kill -TERM "$torchrun_pid" 2>/dev/null || true' TERM INT
while :; do
    wait "$torchrun_pid" || true  # returns early when a trapped signal arrives
    kill -0 "$torchrun_pid" 2>/dev/null || break
done
status=0
wait "$torchrun_pid" || status=$?  # bash keeps the status of a child it has reaped
error="$(grep -o '"message": "Rendezvous[A-Za-z]*' "$error_file" 2>/dev/null | cut -d'"' -f4 || true)"
if [[ "$status" != 0 && -n "$error" ]]; then
    echo "lctrain launch: the rendezvous at $MASTER_ADDR:$port (id $rdzv_id) failed ($error): every node must run" \
        "scripts/launch.sh with the same NNODES=$nnodes, MASTER_ADDR, MASTER_PORT and RDZV_ID, and reach" \
        "$MASTER_ADDR:$port, within RDZV_TIMEOUT=$rdzv_timeout s of the first" >&2
fi
exit "$status"
