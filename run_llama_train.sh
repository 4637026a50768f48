#!/usr/bin/env bash
# Train a Llama model with torchrun. Usage (torchtitan conventions):
#   NGPU=2 CONFIG_FILE=train_configs/debug_model.toml LOG_RANK=0 ./run_llama_train.sh [--section.key value ...]
# NGPU: processes on this node (default: number of GPUs, or 1 without a GPU; on CPU each
#       process is one gloo rank).
# LOG_RANK: ranks whose output is shown (e.g. 0, 0,1); "all" shows every rank and torchrun's own
#           output (otherwise in the log file that a failed run's one error line names).
# COMM_MODE=fake_backend: dry run instead of training (NGPU simulated ranks, DRY_RUN_RANK reported).
# Sets up ./.venv on first use when the current Python lacks the dependencies (scripts/ensure_env.sh).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh

CONFIG_FILE=${CONFIG_FILE:-"./train_configs/debug_model.toml"}
# Check the command line first (no torch import, a fraction of a second): a bad value is one
# "error: ..." line and exit code 2 here. What needs the number of processes (degrees, batch
# split, heads per TP rank, layers per stage) is checked by the launcher below, before torchrun.
"$PYTHON" -c 'import sys, train; sys.exit(train.check_config(sys.argv[1:]))' \
  --job.config_file "$CONFIG_FILE" "$@" || exit $?
for arg in "$@"; do
  case "$arg" in -h|--help) exit 0 ;; esac
done

# COMM_MODE=fake_backend: plan without the hardware. One process, no torchrun: it simulates NGPU
# ranks (unset: the product of the configured degrees) with a fake process group and reports rank
# DRY_RUN_RANK's (default 0) memory and traffic per step (see torchtitan_amp/train/dry_run.py).
if [ "${COMM_MODE:-}" = "fake_backend" ]; then
  exec "$PYTHON" train.py --job.config_file "$CONFIG_FILE" --job.dry_run \
    --dry_run.world_size "${NGPU:--1}" --dry_run.rank "${DRY_RUN_RANK:-0}" "$@"
fi

if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
LOG_RANK=${LOG_RANK:-0}
shown=(--local-ranks-filter "$LOG_RANK")
verbose=()
if [ "$LOG_RANK" = "all" ]; then shown=(); verbose=(--verbose); fi

# torchtitan_amp.launch runs torchrun, with three differences: it checks the config for NGPU ranks
# before starting any process (a config error is one line, exit code 2); a failed run is one error
# line from the rank that failed first, torchrun's report going to the log file the line names;
# and it hands Ctrl-C, `kill` or a container stop (SIGINT, SIGTERM, SIGHUP) to the ranks and
# waits: they finish the step, save (checkpoint.enable) and exit 0, however long that takes;
# torchrun alone SIGKILLs them 30 s after forwarding the signal.
exec "$PYTHON" -m torchtitan_amp.launch ${verbose[@]+"${verbose[@]}"} \
  --standalone --nproc_per_node="$NGPU" --role rank --tee 3 ${shown[@]+"${shown[@]}"} \
  train.py --job.config_file "$CONFIG_FILE" "$@"
