"""Run control: pre-emption signals (SIGTERM / SIGUSR1 ask every rank to finish its step, save
and exit 0), the check that step + save fit in the pre-emption warning, and fault injection for
the restart tests. Process-wide state with no checkpoint types: stopping.py reads the signal, the
trainer the rest. torchtitan_amp/launch.py keeps torchrun from killing the ranks meanwhile. The
collective timeouts that end a job whose rank died live with the process groups
(distributed.set_timeouts)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from torchtitan_amp.config import JobConfig

_stop_signal: str | None = None


def _on_signal(signum: int, frame: Any) -> None:
    global _stop_signal
    if _stop_signal is not None:
        # A second signal: stop now (a half-written save stays a .tmp and is never loaded).
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _stop_signal = signal.Signals(signum).name
    # Not logging here: the logging module's locks are not signal-safe.
    sys.stderr.write(f"received {_stop_signal}: will save a checkpoint after this step and exit\n")


def install_preemption_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
    """Call from the main thread of the entry point (torchtitan_amp/main.py)."""
    for sig in signals:
        signal.signal(sig, _on_signal)


def stop_requested() -> str | None:
    """The name of the signal that asked this process to stop, if any."""
    return _stop_signal


# The pre-emption deadline


class DeadlineCheck:
    """Whether a step plus a save fit in the pre-emption warning (`checkpoint.preemption_warning_s`):
    the scheduler kills the job that many seconds after its signal, and the trainer can only start
    the save once the step in progress has finished. Says so once per kind of evidence (the
    start-up estimate, then measured times), since a job that does not fit loses exactly the
    checkpoint pre-emption exists to write."""

    def __init__(self, warning_s: int) -> None:
        self.warning_s = warning_s
        self._said: set[str] = set()

    def problem(self, step_s: float, save_s: float, basis: str) -> str | None:
        """The warning to log when step_s + save_s exceed the pre-emption warning (first time for this
        basis), else None.

        Args:
            step_s: seconds one training step takes.
            save_s: seconds one full save takes.
            basis: where the numbers come from, leading the warning ("start-up estimate:", "measured",
                ...); each basis warns once.
        """
        if self.warning_s <= 0 or step_s + save_s <= self.warning_s or basis in self._said:
            return None
        self._said.add(basis)
        return (
            f"pre-emption: {basis} step {step_s:.1f} s + save {save_s:.1f} s exceed "
            f"checkpoint.preemption_warning_s = {self.warning_s} s, so a pre-emption would kill the "
            f"save half way; ask the scheduler for a longer warning (SLURM: #SBATCH "
            f"--signal=B:USR1@N) or write less per rank (more ranks); checkpoint.async_mode "
            f"does not shorten it (docs/checkpointing.md, Pre-emption)"
        )


# Fault injection (testing only)


def maybe_inject_fault(config: JobConfig, step: int, rank: int) -> None:
    """`debug.fault_inject_at_step`: kill one rank hard after step N, once per dump folder.

    The marker file makes it fire once, so a job restarted by `torchrun --max-restarts` (or a
    requeued one) runs through; delete the marker to fire it again.

    Args:
        config: the job config (debug.fault_inject_at_step, fault_inject_rank, job.dump_folder).
        step: the step just finished.
        rank: this process's global rank.
    """
    d = config.debug
    if not d.fault_inject_at_step or step != d.fault_inject_at_step or rank != d.fault_inject_rank:
        return
    marker = Path(config.job.dump_folder) / f".fault_injected_at_step_{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(marker, "w") as fh:
        fh.write(f"rank {rank} killed at step {step}\n")
        fh.flush()
        os.fsync(fh.fileno())
    sys.stderr.write(f"fault injection: rank {rank} exits hard after step {step}\n")
    sys.stderr.flush()
    os._exit(1)
