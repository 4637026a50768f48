"""How tools/gpu_checks.py runs its checks: each under its limit (SIGALRM), the outer timeout's
SIGTERM caught, the results JSON rewritten atomically when a check starts and ends, and the
seconds each check spent compiling (torch.compile, cold on a fresh machine) recorded beside its
own seconds."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.tools.gpu_check_runs import free_memory

Check = Callable[[argparse.Namespace, Path, dict[str, Any]], bool]
# A check is not started with less time than this left in --time-budget.
MIN_START_S = 5.0


class Interrupted(BaseException):
    """Raised inside a check by SIGALRM (its limit) or SIGTERM (the outer timeout). A
    BaseException, so that no `except Exception` in the code under test swallows it."""

    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


class Report:
    """The results so far, rewritten atomically whenever a check starts or ends, so that a timeout
    or kill loses at most the check it interrupted (left "running")."""

    def __init__(self, path: Path | None, env: dict[str, Any], names: list[str]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"env": env, "finished": False,
                                     "checks": {n: {"status": "not run"} for n in names}}

    def set(self, name: str, result: dict[str, Any]) -> None:
        self.data["checks"][name] = result
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def passed(self) -> bool:
        return all(r["status"] == "passed" for r in self.data["checks"].values())


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling frames in this process so far."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    key = next((k for k in ("entire_frame_compile", "_compile.compile_inner") if k in metrics), None)
    return float(sum(metrics[key])) if key else 0.0


def run_check(name: str, check: Check, a: argparse.Namespace, work: Path, limit_s: float | None) -> dict[str, Any]:
    """One check, stopped by SIGALRM after `limit_s` (None: no limit); its status, seconds, the
    seconds it spent compiling and what it recorded."""
    out: dict[str, Any] = {}
    begin, compiled = time.perf_counter(), compile_seconds()

    def expire(signum: int, frame: object) -> None:
        raise Interrupted("timeout", f"stopped after its {_round(limit_s):g} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s or 0)
    try:
        status = "passed" if check(a, work / name, out) else "failed"
    except Interrupted as e:
        status, out["error"] = e.status, e.why
    except Exception as e:  # noqa: BLE001 - report it and go on to the next check
        status, out["error"] = "error", f"{type(e).__name__}: {' '.join(str(e).splitlines())[:500]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if status not in ("passed", "failed"):
        torch._dynamo.reset()  # a compilation stopped half-way must not be reused by the next check
    free_memory()
    return {"status": status, "seconds": round(time.perf_counter() - begin, 1), "limit_s": _round(limit_s),
            "compile_s": round(compile_seconds() - compiled, 1), **out}


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def limit_for(name: str, a: argparse.Namespace, left_s: float, caps: dict[str, float]) -> float | None:
    """The check's cap, cut to what the budget leaves; None when neither bounds it."""
    cap = a.check_timeout.get(name, caps[name] if a.device == "cuda" else math.inf)
    limit = min(cap, left_s)
    return None if math.isinf(limit) else limit


def _on_sigterm(signum: int, frame: object) -> None:
    raise Interrupted("killed", f"{signal.Signals(signum).name} received (the outer timeout?)")


def run_all(a: argparse.Namespace, report: Report, names: list[str], checks: dict[str, Check],
            caps: dict[str, float], unavailable: Callable[[str], str | None]) -> None:
    """The checks `names` in order; `unavailable(name)` says why one cannot run here (a missing
    package): it is recorded "skipped" and the others run."""
    deadline = time.monotonic() + (a.time_budget if a.time_budget is not None else math.inf)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_checks_", ignore_cleanup_errors=True) as tmp:
            for name in names:
                left = deadline - time.monotonic()
                if left < MIN_START_S:
                    report.set(name, {"status": "not run", "error": f"{left:.0f} s left of the time budget"})
                    continue
                why = unavailable(name)
                if why is not None:
                    report.set(name, {"status": "skipped", "error": why})
                    print(f"SKIPPED {name}: {why}", flush=True)
                    continue
                limit = limit_for(name, a, left, caps)
                report.set(name, {"status": "running", "limit_s": _round(limit)})
                try:
                    result = run_check(name, checks[name], a, Path(tmp), limit)
                except Interrupted as e:  # a signal between the check's end and its clean-up
                    result = {"status": e.status, "error": e.why}
                report.set(name, result)
                print(f"{result['status'].upper()} {name}: {json.dumps(result, default=str)}", flush=True)
                if result["status"] == "killed":
                    break
    finally:
        signal.signal(signal.SIGTERM, previous)
