#!/usr/bin/env bash
# One-call GPU benchmark (at most 10 minutes): Llama-3-8B-shaped model on one CUDA GPU, bf16 FSDP
# policy vs bf16 autocast vs fp32, eager and compiled; tokens/s/GPU, MFU, peak memory.
#   benchmarks/gpu_mfu.sh                    # results also in ${OUT:-outputs}/gpu_mfu.json
#   benchmarks/gpu_mfu.sh --seq-len 4096     # extra arguments go to benchmarks/gpu_mfu.py
#   benchmarks/gpu_mfu.sh --tiny --device cpu   # CPU smoke run (scripts/gpu_run.sh's GPU_RUN_CPU_SMOKE=1)
# GPU_MFU_TIMEOUT (default 590 s) bounds the whole run; the script's own --time-budget (500 s)
# skips configurations that would not finish, so the table is printed before the timeout; the
# JSON is written whole after each configuration, so a kill keeps the ones done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-outputs}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
exec timeout --signal=INT --kill-after=20 "${GPU_MFU_TIMEOUT:-590}" \
  "$PYTHON" -m benchmarks.gpu_mfu --json "$OUT_DIR/gpu_mfu.json" "$@"
