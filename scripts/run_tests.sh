#!/usr/bin/env bash
# Run the test suite (installs dependencies into ./.venv first if needed).
# Extra args go to pytest: options (-x, -k expr) apply to the whole suite; paths (tests/test_x.py,
# tests/test_x.py::test_y) replace it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
for arg in "$@"; do
  case "$arg" in
    -*) ;;
    *) if [ -e "${arg%%::*}" ]; then exec "$PYTHON" -m pytest -q --durations=15 "$@"; fi ;;
  esac
done
exec "$PYTHON" -m pytest -q --durations=15 "$@" tests
