"""The GPU check `fault_tolerance`: two 1-rank torchft replica groups of the real Trainer
(fault_tolerance.enable) on one device, each its own process (a group is its own torchrun in a
job), against a lighthouse in the checking process. Each group trains FT_STEPS steps with fault
tolerance, then the same steps without it in the same (warm) process, the two groups side by side
both times: the step time with and without, the quorum's seconds, and the host syncs per step.

Everything listens and is reached on loopback: the lighthouse binds 127.0.0.1 and is handed out as
http://127.0.0.1:PORT, each group's store is on 127.0.0.1 (train/fault_tolerance.py, a group
without torchrun), gloo binds the `lo` interface (GLOO_SOCKET_IFNAME) and the groups advertise
127.0.0.1 as their host name. Every wait is bounded: the lighthouse's quorum
(QUORUM_TIMEOUT_S), each cross-group collective (fault_tolerance.process_group_timeout_ms) and
each group process (GROUP_TIMEOUT_S; the check's own limit stops it first on CUDA).

The cross-group backend is gloo on either device: NCCL refuses two ranks on one device, and both
groups share cuda:0 (gloo all-reduces CUDA tensors through host memory). The groups also share
the device (and the host's cores): step times are measured under that sharing, with and without
fault tolerance alike.

    python -m tests.gpu.test_ft_groups SPEC.json   # one group (the check starts two)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.runs import BF16, STEP_SYNC_BUDGET, base_args, step_syncs, sync_budget_kept

pytestmark = pytest.mark.gpu

# Steps of each run: step 1 waits in its first quorum for the other group's start-up and builds
# lazily, step 2 still warms up (allocator, first gloo buffers); the host syncs are counted in
# COUNTED_STEPS, and the steps after them are timed (the counting slows every op it sees).
FT_STEPS, TINY_FT_STEPS = 12, 8
COUNTED_STEPS = {3, 4}
QUORUM_TIMEOUT_S = 30
GROUP_TIMEOUT_S = 180.0
GROUPS = 2
LOOPBACK = "127.0.0.1"
# torchrun's variables: a group started without them is a one-process group with its own store.
_TORCHRUN_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)


def _runs(a: argparse.Namespace, work: Path, replica_id: int, lighthouse: str) -> dict[str, list[str]]:
    """One group's two runs' arguments: with fault tolerance, and without (its own dump folder)."""
    steps = TINY_FT_STEPS if a.tiny else FT_STEPS
    # Logged at the first and the last step only: the times are the steps', not the log's.
    common = BF16 + ["--training.steps", str(steps), "--metrics.log_freq", "1000"]
    ft = [
        "--fault_tolerance.enable",
        "true",
        "--fault_tolerance.group_size",
        str(GROUPS),
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--fault_tolerance.lighthouse",
        lighthouse,
        "--fault_tolerance.process_group",
        "gloo",
        "--fault_tolerance.quorum_timeout_seconds",
        str(QUORUM_TIMEOUT_S),
        "--fault_tolerance.process_group_timeout_ms",
        str(QUORUM_TIMEOUT_S * 1000),
    ]
    return {
        "fault_tolerance": base_args(a, work / "ft") + common + ft,
        "without": base_args(a, work / f"without_{replica_id}") + common,
    }


def _group_env(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    root = str(Path(__file__).resolve().parents[2])  # the checkout (tests, torchtitan_amp) this process runs
    env.update(GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")])))
    if device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # two groups on the CPU's cores
    return env


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """Until every group has exited, one has failed (its peer would only wait out its quorum
    timeout) or `timeout_s` has passed; then any still running are killed with their children."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]  # every one polled: any() would stop at the first
            if None not in codes or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


