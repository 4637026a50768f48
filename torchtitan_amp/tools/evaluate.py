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
precision path (and "samples", the continuations of validation.sample_prompts, when set). Exit 0
on success, 2 on bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchtitan_amp.core.environment import require, separate_inductor_cache
from torchtitan_amp.tools.common import weights_only_overrides


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Other arguments: train.py's.")
    p.add_argument("--output", required=True, metavar="FILE", help="where rank 0 writes the JSON result")
    return p.parse_known_args(argv)


def _overrides(config_argv: list[str], scratch: str) -> list[str]:
    """The user's command line plus what evaluating means: the checkpoint's weights only
    (common.weights_only_overrides) and validation on."""
    return [*weights_only_overrides(config_argv, scratch), "--validation.enable", "true"]


def evaluate(config_argv: list[str]) -> dict[str, Any]:
    """The evaluation of the checkpoint `config_argv` points at (every rank must call it)."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.core.errors import CheckpointError
    from torchtitan_amp.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="torchtitan_amp_eval_") as scratch:
        trainer = Trainer(load_config(_overrides(config_argv, scratch)))
        try:
            loaded = trainer.run.checkpointer.loaded_path
            if loaded is None:
                raise CheckpointError(
                    f"no checkpoint to evaluate in {trainer.run.checkpointer.folder} (set checkpoint.folder and "
                    "checkpoint.load_step, or checkpoint.initial_load_path)"
                )
            result = trainer.evaluate()
            validator = trainer.run.validator  # not None: evaluate() raised otherwise
            samples = {"samples": validator.samples} if validator is not None and validator.samples else {}
            return {
                **result,
                "step": trainer.step,
                "checkpoint": str(loaded),
                "world_size": trainer.run.info.world_size,
                "precision_path": trainer.run.plan.path,
                **samples,
            }
        finally:
            trainer.run.metrics.close()


def main(argv: list[str]) -> int:
    args, config_argv = parse_args(argv)
    require()
    separate_inductor_cache()
    from torchtitan_amp.core.errors import UserError
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.main import fail, setup_logging

    setup_logging()
    try:
        result = evaluate(config_argv)
    except UserError as e:
        return fail(e, e.exit_code)
    finally:
        process_groups.shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result))
    return 0


def cli() -> None:
    from torchtitan_amp.main import exit_process

    exit_process(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
