#!/usr/bin/env bash
# The CUDA checks, as one run on a GPU machine: CUDA tests, then the single-device ring compute benchmark.
#   bash scripts/gpu_check.sh [OUTPUT_DIR]
# Uses the machine's python3 and its torch; lctrain is imported from this checkout.
set -uo pipefail
out=${1:-.}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
python3 scripts/bench_ring_compute.py 2>&1 | tee "$out/gpu_bench.log"
