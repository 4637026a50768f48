"""Launching processes: real training runs (torchrun on gloo), tool scripts, the workers under
tests/workers/ with their one spec format, and `run_distributed`, one module-level function run on
N gloo ranks.

`run_train(tmp_path, nproc, *overrides)` starts
`python -m torch.distributed.run --standalone --nproc_per_node N train.py ...` with its own dump
folder and returns exit code, output and the metrics.jsonl rows. `run_python(...)` runs any
command-line script of the repo without torchrun. `launch_worker(worker, out, jobs, nproc)` runs one
of tests/workers/ on a spec of several jobs, so that process start-up (~5 s per launch on a 2-core
CPU) is paid once for all of them.

Every launch costs ~5 s of process start-up on a 2-core CPU (workers: ~3 s, spawned without
torchrun's agent), so tests share launches where they can
and keep models tiny: tests.support.inputs.TINY is the standard small run. A test module that
imports a launcher here is tiered `dist` (tests/conftest.py checks it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"

_counter = itertools.count()


@dataclass
class RunResult:
    returncode: int
    stdout: str
    stderr: str
    dump_folder: Path
    metrics: list[dict]

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def describe(self, tail: int = 3000) -> str:
        """The end of the output, for assertion messages."""
        return (
            f"exit code {self.returncode}\n--- stdout ---\n{self.stdout[-tail:]}\n--- stderr ---\n{self.stderr[-tail:]}"
        )


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # Workers under tests/workers import torchtitan_amp and tests.support from the repo.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A launch inside a launch (pytest itself under torchrun) must not inherit the outer group.
    for key in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "GROUP_RANK",
        "ROLE_RANK",
    ):
        env.pop(key, None)
    env.update(extra or {})
    return env


def run_command(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    dump_folder: Path | None = None,
) -> RunResult:
    """Run `cmd` in its own process group; on timeout kill the whole group (torchrun's workers too)."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        import pytest

        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    rows = read_metrics(dump_folder) if dump_folder is not None else []
    return RunResult(proc.returncode, stdout, stderr, dump_folder or cwd, rows)


def read_metrics(folder: Path) -> list[dict]:
    """The records of folder/metrics.jsonl, in file order (a resumed run appends); [] if it has none."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def by_step(folder: Path) -> dict[int, dict]:
    """The last record of each step in folder/metrics.jsonl: a resumed run appends to it."""
    return {r["step"]: r for r in read_metrics(folder)}


def torchrun_cmd(nproc: int, *args: str | Path, max_restarts: int | None = None) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=N [--max-restarts=R] ARGS...`"""
    restarts = [] if max_restarts is None else [f"--max-restarts={max_restarts}"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *restarts,
        *map(str, args),
    ]


def new_dump_folder(tmp_path: Path) -> Path:
    folder = tmp_path / f"dump{next(_counter)}"
    folder.mkdir(parents=True)
    return folder


def run_train(
    tmp_path: Path,
    nproc: int,
    *overrides: str,
    timeout: float = 240,
    script: str | Path = "train.py",
    env: dict[str, str] | None = None,
) -> RunResult:
    """torchrun `script` (default train.py) on `nproc` CPU processes (gloo) with a fresh dump folder
    under tmp_path, passed as --job.dump_folder before `overrides` (so an override can replace it)."""
    dump = new_dump_folder(tmp_path)
    cmd = torchrun_cmd(nproc, script, "--job.dump_folder", dump, *overrides)
    return run_command(cmd, timeout=timeout, env=env, dump_folder=dump)


def run_python(*args: str, timeout: float = 120, env: dict[str, str] | None = None, cwd: Path = REPO) -> RunResult:
    """`python <args>` from the repo root, without torchrun (e.g. `run_python("train.py", "--help")`)."""
    return run_command([sys.executable, *args], timeout=timeout, env=env, cwd=cwd)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def assert_loss_falls(rows: list[dict], k: int = 3) -> None:
    """The mean of the last k logged losses is below the mean of the first k."""
    losses = [r["loss"] for r in rows]
    assert len(losses) >= 2 * k, losses
    assert mean(losses[-k:]) < mean(losses[:k]), f"loss did not fall: {losses}"


# ---------------------------------------------------------------------------------------------
# Workers (tests/workers/*.py): one spec format and one launcher.
#
#   {"out": DIR, "options": {worker-wide settings}, "jobs": [{"name": NAME, "args": [CLI overrides],
#                                                             ...per-job settings}, ...]}
#
# A worker runs its jobs one after another in one launch and writes its evidence under DIR; each
# worker's docstring lists the options and per-job settings it reads.

# One thread per rank, as torchrun gives each of N > 1 ranks: comparable numerics between one and
# several processes, and no oversubscription of a 2-core machine (a 2-thread process next to
# another can run 10x slower).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Spec:
    out: Path
    jobs: list[dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)


def write_spec(out: Path, jobs: list[dict[str, Any]], **options: Any) -> Path:
    """out/spec.json (spec1.json, ... when out already has one) for `read_spec`."""
    out.mkdir(parents=True, exist_ok=True)
    path = next(p for i in itertools.count() if not (p := out / f"spec{i or ''}.json").exists())
    path.write_text(json.dumps({"out": str(out), "options": options, "jobs": jobs}, indent=1))
    return path


def read_spec(path: str | Path) -> Spec:
    raw = json.loads(Path(path).read_text())
    return Spec(Path(raw["out"]), raw["jobs"], raw.get("options", {}))


def launch_cmd(nproc: int, entry: str | Path, *args: str | Path, max_restarts: int | None = None) -> list[str]:
    """`python ENTRY ARGS` for one process without restarts, else torchrun with nproc ranks."""
    if nproc == 1 and not max_restarts:
        return [sys.executable, str(entry), *map(str, args)]
    return torchrun_cmd(nproc, entry, *args, max_restarts=max_restarts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(nproc: int, cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> RunResult:
    """Start `cmd` as ranks 0..nproc-1 of one job on this host, with the environment torchrun gives
    its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT; rank 0 hosts the store), without
    torchrun's agent: importing torch in the agent costs ~2 s of serial start-up per launch on 2
    cores, and the test workers need none of its restart or monitoring. Like torchrun, the first
    rank to fail ends the others (SIGTERM, SIGKILL after 5 s): a rank waiting in a collective for a
    dead peer would otherwise sit out the collective timeout. Output: every rank's stdout, then
    stderr, rank 0 first. The launcher's own behaviour is tested with torchrun (run_train, launch_cmd)."""
    import tempfile
    import time

    base = _env(env)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_WORLD_SIZE=str(nproc),
    )
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp:
        files = [(open(Path(tmp) / f"out{r}", "w+"), open(Path(tmp) / f"err{r}", "w+")) for r in range(nproc)]
        procs = [
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                stdout=files[r][0],
                stderr=files[r][1],
                text=True,
                start_new_session=True,
            )
            for r in range(nproc)
        ]
        deadline, timed_out = time.monotonic() + timeout, False
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            timed_out = time.monotonic() > deadline
            if failed or timed_out:
                _end(procs)
                break
            time.sleep(0.05)
        outputs = []
        for out_f, err_f in files:
            for f in (out_f, err_f):
                f.seek(0)
            outputs.append((out_f.read(), err_f.read()))
            for f in (out_f, err_f):
                f.close()
    stdout, stderr = "".join(o for o, _ in outputs), "".join(e for _, e in outputs)
    if timed_out:
        import pytest

        pytest.fail(f"timed out after {timeout} s: {nproc} x {' '.join(cmd)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return RunResult(code, stdout, stderr, REPO, [])


def _end(procs: list[subprocess.Popen]) -> None:
    import time

    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)
        end = time.monotonic() + grace
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.05)


