#!/usr/bin/env bash
# The GPU checks: needs one GPU and ends within GPU_CHECK_SECONDS (default 540 s). Every step has a timeout and
# writes into OUT; see docs/testing.md.
#
#   bash scripts/gpu_check.sh OUT                       # tests, speed, planner, context, preference, moe in order
#   bash scripts/gpu_check.sh OUT context               # named steps only
#
# Each step gets the smaller of its own timeout and what is left of GPU_CHECK_SECONDS; a step with under 30 s left
# is skipped (status.txt says so).
#
# Steps: tests (pytest tests/gpu), speed (python3 -m benchmarks.bench_trainer --device cuda), planner
# (python3 -m benchmarks.validate_planner --device cuda), context (python3 -m benchmarks.bench_context --device
# cuda), preference (python3 -m benchmarks.bench_preference --device cuda: a DPO step with the prompt shared against
# repeated, 16:1 at a 16K prompt), moe (python3 -m benchmarks.bench_experts --part single --device cuda: the experts'
# kernels); on request also offload (bench_trainer: the cost of parallel.cpu_offload and parallel.activation_offload
# at 64K) and ring (python3 -m benchmarks.bench_ring_compute).
# Uses the machine's python3 and its torch; lctrain is imported from this checkout. Python packages the machine lacks
# are carried as wheels in .whl/ (docs/testing.md) and installed into /tmp/site first. OUT/status.txt lists each
# step's exit status (124: its timeout).
set -uo pipefail
out=${1:?usage: bash scripts/gpu_check.sh OUT [tests] [speed] [planner] [context] [preference] [moe] [offload] [ring]}
shift
steps=("$@")
if [[ ${#steps[@]} -eq 0 ]]; then
  steps=(tests speed planner context preference moe)
fi
budget=${GPU_CHECK_SECONDS:-540}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2> /dev/null || echo "commit: unknown (no .git)"
} 2>&1 | tee "$out/machine.txt"

# step NAME SECONDS COMMAND...: run with a timeout of SECONDS or what is left of the budget (then SIGKILL 10 s
# later), stdout to OUT/NAME.md, stderr to OUT/NAME.log, exit status to OUT/status.txt
step() {
  local name=$1 seconds=$2
  shift 2
  local left=$((budget - SECONDS - 10))
  if ((left < 30)); then
    echo "== $name: skipped, ${left} s of GPU_CHECK_SECONDS=$budget left" | tee -a "$out/status.txt"
    return
  fi
  seconds=$((seconds < left ? seconds : left))
  echo "== $name (timeout ${seconds} s): $*" | tee -a "$out/status.txt"
  local start=$SECONDS
  timeout -k 10 "$seconds" "$@" > "$out/$name.md" 2> "$out/$name.log"
  local status=$?
  echo "== $name: exit $status after $((SECONDS - start)) s" | tee -a "$out/status.txt"
  tail -n 40 "$out/$name.md"
}

for name in "${steps[@]}"; do
  case $name in
    tests) step tests 240 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider ;;
    speed) step speed 270 python3 -m benchmarks.bench_trainer --device cuda --json "$out/speed.json" ;;
    planner) step planner 180 python3 -m benchmarks.validate_planner --device cuda --save "$out/planner.json" ;;
    context) step context 560 python3 -m benchmarks.bench_context --device cuda --json "$out/context.json" ;;
    preference) step preference 240 python3 -m benchmarks.bench_preference --device cuda \
      --json "$out/preference.json" ;;
    moe) step moe 120 python3 -m benchmarks.bench_experts --part single --device cuda --json "$out/moe.json" ;;
    offload) step offload 300 python3 -m benchmarks.bench_trainer --device cuda --sides lctrain --seq 65536 \
      --checkpointing full --cpu-offload --activation-offload --no-allocator-compare --json "$out/offload.json" ;;
    ring) step ring 240 python3 -m benchmarks.bench_ring_compute ;;
    *) echo "unknown step $name: choose from tests speed planner context preference moe offload ring" >&2; exit 2 ;;
  esac
done
