"""Evaluate a checkpoint's weights on the validation split, on any layout they reshard to.

    python -m torchtitan_amp.tools.evaluate --output eval.json --job.config_file CONFIG \\
        --checkpoint.folder /runs/a/checkpoint [--checkpoint.load_step N] [--validation.dataset ...]
    torchrun --nproc_per_node 4 -m torchtitan_amp.tools.evaluate --output eval.json ... \\
        --parallelism.tensor_parallel_degree 2

(or `torchtitan-amp-evaluate`). Everything after --output is train.py's command line: the job
config, the layout and precision to evaluate under, and where the checkpoint is. The run's own
[validation] settings apply (steps, batch, seq_len); validation.enable is implied. Only the model
and the step are loaded (not optimizer, schedule, data position or RNG), so a checkpoint saved on
one layout evaluates on any other. Nothing is written but the JSON: val_loss, val_ppl, val_tokens,
val_time_s (the fields training logs), the checkpoint's step and path, the world size and the
precision path. Exit 0 on success, 2 on bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchtitan_amp.environment import require, separate_inductor_cache

# Loaded on every layout: the model's weights and the step they were saved at. The optimizer,
# schedule, data position and RNG are training state, and the data position cannot be resharded.
LOADED = ("model", "train_state")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other arguments: train.py's.")
    p.add_argument("--output", required=True, metavar="FILE", help="where rank 0 writes the JSON result")
    return p.parse_known_args(argv)


def _overrides(config_argv: list[str], scratch: str) -> list[str]:
    """The user's command line plus what evaluating means: validation on, checkpoint loading on
    with only LOADED restored, and run files (logs, precision report) in a scratch folder so that
    the evaluated run's own files stay untouched."""
    from torchtitan_amp.checkpoint.manager import PARTS
    from torchtitan_amp.config import load_config

    user = load_config(config_argv)
    folder = Path(user.job.dump_folder) / user.checkpoint.folder  # absolute folders stay as they are
    if user.checkpoint.initial_load_path:  # weights named directly: no run folder to look in
        folder = Path(scratch) / "checkpoint"
    skip = [p.name for p in PARTS if p.name not in LOADED]
    return [*config_argv, "--validation.enable", "true", "--checkpoint.enable", "true",
            "--checkpoint.folder", str(folder.resolve()), "--checkpoint.exclude_from_loading", ",".join(skip),
            "--job.dump_folder", scratch, "--metrics.enable_tensorboard", "false",
            "--metrics.enable_wandb", "false"]


def evaluate(config_argv: list[str]) -> dict[str, Any]:
    """The evaluation of the checkpoint `config_argv` points at (every rank must call it)."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.errors import CheckpointError
    from torchtitan_amp.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="torchtitan_amp_eval_") as scratch:
        trainer = Trainer(load_config(_overrides(config_argv, scratch)))
        try:
            loaded = trainer.checkpointer.loaded_path
            if loaded is None:
                raise CheckpointError(
                    f"no checkpoint to evaluate in {trainer.checkpointer.folder} (set checkpoint.folder and "
                    "checkpoint.load_step, or checkpoint.initial_load_path)")
            return {**trainer.evaluate(), "step": trainer.step, "checkpoint": str(loaded),
                    "world_size": trainer.info.world_size, "precision_path": trainer.plan.path}
        finally:
            trainer.metrics.close()


def main(argv: list[str]) -> int:
    args, config_argv = parse_args(argv)
    require()
    separate_inductor_cache()
    from torchtitan_amp import distributed
    from torchtitan_amp.errors import UserError
    from torchtitan_amp.main import fail, setup_logging

    setup_logging()
    try:
        result = evaluate(config_argv)
    except UserError as e:
        return fail(e, e.exit_code)
    finally:
        distributed.shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
    return 0


def cli() -> None:
    from torchtitan_amp.main import exit_process

    exit_process(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
