"""The GPU checks as pytest runs them (`pytest -m gpu`, scripts/gpu_run.sh): in CHECKS' order, the
cheap probes first; each under its limit (SIGALRM: its cap, cut to what GPU_CHECKS_BUDGET leaves;
a check is not started with under MIN_START_S left); skipped without CUDA (unless
GPU_CHECKS_DEVICE=cpu) or without the optional package it imports; its results (what the check
recorded in `out`, its seconds and compile seconds) in GPU_CHECKS_JSON, rewritten as each check
starts and ends, and as a junit property ("recorded"). Settings: tests/gpu/settings.py."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.settings import CHECKS, MIN_START_S, Report, Settings, compile_seconds, environment

HERE = Path(__file__).resolve().parent
SETTINGS = Settings.from_env()
_RUN: dict[str, Any] = {"report": None, "deadline": math.inf, "current": None}
_OUT = pytest.StashKey[dict[str, Any]]()
_START = pytest.StashKey[tuple[float, float, float | None]]()  # (perf_counter, compile seconds, limit)
_TIMED_OUT = pytest.StashKey[bool]()
_STATUS = pytest.StashKey[str]()


def check_name(item: pytest.Item) -> str | None:
    """The check a test of tests/gpu/ runs (its name without `test_`); None for other tests."""
    if Path(item.path).resolve().parent != HERE:
        return None
    return getattr(item, "originalname", item.name).removeprefix("test_")


def pytest_configure(config: pytest.Config) -> None:
    # Before the first CUDA matmul: cuBLAS sizes its workspace once per process, and the resume
    # check runs with training.deterministic = true, which needs this setting (torch's notes).
    if SETTINGS.device == "cuda" and torch.cuda.is_available():
        from torchtitan_amp.distributed.process_groups import CUBLAS_DETERMINISTIC_WORKSPACE

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    if SETTINGS.json is not None:  # the one device call: its outer `timeout` sends SIGTERM first
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: object) -> None:
    why = f"{signal.Signals(signum).name} received (the outer timeout?)"
    report, name = _RUN["report"], _RUN["current"]
    if report is not None and name is not None:
        report.set(name, {**report.data["checks"][name], "status": "killed", "error": why})
    pytest.exit(why, returncode=2)


@pytest.hookimpl(trylast=True)  # after -m / -k deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slots = [i for i, item in enumerate(items) if check_name(item) is not None]
    mine = sorted((items[i] for i in slots), key=lambda it: CHECKS.index(str(check_name(it))))
    for i, item in zip(slots, mine):
        items[i] = item
    for item in mine:
        why = SETTINGS.why_skipped(str(check_name(item)))
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=why))
    if mine:
        _RUN["deadline"] = time.monotonic() + (SETTINGS.budget_s if SETTINGS.budget_s is not None else math.inf)
        _RUN["report"] = Report(SETTINGS.json, environment(SETTINGS), [str(check_name(it)) for it in mine])
        _RUN["report"].write()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _RUN["report"] is not None:
        _RUN["report"].data["finished"] = True
        _RUN["report"].write()


@pytest.fixture(scope="session")
def gpu_process() -> Iterator[None]:
    """On CPU: MFU's peak measurement runs an fp16 GEMM that takes minutes on CPUs without fp16
    units; a fixed peak instead."""
    with pytest.MonkeyPatch.context() as mp:
        if SETTINGS.device == "cpu":
            from torchtitan_amp.train import build as train_build

            mp.setattr(train_build, "peak_flops", lambda device, dtype: 1e12)
        yield


@pytest.fixture
def a(gpu_process: None) -> Any:
    """What every check reads: a.device, a.tiny, a.steps."""
    return SETTINGS.args()


@pytest.fixture
def out(request: pytest.FixtureRequest) -> dict[str, Any]:
    """What the check records (the measured numbers), kept in the JSON and the junit XML even
    when it fails or runs out of time."""
    data: dict[str, Any] = {}
    request.node.stash[_OUT] = data
    return data


@pytest.fixture(autouse=True)
def _limit(request: pytest.FixtureRequest) -> Iterator[None]:
    """The check's limit (SIGALRM: a check stopped by it fails "stopped after its N s limit")."""
    name = check_name(request.node)
    if name is None:
        yield
        return
    left = _RUN["deadline"] - time.monotonic()
    if left < MIN_START_S:
        pytest.skip(f"{left:.0f} s left of the time budget")
    limit = min(SETTINGS.cap(name), left)
    limit_s = None if math.isinf(limit) else round(limit, 1)
    request.node.stash[_START] = (time.perf_counter(), compile_seconds(), limit_s)
    _RUN["current"] = name
    if _RUN["report"] is not None:
        _RUN["report"].set(name, {"status": "running", "limit_s": limit_s})

    def expire(signum: int, frame: object) -> None:
        request.node.stash[_TIMED_OUT] = True
        pytest.fail(f"stopped after its {limit_s:g} s limit", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 0 if limit_s is None else limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _RUN["current"] = None
        if request.node.stash.get(_STATUS, "error") not in ("passed", "failed"):
            torch._dynamo.reset()  # a compilation stopped half-way must not be reused by the next check
        from tests.gpu.runs import free_memory

        free_memory()
        request.node.user_properties.append(("recorded", json.dumps(request.node.stash.get(_OUT, {}), default=str)))


def _status(item: pytest.Item, report: pytest.TestReport, call: pytest.CallInfo[None]) -> str:
    e = call.excinfo.value if call.excinfo is not None else None
    if report.skipped:
        return "not run" if str(getattr(e, "msg", "")).endswith("left of the time budget") else "skipped"
    if report.passed:
        return "passed"
    if item.stash.get(_TIMED_OUT, False):
        return "timeout"
    return "failed" if call.when == "call" and isinstance(e, AssertionError) else "error"


def _error(call: pytest.CallInfo[None]) -> str:
    e = call.excinfo.value if call.excinfo is not None else None
    if e is None:
        return ""
    if isinstance(e, (pytest.skip.Exception, pytest.fail.Exception)):
        return str(e.msg)
    if isinstance(e, AssertionError):
        return " ".join(str(e).splitlines())[:500]
    return f"{type(e).__name__}: {' '.join(str(e).splitlines())[:500]}"


@pytest.hookimpl(hookwrapper=True)  # the old-style wrapper: any pytest the GPU machine's image has
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    name, results = check_name(item), _RUN["report"]
    if name is None or results is None or (call.when != "call" and report.passed):
        return
    status = item.stash[_STATUS] = _status(item, report, call)
    result: dict[str, Any] = {"status": status}
    if item.stash.get(_START, None) is not None:
        begin, compiled, limit_s = item.stash[_START]
        result.update(
            seconds=round(time.perf_counter() - begin, 1),
            limit_s=limit_s,
            compile_s=round(compile_seconds() - compiled, 1),
        )
    if status != "passed":
        result["error"] = _error(call)
    results.set(name, {**result, **item.stash.get(_OUT, {})})
    terminal = item.config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None and SETTINGS.json is not None:  # the device call's log: each check's numbers
        line = json.dumps(results.data["checks"][name], default=str)
        terminal.write_line(f"\n{status.upper()} {name}: {line[:3000]}")
