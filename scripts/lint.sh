#!/usr/bin/env bash
# The toolchain: ruff (format check, lint, import order; 120 columns) and mypy on the package, as
# configured in pyproject.toml. Exits non-zero on any finding. Installs the pinned tools from
# requirements-dev.txt into the Python scripts/ensure_env.sh finds or makes.
# `scripts/lint.sh --fix` rewrites what ruff can (format, import order, safe fixes) first.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ensure_env.sh
"$PYTHON" -c 'import ruff, mypy' 2>/dev/null || "$PYTHON" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
if [ "${1:-}" = "--fix" ]; then
  "$PYTHON" -m ruff format .
  "$PYTHON" -m ruff check --fix .
fi
"$PYTHON" -m ruff format --check .
"$PYTHON" -m ruff check .
"$PYTHON" -m mypy
