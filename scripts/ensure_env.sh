#!/usr/bin/env bash
# Source me: makes sure a Python with torchtitan_amp's dependencies is on PATH.
# Reuses the active environment when it already has them; otherwise creates ./.venv once
# (torch==2.13.0 unless a torch is already importable, so a CUDA user keeps theirs).
# Sets PYTHON to the interpreter to use.

_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_DEPS_CHECK='import torch, torchdata, tensorboard, pytest; import sys; sys.version_info >= (3, 11) or __import__("tomli")'

_find_python() {
  for p in "${PYTHON:-}" python3 python; do
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 && { echo "$p"; return 0; }
  done
  echo "error: no python3 on PATH (Python 3.10+ is required)" >&2
  return 1
}

_ensure_env() {
  local py venv="$_ROOT/.venv"
  py="$(_find_python)" || return 1
  if "$py" -c "$_DEPS_CHECK" >/dev/null 2>&1; then
    PYTHON="$py"; return 0
  fi
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$_DEPS_CHECK" >/dev/null 2>&1; then
    PYTHON="$venv/bin/python"; return 0
  fi
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "error: $("$py" --version 2>&1) is too old; Python 3.10+ is required" >&2; return 1; }
  echo "setting up $venv (one time) ..." >&2
  # --system-site-packages lets a torch that is already installed (e.g. a CUDA build) be reused.
  "$py" -m venv --system-site-packages "$venv" || return 1
  local torch_req="torch==2.13.0"
  "$venv/bin/python" -c "import torch" >/dev/null 2>&1 && torch_req=""
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$_ROOT/requirements.txt" $torch_req || return 1
  PYTHON="$venv/bin/python"
}

_ensure_env || { echo "error: could not set up the Python environment" >&2; return 1 2>/dev/null || exit 1; }
export PYTHON
