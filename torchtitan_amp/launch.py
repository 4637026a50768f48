"""`python -m torchtitan_amp.launch [torchrun options] train.py ...` (also `torchtitan-amp-launch`):
torchrun, except that a stop signal is the training ranks' to act on and nobody's clock but the
sender's limits the time they take.

Why: torchrun's agent turns SIGTERM / SIGINT / SIGHUP / SIGQUIT into a shutdown: it forwards the
signal to its ranks, SIGKILLs those still alive `--shutdown-timeout` seconds later (30 by default)
and exits non-zero whatever they did. A rank that was asked to finish its step and save a
checkpoint loses that checkpoint whenever step + save take longer than the agent's grace.

What this does instead: torchrun runs in a session of its own, so a terminal's Ctrl-C reaches
only this process, not the agent or the ranks. On SIGTERM, SIGINT, SIGHUP or SIGUSR1 it sends
SIGTERM to the agent's worker processes (the ranks), never to the agent. Each rank finishes its
step, saves and exits 0 (torchtitan_amp/checkpoint/preemption.py); the agent sees its workers succeed and
exits 0; this process exits with the agent's code. A second signal is forwarded too, which ends
the ranks at once (their second-signal behaviour). If no rank is running yet (rendezvous, start
up), there is nothing to save: the agent gets the signal and shuts down as torchrun does.

The deadline is therefore whoever sent the signal: SLURM's `--signal=...@N` warning, `docker
stop -t N`, or none for Ctrl-C. See docs/checkpointing.md (Pre-emption).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# Every torchrun worker carries it; other children of the agent (none today) are left alone.
_WORKER_MARK = b"TORCHELASTIC_RUN_ID="

USAGE = """usage: python -m torchtitan_amp.launch [torchrun options] SCRIPT [script args]

Runs `python -m torch.distributed.run` with the same arguments. On SIGTERM, SIGINT (Ctrl-C),
SIGHUP or SIGUSR1 it sends SIGTERM to the training ranks only and waits for them: they finish the
step, save a checkpoint (checkpoint.enable) and exit 0, and so does this launcher. A second signal
stops the ranks at once. torchrun's own options: python -m torch.distributed.run --help"""


def worker_pids(agent_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The agent's torchrun worker processes: its children whose environment marks them as workers."""
    pids = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces and parentheses; the ppid follows the last ')'.
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            if _WORKER_MARK in (stat.parent / "environ").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked, or not ours to read
    return sorted(pids)


class Forwarder:
    """The signal handler: passes a stop request on to the ranks of one torchrun agent."""

    def __init__(self, agent: subprocess.Popen) -> None:
        self.agent = agent
        self.received = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        ranks = worker_pids(self.agent.pid)
        if not ranks:
            _say(f"launch: {name} before any rank runs: stopping torchrun")
            _kill(self.agent.pid, signal.SIGTERM)
            return
        what = ("finish the step, save and exit" if self.received == 1 else "stop now (second signal)")
        _say(f"launch: {name}: asking {len(ranks)} rank(s) to {what} (SIGTERM to pids "
             f"{' '.join(map(str, ranks))}); torchrun's agent is left to wait for them")
        for pid in ranks:
            _kill(pid, signal.SIGTERM)


def _say(line: str) -> None:
    # Not logging: its locks are not signal-safe. A closed terminal (SIGHUP) must not turn the
    # handler into an exception that leaves torchrun running without its launcher.
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone: nothing left to stop


def exit_code(returncode: int) -> int:
    """A shell's exit code for the agent's: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    if not argv:
        print("error: no arguments: give torchrun's options and the script to run; --help for more",
              file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv], start_new_session=True)
    forward = Forwarder(agent)
    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    # Popen.wait resumes after each handler (PEP 475), so this returns only when the agent has exited.
    return exit_code(agent.wait())


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
