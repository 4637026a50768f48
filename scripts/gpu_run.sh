#!/usr/bin/env bash
# Everything a lent GPU machine should run, as one device call of at most ~9 minutes:
#   1. torchtitan_amp/tools/gpu_checks.py   (~2-3 min)  CUDA autocast dtypes, loss curves, pinned-memory async resume
#   2. benchmarks/gpu_mfu.sh   (the rest)  8B-shaped model: tokens/s/GPU, MFU, peak memory
# Results: $OUT/gpu_checks.json, $OUT/gpu_mfu.json, $OUT/gpu_run.log.
# The machine has its own torch (2.11 when last seen) and no torchdata: carry the wheel in .whl/
# (docs/performance.md, "GPU checks", says how); it is installed into /tmp/site here.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export OUT=${OUT:-outputs} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_run.log") 2>&1
if ! "$PYTHON" -c "import torchdata" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: torchdata is missing and no wheels were carried in .whl/ (see docs/performance.md)"; exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
timeout --kill-after=10 "${GPU_CHECKS_TIMEOUT:-240}" "$PYTHON" -m torchtitan_amp.tools.gpu_checks --json "$OUT/gpu_checks.json" "$@"
checks=$?
GPU_MFU_TIMEOUT=${GPU_MFU_TIMEOUT:-300} PYTHON=$PYTHON bash benchmarks/gpu_mfu.sh --time-budget "${GPU_MFU_BUDGET:-240}"
mfu=$?
echo "gpu_checks exit $checks, gpu_mfu exit $mfu"
exit $(( checks || mfu ))
