#!/usr/bin/env bash
# Run the test suite (installs dependencies into ./.venv first if needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
exec "$PYTHON" -m pytest -q "$@" tests
