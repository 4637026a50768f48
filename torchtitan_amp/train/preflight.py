"""The world-size checks of a training config, run once before torchrun starts any process:

    python -m torchtitan_amp.train.preflight --world-size N [train.py arguments]
    python -m torchtitan_amp.train.preflight --torchrun [torchrun options] SCRIPT [script arguments]

The second form is what torchtitan_amp.launch runs (and so run_llama_train.sh and the SLURM
script): the world size is torchrun's --nproc_per_node x --nnodes.

Why: a config that cannot run on N ranks (degrees that do not multiply to N, a global batch the
data-parallel ranks cannot split, EP or CP that does not divide, heads per TP rank, layers per
pipeline stage) fails on every rank at once. torchrun then reports the first rank's exit and
stops the others, often before they print, so the user sees torchrun's traceback and maybe no
error line at all. Here the same checks run in one process: one `error: ...` line on stderr,
exit code 2, and torchrun never starts. A config that passes prints nothing.

The checks are the ranks' own, in their order: the environment (core.environment.require), the
config, the device and backend (process_groups.resolve, for local rank 0: CUDA when a GPU is
visible, else CPU) and train.job.resolve for N ranks on that device type. No process group, no
model weights. On CUDA the precision plan reads the GPU's compute capability and runs no kernel
(the fp8 and block-scaled probes run on the ranks): this process opens no CUDA context, so it
holds no GPU memory and cannot be the first to fail on the GPU. What only a
rank can find (its data, its device's memory) is left to the ranks.

Exit codes: 0 nothing to report, or nothing to check (not this project's training script, --help,
a dry run, an elastic --nnodes range, options torchrun itself will reject); 2 one error line.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

USAGE = "usage:\n" + __doc__.split("\n\n")[1]

# What torchrun may be asked to run that is this project's training entry point: the console
# script (with --no-python) and the modules (with -m). train.py is recognised by its content.
ENTRY_SCRIPTS = frozenset({"torchtitan-amp-train"})
ENTRY_MODULES = frozenset({"torchtitan_amp", "torchtitan_amp.main"})


def check(world_size: int, argv: list[str]) -> int:
    """Run the ranks' config-time checks for `world_size` ranks on `argv` (train.py's
    arguments): 0 when they pass, 2 after one `error: ...` line on stderr."""
    if any(a in ("-h", "--help") for a in argv):
        return 0  # the ranks print the help; there is nothing to check
    from torchtitan_amp.core.environment import require

    require()  # before anything imports torch: an old torch is one line too
    from torchtitan_amp.core.errors import UserError

    try:
        _resolve(world_size, argv)
    except UserError as e:
        # UserError's message is one line already (core/errors.py).
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def _resolve(world_size: int, argv: list[str]) -> None:
    """What Trainer.__init__ checks before its process group, and main's dispatch before it."""
    from torchtitan_amp.config import load_config

    config = load_config(argv)
    if config.job.dry_run or os.environ.get("COMM_MODE") == "fake_backend":
        return  # one process sizing dry_run.world_size ranks: checked by that process itself
    from torchtitan_amp.distributed import process_groups
    from torchtitan_amp.train.job import resolve

    info = process_groups.resolve(config)
    resolve(config, world_size, info.device.type, preflight=True)


def is_training_entry(script: str, *, module: bool = False, no_python: bool = False) -> bool:
    """Whether torchrun's SCRIPT is this project's training entry point, whose arguments are a
    job config; any other script's arguments mean nothing here.

    Args:
        script: torchrun's training script argument (a path, or a module with `module`).
        module: True when torchrun runs it as a module (`-m`).
        no_python: True when torchrun runs it as an executable (`--no-python`).
    """
    if module:
        return script in ENTRY_MODULES
    if no_python:
        return Path(script).name in ENTRY_SCRIPTS
    path = Path(script)
    if path.name != "train.py" or not path.is_file():
        return False
    try:
        return "torchtitan_amp.main" in path.read_text(errors="replace")
    except OSError:
        return False


def training_job(torchrun_argv: list[str]) -> tuple[int, list[str]] | None:
    """(world size, the script's arguments) of a torchrun command line that runs the training
    entry point on a fixed number of nodes; None when there is nothing to check."""
    from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes

    # torchrun parses the same line next and reports its own usage errors: none printed here.
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args = get_args_parser().parse_args(torchrun_argv)
            min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
            nproc = determine_local_world_size(args.nproc_per_node)
    except (SystemExit, ValueError, RuntimeError):
        return None
    if min_nodes != max_nodes:
        return None  # elastic: the world size is decided at rendezvous
    if not is_training_entry(args.training_script, module=args.module, no_python=args.no_python):
        return None
    return min_nodes * nproc, list(args.training_script_args)


def main(argv: list[str]) -> int:
    """The command line: `--world-size N ARGS` or `--torchrun TORCHRUN_ARGV`."""
    if argv[:1] == ["--torchrun"]:
        job = training_job(argv[1:])
        return 0 if job is None else check(*job)
    if len(argv) >= 2 and argv[0] == "--world-size" and argv[1].isdigit() and int(argv[1]) > 0:
        return check(int(argv[1]), argv[2:])
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    print(
        "error: give --world-size N (a positive integer) or --torchrun, then the arguments; --help for more",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