def launch_worker(
    worker: str,
    out: Path,
    jobs: list[dict[str, Any]],
    nproc: int,
    *,
    timeout: float = 240,
    check: bool = True,
    env: dict[str, str] | None = None,
    **options: Any,
) -> RunResult:
    """Run tests/workers/WORKER.py on `jobs` with nproc ranks (spawn_ranks; one process: plain
    python), one thread each; fails the test on a non-zero exit unless check is False."""
    spec = write_spec(out, jobs, **options)
    cmd = [sys.executable, str(WORKERS / f"{worker}.py"), str(spec)]
    env = {**ONE_THREAD, **(env or {})}
    # One process runs without a process group, as train.py does without torchrun.
    result = (
        run_command(cmd, timeout=timeout, env=env) if nproc == 1 else spawn_ranks(nproc, cmd, timeout=timeout, env=env)
    )
    if check and result.returncode != 0:
        import pytest

        pytest.fail(result.describe())
    return result


def exit_process(code: int | None) -> None:
    """End a worker the way train.py does: flush, then skip interpreter finalization, where gloo's
    worker threads can abort a finished process ("terminate called without an active exception",
    pytorch/pytorch#179291's failure mode)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def digest(t: Any) -> str:
    """SHA-1 of a tensor's bytes: bitwise equality across processes, in a JSON-able form."""
    import torch

    return hashlib.sha1(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def probe_trainer(trainer: Any) -> dict[str, Any]:
    """What a loaded Trainer holds, comparable across layouts: the loss on one fixed batch (the
    same on every rank), one train step on it, the loss again, and digests of the full
    (unsharded) model and optimizer state. Equal across layouts and to the checkpoint's own
    tensors, or something was not loaded or resharded bit for bit."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    from torchtitan_amp.distributed.tensor_parallel import parallel_context
    from torchtitan_amp.precision import autocast
    from torchtitan_amp.train.trainer import loss_fn

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(
        0, trainer.run.job.model_args.vocab_size, (2, trainer.config.training.seq_len + 1), generator=g
    )
    inputs, labels = tokens[:, :-1].to(trainer.run.device), tokens[:, 1:].to(trainer.run.device)

    def loss_now() -> float:
        with (
            torch.no_grad(),
            parallel_context(trainer.run.dims, trainer.config),
            autocast.forward_context(trainer.run.plan),
        ):
            return float(full(loss_fn(autocast.cast_output(trainer.run.plan, trainer.run.model(inputs)), labels)))

    model_sums = {k: digest(full(v)) for k, v in trainer.run.model.state_dict().items()}
    optim = get_optimizer_state_dict(
        trainer.run.model, trainer.run.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    optim_sums = {
        k: digest(full(v))
        for k, v in optim.items()
        if k.startswith("state.") and isinstance(v, torch.Tensor) and v.dim() > 0
    }
    before = loss_now()
    loss, grad_norm, _ = trainer.train_step(iter([(inputs, labels)]))
    return {
        "loss_before": before,
        "train_loss": float(loss),
        "grad_norm": float(grad_norm),
        "loss_after": loss_now(),
        "model_sums": model_sums,
        "optim_sums": optim_sums,
        "step": trainer.step,
    }


def run_distributed(fn: Any, nproc: int, *args: Any, timeout: float = 240, env: dict[str, str] | None = None) -> list:
    """Run `fn(*args)`, a module-level function, on ranks 0..nproc-1 of one gloo group (spawn_ranks,
    one thread each; tests/workers/function.py starts the group) and return each rank's return value
    (pickled), in rank order. A rank that raises fails the test with its traceback (the first rank
    to fail: the others then fail in their collectives)."""
    import pickle
    import tempfile

    import pytest

    if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(f"run_distributed runs module-level functions that a rank can import, not {fn!r}")
    with tempfile.TemporaryDirectory(prefix="run_distributed") as tmp:
        folder = Path(tmp)
        (folder / "args.pkl").write_bytes(pickle.dumps(args))
        cmd = [sys.executable, str(WORKERS / "function.py"), f"{fn.__module__}:{fn.__qualname__}", tmp]
        result = spawn_ranks(nproc, cmd, timeout=timeout, env={**ONE_THREAD, **(env or {})})
        if result.returncode != 0:
            failed = sorted(folder.glob("rank*.err"), key=lambda p: p.stat().st_mtime_ns)
            if not failed:
                pytest.fail(f"{fn.__qualname__} on {nproc} ranks: {result.describe()}")
            pytest.fail(f"{fn.__qualname__} failed on {failed[0].stem}:\n{failed[0].read_text()}", pytrace=False)
        return [pickle.loads((folder / f"rank{r}.out").read_bytes()) for r in range(nproc)]
