"""`python -m torchtitan_amp.launch [--verbose] [torchrun options] train.py ...` (also
`torchtitan-amp-launch`): torchrun, except that a config that cannot run on this many ranks is
one error line before any process starts, a failed job is one error line, and a stop signal is
the training ranks' to act on and nobody's clock but the sender's limits the time they take.

Before torchrun: when the script is this project's training entry point, its config is checked
for the world size --nproc_per_node x --nnodes (torchtitan_amp/train/preflight.py, in a process
of its own); a config error is its one `error: ...` line and exit code 2, and torchrun never starts.

While it runs: the ranks' output is shown as torchrun's --local-ranks-filter asks, torchrun's own
output (its banner, and after a failure its traceback and failure table) goes only to a log file,
and a failed job ends with one `error: ...` line from the rank that failed first, naming that
file (torchtitan_amp/observability/rank_output.py). --verbose shows torchrun's output too.

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
import tempfile
import threading
from pathlib import Path
from types import FrameType

from torchtitan_amp.observability.rank_output import RankOutput, default_log_path, parse_ranks, pump
from torchtitan_amp.train.preflight import ENTRY_MODULES, ENTRY_SCRIPTS

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
# Every torchrun worker carries it; other children of the agent (none today) are left alone.
_WORKER_MARK = b"TORCHELASTIC_RUN_ID="
# Seconds to wait for the agent's last output lines once it has exited.
READER_GRACE_S = 5.0

USAGE = """usage: python -m torchtitan_amp.launch [--verbose] [torchrun options] SCRIPT [script args]

Runs `python -m torch.distributed.run` with the same arguments. For train.py it first checks the
config for the world size (--nproc_per_node x --nnodes): a config error is one line, exit code 2.
The ranks' output is shown as --local-ranks-filter asks; torchrun's own output goes to a log file
(--verbose: shown too), and a failed job ends with one error line that names the file.

On SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGUSR1 it sends SIGTERM to the training ranks only and
waits for them: they finish the step, save a checkpoint (checkpoint.enable) and exit 0, and so
does this launcher. A second signal stops the ranks at once. torchrun's own options:
python -m torch.distributed.run --help"""


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
        what = "finish the step, save and exit" if self.received == 1 else "stop now (second signal)"
        _say(
            f"launch: {name}: asking {len(ranks)} rank(s) to {what} (SIGTERM to pids "
            f"{' '.join(map(str, ranks))}); torchrun's agent is left to wait for them"
        )
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


def option_value(argv: list[str], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """The value of the first of torchrun's options `names` ("--name V" or "--name=V") in argv,
    and argv without it; (None, argv) when absent."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in names:
            continue
        if eq:
            return value, argv[:i] + argv[i + 1 :]
        if i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2 :]
    return None, argv


def preflight(argv: list[str]) -> int:
    """The training config's world-size checks (torchtitan_amp/train/preflight.py) in a process of
    their own, which exits before torchrun starts: this launcher lives as long as the job and must
    hold neither torch's memory nor anything on a GPU. 0 when there is nothing to report."""
    # Only this project's training entry point has a config to check; any other script skips
    # the preflight's torch import (a second of start-up) altogether.
    if not any(Path(a).name == "train.py" or a in ENTRY_MODULES or Path(a).name in ENTRY_SCRIPTS for a in argv):
        return 0
    try:
        return subprocess.run([sys.executable, "-m", "torchtitan_amp.train.preflight", "--torchrun", *argv]).returncode
    except KeyboardInterrupt:
        return 130


def output_options(argv: list[str]) -> tuple[list[str], set[int] | None, bool]:
    """torchrun's argv as the launcher runs it, the local ranks to show, and whether to show
    every line as it comes. The launcher applies --local-ranks-filter itself, so that a failing
    rank's output reaches it even when that rank is not shown; it needs every rank's output
    tee'd with torchrun's `[<role><rank>]:` prefix (--tee 3). With other --tee or --redirects
    settings of the caller's, the lines cannot be told apart: all of them are shown."""
    value, argv = option_value(argv, ("--local-ranks-filter", "--local_ranks_filter"))
    ranks = parse_ranks(value or "")
    tee, _ = option_value(argv, ("--tee", "-t"))
    redirects, _ = option_value(argv, ("--redirects", "-r"))
    if redirects is not None or (tee is not None and tee != "3"):
        return argv, ranks, True
    return (argv if tee is not None else ["--tee", "3", *argv]), ranks, False


def main(argv: list[str]) -> int:
    if not argv:
        print("error: no arguments: give torchrun's options and the script to run; --help for more", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    verbose = argv[0] == "--verbose"
    argv = argv[1:] if verbose else argv
    code = preflight(argv)
    if code:
        return code
    try:
        argv, ranks, pass_through = output_options(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log_path = default_log_path(option_value(argv, ("--log-dir", "--log_dir"))[0], tempfile.gettempdir())
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w", buffering=1, errors="replace")
    except OSError as e:
        print(
            f"error: cannot write the launch log {log_path} ({e}); give torchrun's --log-dir a writable folder",
            file=sys.stderr,
        )
        return 2
    with log:
        return run_agent(argv, RankOutput(log, log_path, ranks, verbose or pass_through))


def run_agent(argv: list[str], output: RankOutput) -> int:
    """Run torchrun with `argv`, its output through `output`; the job's exit code, after its one
    error line when it failed."""
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *argv],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    readers = [
        threading.Thread(target=pump, args=(stream, output, err), daemon=True)
        for stream, err in ((agent.stdout, False), (agent.stderr, True))
    ]
    for reader in readers:
        reader.start()
    forward = Forwarder(agent)
    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    # Popen.wait resumes after each handler (PEP 475), so this returns only when the agent has exited.
    code = exit_code(agent.wait())
    for reader in readers:
        # A process the ranks left behind may hold the pipe open: its lines are not waited for.
        reader.join(timeout=READER_GRACE_S)
    summary = output.summary(code)
    if summary is None:
        return code
    line, code = summary
    _say(line)
    return code


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
