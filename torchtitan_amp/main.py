"""The training entry point behind `train.py`, the `torchtitan-amp-train` command and
`python -m torchtitan_amp`: `torchrun ... train.py --job.config_file FILE [--section.key VALUE ...]`.

Exit codes (torchtitan_amp/core/errors.py): 0 done (or --help), 2 bad config, data, checkpoint or
environment (one `error: ...` line on stderr, raised before any process group or model exists
where the check needs none), 1 a diverged run (non-finite loss), anything else is a crash with
its traceback.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from torchtitan_amp.config import JobConfig


def setup_logging(stream: TextIO | None = None) -> None:
    """Log lines to `stream` (default stdout; tools/generate.py keeps stdout for the text)."""
    rank = os.environ.get("RANK")
    tag = f"[rank{rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {tag}%(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=stream or sys.stdout,
        force=True,
    )


def fail(error: Exception, code: int = 2) -> int:
    # One line whatever the message holds, so launchers and logs show it whole.
    print("error: " + " ".join(str(error).splitlines()), file=sys.stderr)
    return code


def _parse(argv: list[str]) -> JobConfig | int:
    """The resolved config, or an exit code: 0 after --help, 2 after a one-line error (a bad
    config, or a package a feature it turns on needs is missing). Imports no torch, so a mistyped
    override fails in a fraction of a second."""
    from torchtitan_amp.config import ConfigError, help_text, load_config
    from torchtitan_amp.core.environment import torchft_missing, wandb_missing

    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        config = load_config(argv)
    except ConfigError as e:
        return fail(e)
    # Here as well as in job.resolve: check_config (run before torchrun starts) catches it too.
    missing = wandb_missing() if config.metrics.enable_wandb else None
    # A dry run sizes one rank of one group on a fake backend: it needs no torchft.
    missing = missing or (torchft_missing() if config.fault_tolerance.enable and not config.job.dry_run else None)
    return fail(ConfigError(missing)) if missing else config


def check_config(argv: list[str]) -> int:
    """What run_llama_train.sh calls first: the config alone, without torch (a mistyped override
    fails in a fraction of a second; --help prints the fields). The checks that need the world
    size follow in torchtitan_amp.launch's pre-flight, before torchrun starts (train/preflight.py)."""
    parsed = _parse(argv)
    return parsed if isinstance(parsed, int) else 0


def main(argv: list[str]) -> int:
    config = _parse(argv)
    if isinstance(config, int):
        return config
    from torchtitan_amp.core.environment import require, separate_inductor_cache
    from torchtitan_amp.core.errors import NonFiniteError, ReplicaGroupGaveUp, UserError

    require()  # an old torch or a missing torchdata: one line with the install command, exit 2
    separate_inductor_cache()
    setup_logging()
    if config.job.dry_run or os.environ.get("COMM_MODE") == "fake_backend":
        # Plan without hardware: one process, fake process group, meta model, no training.
        from torchtitan_amp.train import dry_run

        try:
            return dry_run.main(config)
        except ValueError as e:  # UserError, or a shape no layout accepts
            return fail(e)
    from torchtitan_amp.checkpoint.preemption import install_preemption_handlers
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train.trainer import Trainer

    # SIGTERM / SIGUSR1 (what SLURM sends before a kill): finish the step, save, exit 0.
    install_preemption_handlers()
    try:
        trainer = Trainer(config)
        if config.mixed_precision.audit:
            return 0 if trainer.audit().ok else 1
        trainer.train()
    except (UserError, NonFiniteError, ReplicaGroupGaveUp) as e:  # exit codes: torchtitan_amp/core/errors.py
        return fail(e, e.exit_code)
    finally:
        process_groups.shutdown()
    return 0


def exit_process(code: int) -> None:
    """Leave without interpreter finalization, once logs and streams are flushed. Everything is
    closed by now (process group destroyed, metrics and checkpoints flushed), and gloo's worker
    threads can still abort a finishing process there ("terminate called without an active
    exception", seen ~1 in 40 launches here; the failure mode of pytorch/pytorch#179291), turning
    a finished run into exit code -6."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cli() -> None:
    """Console entry point: run main, then exit_process."""
    exit_process(main(sys.argv[1:]))
