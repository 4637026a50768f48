#!/usr/bin/env bash
# Everything a lent GPU machine should run, as one device call of about 5 minutes (300 s of
# commands; the machine's start and the transfers come on top, out of the same 15 minutes):
#   1. the GPU checks: `pytest -m gpu tests/gpu` (GPU_CHECKS_TIMEOUT, 220 s; their budget,
#      GPU_CHECKS_BUDGET, 200 s, which the default selection's caps fit), in this order: kernel
#      probes (SDPA op, cuDNN, torchao extensions, fp8 rowwise), the FSDP all-reduce-hook hazard,
#      autocast dtypes, CP chunk attention, block-scaled kernels, host syncs (plain, block-scaled,
#      EP), KV-cache generation, resume bit for bit, MoE, two torchft replica groups, fp8 curve +
#      audit, loss curves (compiled bf16 last: the dearest); tests/gpu/settings.py has the knobs
#   2. benchmarks/gpu_mfu.sh (GPU_MFU_TIMEOUT, 80 s)  8B-shaped model: tokens/s/GPU, MFU, peak memory;
#      GPU_RUN_MFU=0 skips it (a rerun of the checks alone)
# Results: $OUT/gpu_checks.json (rewritten as each check starts and ends: status, seconds and the
# numbers each check recorded), $OUT/gpu_checks.xml (pytest's junit XML, the numbers as the
# property "recorded"), $OUT/gpu_mfu.json, $OUT/gpu_run.log. Extra arguments go to pytest (e.g.
# -k "resume or curves"; or -k fp8_speed with GPU_CHECKS_SPEED=1, GPU_RUN_MFU=0 and
# GPU_CHECKS_TIMEOUT=300).
#
# The machine has its own torch and pytest and lacks packages (torchdata, torchao): carry their
# wheels in .whl/ (git-ignored: the call must name it, carry [".whl"]; docs/performance.md, "GPU
# checks", says which wheels). Each carried wheel whose package this Python cannot import is
# installed into $GPU_RUN_SITE (/tmp/site); a package of GPU_RUN_NEEDS (torchdata: every training
# check needs it; pytest runs them) that is still missing stops the run in one line, before any
# device time is spent on it. torchao and torchft are optional: without torchao fp8, fp8_speed and
# block_scaled_kernels are skipped, without torchft fault_tolerance, and the other checks run.
#
# GPU_RUN_CPU_SMOKE=1 runs the same script on CPU: tiny shapes, small limits, the MFU benchmark's
# tiny shape only; everything but CUDA (wheels, limits, the JSON after each check) is exercised.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export OUT=${OUT:-outputs} PYTHONUNBUFFERED=1
WHEELS=${GPU_RUN_WHEELS:-.whl}
SITE=${GPU_RUN_SITE:-/tmp/site}
NEEDS=${GPU_RUN_NEEDS:-torchdata pytest}
MFU=${GPU_RUN_MFU:-1}
SMOKE=${GPU_RUN_CPU_SMOKE:-0}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_run.log") 2>&1

missing() {  # is module $1 not importable? (find_spec: no import, so no torch start-up per package)
  ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)' "$1" 2>/dev/null
}
wheel_module() {  # torchdata-0.11.0-py3-none-any.whl -> torchdata (the distribution name, as a module)
  basename "$1" | cut -d- -f1 | tr 'A-Z.' 'a-z_'
}
install_carried_wheels() {
  local whl wanted=()
  for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] || continue
    if missing "$(wheel_module "$whl")"; then wanted+=("$whl"); fi
  done
  [ ${#wanted[@]} -eq 0 ] && return 0
  echo "installing carried wheels into $SITE: ${wanted[*]##*/}"
  # Without pip, unpacking does the same for these wheels (no scripts, no .data folders).
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wanted[@]}" \
    || "$PYTHON" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
         "$SITE" "${wanted[@]}" \
    || { echo "error: could not install ${wanted[*]##*/} into $SITE"; exit 2; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
}
require_needed() {
  local module absent=()
  for module in $NEEDS; do
    if missing "$module"; then absent+=("$module"); fi
  done
  if [ ${#absent[@]} -gt 0 ]; then
    echo "error: ${absent[*]} missing and no wheel for it carried in $WHEELS/ (docs/performance.md, \"GPU checks\", says how)"
    exit 2
  fi
}
# A check whose process was killed mid-way (SIGKILL after the timeout's grace) is left "running".
mark_killed() {
  [ -f "$OUT/gpu_checks.json" ] || return 0
  "$PYTHON" - "$OUT/gpu_checks.json" "$1" <<'EOF'
import json, os, sys
path, code = sys.argv[1], sys.argv[2]
data = json.load(open(path))
for result in data["checks"].values():
    if result["status"] == "running":
        result.update(status="killed", error=f"the process ended during this check (exit {code})")
open(path + ".tmp", "w").write(json.dumps(data, indent=1) + "\n")
os.replace(path + ".tmp", path)
EOF
}

install_carried_wheels
require_needed
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"

if [ "$SMOKE" = 1 ]; then
  CHECKS_TIMEOUT=${GPU_CHECKS_TIMEOUT:-240} MFU_TIMEOUT=${GPU_MFU_TIMEOUT:-120}
  export GPU_CHECKS_DEVICE=cpu GPU_CHECKS_TINY=1 GPU_CHECKS_STEPS=3
  mfu_args=(--tiny --device cpu --configs autocast --compile off --steps 1 --warmup 1)
else
  CHECKS_TIMEOUT=${GPU_CHECKS_TIMEOUT:-220} MFU_TIMEOUT=${GPU_MFU_TIMEOUT:-80}
  mfu_args=(--time-budget "${GPU_MFU_BUDGET:-$((MFU_TIMEOUT - 40))}")
fi
# The checks' own budget ends 20 s before the outer timeout: a check over its limit is stopped and
# recorded ("timeout") by tests/gpu/conftest.py itself; the outer timeout only catches a hang in C code.
export GPU_CHECKS_JSON=$OUT/gpu_checks.json GPU_CHECKS_BUDGET=$((CHECKS_TIMEOUT - 20))
timeout --kill-after=10 "$CHECKS_TIMEOUT" "$PYTHON" -m pytest -m gpu tests/gpu -v -p no:cacheprovider \
  --junitxml "$OUT/gpu_checks.xml" "$@"
checks=$?
[ $checks -gt 1 ] && mark_killed $checks
if [ "$MFU" = 0 ]; then
  mfu=0
  echo "gpu_mfu skipped (GPU_RUN_MFU=0)"
else
  GPU_MFU_TIMEOUT=$MFU_TIMEOUT PYTHON=$PYTHON bash benchmarks/gpu_mfu.sh "${mfu_args[@]}"
  mfu=$?
fi
echo "gpu_checks exit $checks, gpu_mfu exit $mfu"
exit $(( checks || mfu ))
