"""What the tools (and benchmarks/) share: relaunching a module under torchrun on this machine's
CPUs, and a one-line description of the machine for their reports."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import torchtitan_amp

# The folder torchtitan_amp is imported from (the checkout's root, or site-packages when
# installed): children import the package from the same place as their parent.
SOURCE_ROOT = Path(torchtitan_amp.__file__).resolve().parents[1]

_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GROUP_RANK",
    "ROLE_RANK",
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a fresh launch: the package importable as here, and none of
    an enclosing torchrun's rendezvous variables (a launch inside a launch must not join it)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(SOURCE_ROOT), env.get("PYTHONPATH"))))
    env.update(extra or {})
    return env


def module_cmd(module: str, nproc: int, args: list[str]) -> list[str]:
    """`python -m MODULE ARGS`, under torchrun with nproc CPU ranks when nproc > 1.

    Args:
        module: the module run with python -m.
        nproc: the CPU ranks; 1 runs the module in one plain process.
        args: the module's arguments.
    """
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


def torchrun(
    module: str, nproc: int, args: list[str], log: Path, timeout: float = 3600, env: dict[str, str] | None = None
) -> int:
    """Run `python -m MODULE ARGS` under torchrun with nproc CPU ranks; output to `log`. Past
    `timeout` seconds torchrun and its workers are killed (the log says so) and the exit code is -9.

    Args:
        module: the module run with python -m.
        nproc: the CPU ranks (module_cmd).
        args: the module's arguments.
        log: the file that receives stdout and stderr.
        timeout: seconds before the launch is killed.
        env: variables added to child_env's environment; None: none.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]
    with open(log, "w") as fh:
        # This process's folder: `python -m benchmarks.X` finds `benchmarks` there, as its parent did.
        proc = subprocess.Popen(cmd, env=child_env(env), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            fh.write(f"\n[{module}] launch killed after its timeout of {timeout:.0f} s\n")
            return -9


# What a tool reading a checkpoint's weights loads, on any layout: the model and the step it was
# saved at. The optimizer, schedule, data position and RNG are training state, and the data
# position cannot be resharded.
WEIGHTS_ONLY = ("model", "train_state")


def weights_only_overrides(config_argv: list[str], scratch: str) -> list[str]:
    """The user's command line plus what reading a checkpoint's weights means: checkpoint loading
    on with only WEIGHTS_ONLY restored (from checkpoint.folder, or checkpoint.initial_load_path
    alone when given), and run files (logs, precision report) in a scratch folder so that the
    run's own files stay untouched."""
    from torchtitan_amp.checkpoint.parts import PARTS
    from torchtitan_amp.config import load_config

    user = load_config(config_argv)
    folder = Path(user.job.dump_folder) / user.checkpoint.folder  # absolute folders stay as they are
    if user.checkpoint.initial_load_path:  # weights named directly: no run folder to look in
        folder = Path(scratch) / "checkpoint"
    skip = [p.name for p in PARTS if p.name not in WEIGHTS_ONLY]
    return [
        *config_argv,
        "--checkpoint.enable",
        "true",
        "--checkpoint.folder",
        str(folder.resolve()),
        "--checkpoint.exclude_from_loading",
        ",".join(skip),
        "--job.dump_folder",
        scratch,
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.enable_wandb",
        "false",
    ]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def machine() -> str:
    """CPU model, core count, bf16-relevant ISA flags, torch and Python versions."""
    # torch's version from its metadata: a driver that only launches ranks need not import torch.
    from torchtitan_amp.core.environment import _torch_version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [f for f in ("avx512_bf16", "amx_bf16", "avx512f") if f" {f}" in flags]
    return (
        f"{cpu} ({os.cpu_count()} cores; {', '.join(isa) or 'no avx512'}), torch {_torch_version()}, "
        f"Python {platform.python_version()}"
    )
