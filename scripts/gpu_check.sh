#!/usr/bin/env bash
# The CUDA checks, as one run on a GPU machine: CUDA tests, the single-device ring compute benchmark, and a short
# training run on one GPU (bf16) whose metrics give tokens/s, MFU and peak memory.
#   bash scripts/gpu_check.sh [OUTPUT_DIR]
# Uses the machine's python3 and its torch; lctrain is imported from this checkout. Python packages the machine
# lacks can be put in .whl/ (see docs/testing.md); they are installed into /tmp/site first.
set -uo pipefail
out=${1:-.}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
python3 benchmarks/bench_ring_compute.py 2>&1 | tee "$out/gpu_bench.log"
# One GPU, world size 1: the model of lctrain/configs/recipe/tiny_cpu.yaml scaled up, 16K tokens per step, bf16 params.
python3 -m lctrain train train.device=cuda parallel.param_dtype=bfloat16 model.hidden_size=1024 \
  model.intermediate_size=2816 model.num_layers=8 model.num_heads=16 model.num_kv_heads=4 data.seq_len=16384 \
  train.steps=30 train.run_dir=/tmp/gpu_train checkpoint.every=0 checkpoint.export_hf=false \
  logging.progress_bar=false logging.every=5 2>&1 | grep -v Warning | tee "$out/gpu_train.log"
cp /tmp/gpu_train/metrics.jsonl "$out/gpu_train_metrics.jsonl"
