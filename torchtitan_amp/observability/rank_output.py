"""What the terminal shows of a torchrun job (torchtitan_amp.launch): the chosen ranks' lines, and
when the job fails, one `error: ...` line from the rank that failed first, naming a log file that
holds everything else.

Why: torchrun's agent answers a failed rank with its own output (a Python traceback of
ChildFailedError and a failure table, ~30 lines) and stops the other ranks; with
`--local-ranks-filter 0` a failure on rank 1 is not shown at all, and when every rank fails the
same check each prints the same line. Here the launcher reads the agent's output instead:

- a rank's line (torchrun's tee prefix `[<role><local rank>]:`) is shown when its local rank is
  among those asked for (torchrun's --local-ranks-filter, applied here so that every rank's output
  still reaches this process), except `error: ...` lines and a rank's uncaught traceback (and
  whatever that rank prints after it), which are held back: when one rank fails the others die
  of the lost peer, and their tracebacks would bury the cause (the failing rank's exception is
  the last line its summary quotes; every traceback is in the log);
- the agent's own lines (its banner, traceback, failure table) go only to the log file;
- every line, shown or not, goes to the log file;
- when the job fails: one line, the first rank's `error:` line (or, after a crash without one, the
  failing rank's last line), with the rank and the log file's path. Exit code: that rank's, from
  the agent's failure table.

`verbose` shows the agent's own lines and the tracebacks too (LOG_RANK=all in run_llama_train.sh).
Imports nothing but the standard library: the launcher lives as long as the job.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

# torchrun's tee prefix: "[" role, local rank "]:" (role "rank" in run_llama_train.sh: "[rank1]:").
# The role starts with a letter: the agent's failure table numbers its entries "[0]:", "[1]:".
_RANK_LINE = re.compile(r"^\[(?P<role>[A-Za-z_][\w.-]*?)(?P<rank>\d+)\]:(?P<text>.*)$", re.DOTALL)
# A rank's uncaught exception (torch prints it with its own "[rankN]: " prefix) and what follows it.
_TRACEBACK = re.compile(r"^(\[\w+\]: ?)?Traceback \(most recent call last\):")
_OWN_PREFIX = re.compile(r"^\[\w+\]: ?")
# Entries of the agent's failure table: "rank : 1 (local_rank: 1)" then "exitcode : 2 (pid: ...)".
_TABLE_RANK = re.compile(r"^\s*rank\s*:\s*\d+\s*\(local_rank:\s*(?P<local>\d+)\)")
_TABLE_CODE = re.compile(r"^\s*exitcode\s*:\s*(?P<code>-?\d+)")


@dataclass
class RankOutput:
    """Routes the agent's output lines; `summary` is the failure line once the agent has exited."""

    log: TextIO
    log_path: Path
    ranks: set[int] | None = None  # local ranks to show; None: all
    verbose: bool = False
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    first_error: tuple[int, str] | None = None  # (local rank, message) of the first `error:` line
    last_line: dict[int, str] = field(default_factory=dict)  # local rank -> its last non-empty line
    in_traceback: set[int] = field(default_factory=set)  # local ranks whose output is held from here on
    agent_last: str = ""  # the agent's last non-empty line of its own
    exit_codes: dict[int, int] = field(default_factory=dict)  # local rank -> exit code, from the table
    root_cause: int | None = None  # local rank of the table's "Root Cause (first observed failure)"
    _table_rank: int | None = None
    _in_root_cause: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def route(self, line: str, err: bool) -> None:
        """One line of the agent's stdout (`err` False) or stderr, with or without its newline."""
        line = line.rstrip("\n")
        # Two reader threads (stdout, stderr): one line at a time, whole, in one order in the log.
        with self._lock:
            self._write(self.log, line)
            match = _RANK_LINE.match(line)
            if match is None:
                self._agent_line(line, err)
                return
            rank, text = int(match["rank"]), match["text"]
            if text.strip():
                self.last_line[rank] = _OWN_PREFIX.sub("", text.strip())
            if text.startswith("error: "):
                if self.first_error is None:
                    self.first_error = (rank, text[len("error: ") :])
                return  # one error line for the job: summary() prints it
            if _TRACEBACK.match(text):
                self.in_traceback.add(rank)
            asked = self.ranks is None or rank in self.ranks
            if asked and (self.verbose or rank not in self.in_traceback):
                self._write(self.stderr if err else self.stdout, line)

    def _agent_line(self, line: str, err: bool) -> None:
        if line.strip():
            self.agent_last = line.strip()
        if line.startswith("Root Cause"):
            self._in_root_cause = True
        if (m := _TABLE_RANK.match(line)) is not None:
            self._table_rank = int(m["local"])
            if self._in_root_cause and self.root_cause is None:
                self.root_cause = self._table_rank
        elif (m := _TABLE_CODE.match(line)) is not None and self._table_rank is not None:
            # The failures come before the root cause in the table; the first code seen stands.
            self.exit_codes.setdefault(self._table_rank, int(m["code"]))
            self._table_rank = None
        if self.verbose:
            self._write(self.stderr if err else self.stdout, line)

    @staticmethod
    def _write(stream: TextIO, line: str) -> None:
        # A closed terminal (the launcher outlives a hung-up shell) must not stop the log file.
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    def summary(self, agent_code: int) -> tuple[str, int] | None:
        """(the job's one error line, its exit code) when the agent failed; None when it did not."""
        if agent_code == 0:
            return None
        where = f"(every rank's output and torchrun's report: {self.log_path})"
        if self.first_error is not None:
            rank, message = self.first_error
            return f"error: rank {rank}: {message} {where}", self._rank_code(rank, agent_code)
        failed = self.root_cause if self.root_cause is not None else next(iter(self.exit_codes), None)
        if failed is not None:
            code = self._rank_code(failed, agent_code)
            last = self.last_line.get(failed, "no output")
            return f"error: rank {failed} exited with code {code}: {last} {where}", code
        last = f": {self.agent_last}" if self.agent_last else ""
        return f"error: torchrun exited with code {agent_code}{last} {where}", agent_code

    def _rank_code(self, rank: int, agent_code: int) -> int:
        code = self.exit_codes.get(rank, agent_code)
        return 128 - code if code < 0 else code  # a rank ended by signal N: 128 + N, as a shell says


def parse_ranks(value: str) -> set[int] | None:
    """torchrun's --local-ranks-filter value ("0", "0,1") as a set; None for "" (every rank)."""
    value = value.strip()
    if not value:
        return None
    try:
        return {int(v) for v in value.split(",")}
    except ValueError:
        raise ValueError(
            f"--local-ranks-filter takes local ranks separated by commas (e.g. 0,1), got {value!r}"
        ) from None


def default_log_path(log_dir: str | None, tmp_root: str) -> Path:
    """Where the launcher's log goes: torchrun's --log-dir when given, else a folder of this
    user's under the system's temporary directory; one file per launch, named by its start time
    and pid."""
    # Per user: another user's folder of the same name would not be writable.
    folder = Path(log_dir) if log_dir else Path(tmp_root) / f"torchtitan_amp_launch-{os.getuid()}"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return folder / f"launch-{stamp}-{os.getpid()}.log"


def pump(stream: TextIO, output: RankOutput, err: bool) -> None:
    """Read the agent's stream to its end (a reader thread's body).

    Args:
        stream: the agent's stdout or stderr.
        output: where each line is routed.
        err: whether `stream` is stderr.
    """
    for line in stream:
        output.route(line, err)
