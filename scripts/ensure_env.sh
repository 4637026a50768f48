#!/usr/bin/env bash
# Source me: makes sure a Python with torchtitan_amp's dependencies is available and sets PYTHON.
#
# 1. The interpreter in $PYTHON (else python3, else python) is used as is when it already has
#    torch >= 2.11 (the oldest supported) and everything in requirements.txt.
# 2. Otherwise ./.venv is used when it has them (created by an earlier run).
# 3. Otherwise ./.venv is created once and filled with `pip install torch==2.13.0` plus
#    requirements.txt. When the interpreter already has a torch >= 2.11 (e.g. a CUDA build), the
#    venv sees it (--system-site-packages) instead of downloading another; a venv made from an
#    interpreter without a usable torch is isolated, so an old system torch can never leak in.
#
# TORCH_VERSION=2.11.0 (say) asks for exactly that torch instead: ./.venv-torch2.11.0, isolated,
# filled with torch==2.11.0 and requirements.txt (PyPI's build: a CUDA one on Linux x86_64, about
# 5 GB, which runs on the CPU too). The test tier on the oldest supported torch uses it.

_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${TORCH_VERSION:-}" ]; then
  _TORCH_NEW='import torch, sys; new = torch.__version__.split("+")[0] == "'"$TORCH_VERSION"'"'
else
  _TORCH_NEW='import torch, sys; new = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)'
fi
_TORCH_OK="$_TORCH_NEW"'; sys.exit(not new)'
# One exit at the end: an earlier sys.exit(0) would skip the imports after it.
_DEPS_CHECK="$_TORCH_NEW"'
import torchdata, tensorboard, pytest, hypothesis, numpy, tokenizers, tiktoken, pyarrow, zstandard, tqdm, importlib.util
sys.version_info >= (3, 11) or __import__("tomli")
sys.exit(not new or any(importlib.util.find_spec(m) is None for m in ("torchao", "safetensors", "transformers", "peft", "jinja2", "datasets", "matplotlib", "wandb", "torchft")))'

_find_python() {
  if [ -n "${PYTHON:-}" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 && { echo "$PYTHON"; return 0; }
    echo "error: PYTHON=$PYTHON is not an executable" >&2
    return 1
  fi
  for p in python3 python; do
    command -v "$p" >/dev/null 2>&1 && { echo "$p"; return 0; }
  done
  echo "error: no python3 on PATH (Python 3.10+ is required)" >&2
  return 1
}

_ensure_env() {
  local py venv="$_ROOT/.venv" system_site=() torch_pin="torch==2.13.0"
  if [ -n "${TORCH_VERSION:-}" ]; then
    venv="$_ROOT/.venv-torch$TORCH_VERSION" torch_pin="torch==$TORCH_VERSION"
  fi
  py="$(_find_python)" || return 1
  if "$py" -c "$_DEPS_CHECK" >/dev/null 2>&1; then
    PYTHON="$py"; return 0
  fi
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$_DEPS_CHECK" >/dev/null 2>&1; then
    PYTHON="$venv/bin/python"; return 0
  fi
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
    echo "error: $("$py" --version 2>&1) is too old; Python 3.10+ is required" >&2; return 1; }
  if [ -z "${TORCH_VERSION:-}" ] && "$py" -c "$_TORCH_OK" >/dev/null 2>&1; then
    system_site=(--system-site-packages)
    echo "setting up $venv (one time), reusing the torch of $py ..." >&2
  else
    echo "setting up $venv (one time): $torch_pin and requirements.txt ..." >&2
  fi
  # An existing .venv without the dependencies (e.g. an interrupted install) is completed, not replaced.
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv ${system_site[@]+"${system_site[@]}"} "$venv" || return 1
  fi
  local torch_req="$torch_pin"
  "$venv/bin/python" -c "$_TORCH_OK" >/dev/null 2>&1 && torch_req=""
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r "$_ROOT/requirements.txt" $torch_req || return 1
  "$venv/bin/python" -c "$_DEPS_CHECK" || {
    echo "error: $venv was set up but still lacks a dependency" >&2; return 1; }
  PYTHON="$venv/bin/python"
}

_ensure_env || { echo "error: could not set up the Python environment" >&2; return 1 2>/dev/null || exit 1; }
export PYTHON