def _timed(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's steps after the counted ones (JSON keys are strings)."""
    return [r for s, r in run["step_times"].items() if int(s) > max(COUNTED_STEPS)]


def _summary(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """Both groups' timed steps: median seconds with fault tolerance (quorum + train_step,
    device-synced) and without (train_step), the quorum's seconds; their counted steps' syncs."""
    ft, plain = ([r for g in groups for r in _timed(g[name])] for name in ("fault_tolerance", "without"))
    ft_step = statistics.median(r["quorum_s"] + r["train_step_s"] for r in ft)
    plain_step = statistics.median(r["train_step_s"] for r in plain)
    counted = {name: [r for g in groups for r in g[name]["steps"].values()] for name in ("fault_tolerance", "without")}
    every_ft_step = [r for g in groups for r in g["fault_tolerance"]["step_times"].values()]
    return {
        "timed_steps_per_group": len(ft) // len(groups),
        "step_s_median": {"fault_tolerance": round(ft_step, 5), "without": round(plain_step, 5)},
        "fault_tolerance_over_without": round(ft_step / plain_step, 3),
        "quorum_s": {
            "first_step": [round(g["fault_tolerance"]["step_times"]["1"]["quorum_s"], 3) for g in groups],
            "median": round(statistics.median(r["quorum_s"] for r in ft), 5),
            "max": round(max(r["quorum_s"] for r in ft), 5),
        },
        **{
            f"{what}_syncs": {name: sorted({r[what] for r in rs}) for name, rs in counted.items()}
            for what in ("train_step", "loop")
        },
        "cuda_sync_warnings_per_step": {
            name: sorted({len(r["cuda_sync_warnings"] or ()) for r in rs}) for name, rs in counted.items()
        },
        "participants": sorted({r["participants"] for r in every_ft_step}),
        "discarded": max(r["discarded"] for r in every_ft_step),
    }


def check_fault_tolerance(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """Pass: both groups ran every step with both in the quorum and none discarded, and every
    counted train_step within STEP_SYNC_BUDGET at the dispatcher (the run without fault tolerance
    also by CUDA's report). Under fault tolerance CUDA's report is recorded, not held to the
    budget: torchft's should_commit synchronizes the device by design (docs/parallelisms.md)."""
    # Before torchft's extension is loaded (it reads this once): its INFO line per quorum would
    # fill the run's log; the groups' processes inherit it.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=GROUPS, join_timeout_ms=1000)
    url = f"http://{LOOPBACK}:{lighthouse.address().rsplit(':', 1)[1]}"
    out.update(
        groups=GROUPS,
        ranks_per_group=1,
        cross_group_backend="gloo",
        lighthouse=url,
        steps=TINY_FT_STEPS if a.tiny else FT_STEPS,
        syncs_counted_in_steps=sorted(COUNTED_STEPS),
    )
    work.mkdir(parents=True, exist_ok=True)
    procs, logs = [], [work / f"group{g}.log" for g in range(GROUPS)]
    try:
        for g in range(GROUPS):
            spec = work / f"group{g}.json"
            spec.write_text(
                json.dumps({"out": str(work / f"result{g}.json"), "device": a.device, "runs": _runs(a, work, g, url)})
            )
            with open(logs[g], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.gpu.test_ft_groups", str(spec)],
                        env=_group_env(a.device),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        _wait_all(procs, GROUP_TIMEOUT_S)
    finally:
        _wait_all(procs, 0)  # interrupted (the check's limit): no group outlives the check
        lighthouse.shutdown()
    out["exit_codes"] = [p.returncode for p in procs]
    if out["exit_codes"] != [0] * GROUPS:
        out["log_tails"] = [" | ".join(log.read_text().splitlines()[-8:])[-1500:] for log in logs]
        return False
    groups = [json.loads((work / f"result{g}.json").read_text()) for g in range(GROUPS)]
    out["summary"] = summary = _summary(groups)
    out["per_group"] = groups
    kept = all(sync_budget_kept(g["without"]) for g in groups)
    return (
        kept
        and summary["participants"] == [GROUPS]
        and summary["discarded"] == 0
        and max(summary["train_step_syncs"]["fault_tolerance"]) <= STEP_SYNC_BUDGET
        and summary["timed_steps_per_group"] == out["steps"] - max(COUNTED_STEPS)
    )


def group_main(spec_path: str) -> None:
    """One replica group: the run with fault tolerance, then the one without; the results to
    spec["out"]. Ends without interpreter finalization, as train.py does (gloo's threads)."""
    spec = json.loads(Path(spec_path).read_text())
    socket.gethostname = lambda: LOOPBACK  # what torchft advertises (its Manager, its state server)
    if spec["device"] == "cpu":  # as tests/gpu/conftest.py does: no minutes-long fp16 peak measurement
        from torchtitan_amp.train import build as train_build

        train_build.peak_flops = lambda device, dtype: 1e12
    code = 1
    try:
        result = {name: step_syncs(args, counted=COUNTED_STEPS) for name, args in spec["runs"].items()}
        Path(spec["out"]).write_text(json.dumps(result, default=str))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def test_fault_tolerance(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_fault_tolerance(a, tmp_path, out), out


if __name__ == "__main__":
    group_main(sys.argv[1])
