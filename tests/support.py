"""What the tests share: launching real training processes, the one spec format of the workers
under tests/workers/, and the tolerances of the precision proofs. (conftest.py holds only pytest's
hooks; tests and workers import this module.)

`run_train(tmp_path, nproc, *overrides)` starts
`python -m torch.distributed.run --standalone --nproc_per_node N train.py ...` with its own dump
folder and returns exit code, output and the metrics.jsonl rows. `run_python(...)` runs any
command-line script of the repo without torchrun. `launch_worker(worker, out, jobs, nproc)` runs one
of tests/workers/ on a spec of several jobs, so that process start-up (~5 s per launch on a 2-core
CPU) is paid once for all of them.

Every launch costs ~5 s of process start-up on a 2-core CPU (workers: ~3 s, spawned without
torchrun's agent), so tests share launches where they can
and keep models tiny: TINY below is the standard small run.
"""

from __future__ import annotations

import functools
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

REPO = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"

# debugmodel_tiny: a bf16 step costs ~14x less than debugmodel's on a CPU that emulates bf16; the
# loss still falls visibly within a dozen steps at this learning rate (10 steps: 6.02 -> 4.56).
TINY = (
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--optimizer.lr", "3e-3",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
)

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
        return f"exit code {self.returncode}\n--- stdout ---\n{self.stdout[-tail:]}\n--- stderr ---\n{self.stderr[-tail:]}"


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    # Workers under tests/workers import torchtitan_amp and tests.support from the repo.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A launch inside a launch (pytest itself under torchrun) must not inherit the outer group.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(key, None)
    env.update(extra or {})
    return env


def run_command(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: Path = REPO, dump_folder: Path | None = None) -> RunResult:
    """Run `cmd` in its own process group; on timeout kill the whole group (torchrun's workers too)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
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
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *restarts,
            *map(str, args)]


def new_dump_folder(tmp_path: Path) -> Path:
    folder = tmp_path / f"dump{next(_counter)}"
    folder.mkdir(parents=True)
    return folder


def run_train(tmp_path: Path, nproc: int, *overrides: str, timeout: float = 240,
              script: str | Path = "train.py", env: dict[str, str] | None = None) -> RunResult:
    """torchrun `script` (default train.py) on `nproc` CPU processes (gloo) with a fresh dump folder
    under tmp_path, passed as --job.dump_folder before `overrides` (so an override can replace it)."""
    dump = new_dump_folder(tmp_path)
    cmd = torchrun_cmd(nproc, script, "--job.dump_folder", dump, *overrides)
    return run_command(cmd, timeout=timeout, env=env, dump_folder=dump)


def run_python(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
               cwd: Path = REPO) -> RunResult:
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
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc))
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp:
        files = [(open(Path(tmp) / f"out{r}", "w+"), open(Path(tmp) / f"err{r}", "w+")) for r in range(nproc)]
        procs = [subprocess.Popen(cmd, cwd=REPO, env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)},
                                  stdout=files[r][0], stderr=files[r][1], text=True, start_new_session=True)
                 for r in range(nproc)]
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


def launch_worker(worker: str, out: Path, jobs: list[dict[str, Any]], nproc: int, *, timeout: float = 240,
                  check: bool = True, env: dict[str, str] | None = None, **options: Any) -> RunResult:
    """Run tests/workers/WORKER.py on `jobs` with nproc ranks (spawn_ranks; one process: plain
    python), one thread each; fails the test on a non-zero exit unless check is False."""
    spec = write_spec(out, jobs, **options)
    cmd = [sys.executable, str(WORKERS / f"{worker}.py"), str(spec)]
    env = {**ONE_THREAD, **(env or {})}
    # One process runs without a process group, as train.py does without torchrun.
    result = (run_command(cmd, timeout=timeout, env=env) if nproc == 1
              else spawn_ranks(nproc, cmd, timeout=timeout, env=env))
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
    tokens = torch.randint(0, trainer.run.job.model_args.vocab_size, (2, trainer.config.training.seq_len + 1), generator=g)
    inputs, labels = tokens[:, :-1].to(trainer.run.device), tokens[:, 1:].to(trainer.run.device)

    def loss_now() -> float:
        with torch.no_grad(), parallel_context(trainer.run.dims, trainer.config), autocast.forward_context(trainer.run.plan):
            return float(full(loss_fn(autocast.cast_output(trainer.run.plan, trainer.run.model(inputs)), labels)))

    model_sums = {k: digest(full(v)) for k, v in trainer.run.model.state_dict().items()}
    optim = get_optimizer_state_dict(trainer.run.model, trainer.run.optimizer,
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))
    optim_sums = {k: digest(full(v)) for k, v in optim.items()
                  if k.startswith("state.") and isinstance(v, torch.Tensor) and v.dim() > 0}
    before = loss_now()
    loss, grad_norm, _ = trainer.train_step(iter([(inputs, labels)]))
    return {"loss_before": before, "train_loss": float(loss), "grad_norm": float(grad_norm),
            "loss_after": loss_now(), "model_sums": model_sums, "optim_sums": optim_sums,
            "step": trainer.step}


# ---------------------------------------------------------------------------------------------
# Tolerances of the precision proofs (test_precision_dist, test_parallelisms). Measured on the
# debug model, bf16 autocast / FSDP policy vs fp32; each says what it was measured at.

# Whole 30-step curve vs the fp32 single-process curve: measured max 0.0029 (test_precision_dist).
CURVE_TOL = 0.01
# Mean over the curve vs fp32: a systematic bias (e.g. a low-precision loss) would show here;
# measured <= 3e-4.
CURVE_MEAN_TOL = 2e-3
# Step 1 vs fp32: measured 3.4e-4 / 5.3e-4; must be non-zero, or bf16 never ran.
STEP1_TOL, STEP1_MIN = 2e-3, 1e-5
# Step 1 between two mixed-precision paths of one family: measured 5e-7.
SAME_FAMILY_STEP1_TOL = 1e-5
# TP and PP split the same bf16 matmuls differently (row-wise TP rounds two partial sums and their
# sum instead of one product; the split shapes and PP's microbatches of 1 take other GEMM
# blockings), so their step-1 loss rounds differently from the unsplit run's. Bound in units of the
# loss's bf16 rounding noise `bf16_rounding_sigma` (~1.8e-4 for these models): if the two runs
# rounded every linear output independently their step-1 losses would differ by N(0, 2 sigma^2);
# a split changes a subset of those roundings, so |delta| < 3 sigma unless a layout rounds more
# than bf16 does. Measured (native bf16 / AVX2 emulation): test_parallelisms' TP 7.1e-5 (0.4 sigma)
# / 2.3e-4 (1.25 sigma), where the fixed 2e-4 tuned on the native kind failed; test_precision_dist's
# TP 2.5e-5 / 8.0e-5 (0.5 sigma), PP 0 / 4.8e-7.
SPLIT_MATMUL_STEP1_SIGMAS = 3.0
# Whole curve, fp32 single process vs fp32 DDP (same micro-batch grouping per rank): measured 4.8e-7
# (loss), 2.3e-7 relative (grad norm).
FP32_CURVE_TOL = 1e-5
# Grad norm vs the fp32 curve, relative: measured max 1.55e-2 over 30 steps (bf16 rounding of the
# gradients), <= 5.5e-4 at step 1. A gradient off by a constant factor (a sum over ranks instead
# of a mean, a missing 1/accum) is off by 100% here, while AdamW, being scale invariant, leaves the
# loss curve within its tolerances.
GRAD_NORM_CURVE_RTOL = 0.05
GRAD_NORM_STEP1_RTOL = 5e-3
# The trainer's gradient norm (fp32) vs the fp64 norm of the full gradients
# (tests/workers/norm_check.py). The trainer's per-tensor norms sum squares in fp32 in 8 vector
# lanes (measured: a planted large element swallows the tiny squares of 1/8 of the elements), so
# debugmodel's largest gradients (768 x 256 = 196608 elements) are sums of m = 24576 fp32 terms
# per lane. Rounding errors of such a sum grow like sqrt(m) unit roundoffs, sqrt(24576) x 2**-24
# = 9e-6, plus a one-sided loss of the squares below half an ulp of the running sum (the measured
# errors are all negative); the worst case is m x 2**-24 = 1.5e-3. Measured on every run of
# test_parallelisms: at most 1.3e-5 (single process, step 6). 1e-4 = 10 x the sqrt(m) scale; the
# bugs it is for are far larger (every TP shard counted twice: sqrt(2), 41%; a pipeline stage
# left out: tens of percent).
NORM_RTOL = 1e-4
# Clipped vs g * max_norm / (true + 1e-6): the trainer's coefficient comes from its own norm (off by
# at most NORM_RTOL) and is rounded to fp32, and so is the product: two more unit roundoffs.
CLIP_RTOL = NORM_RTOL + 2 * 2.0 ** -24
# norm_check's two fp64 norms (each rank's parts weighted by their copies, one all-reduce; the
# full gradients gathered): the same ~5e6 squares summed in two orders, n x 2**-53 = 6e-10 at worst.
GATHERED_RTOL = 1e-9


@functools.cache
def cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes rowwise scales (torch 2.13's does, 2.11's
    asserts scalar scales): asked of torch directly, so the fp8 probe's answer is checked against
    something other than itself."""
    import torch

    a = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@functools.cache
def bf16_rounding_sigma(overrides: tuple[str, ...], batch: int, shrink: tuple[tuple[str, int], ...] = ()) -> float:
    """Standard deviation of the step-1 loss if every linear output of the debug model (config
    `overrides`, with the model's fields `shrink` replaced) on the first `batch` sequences of its data were
    rounded once to bf16, to first order: round-to-nearest moves y by at most u|y| (u = 2**-8),
    uniformly, so by u|y|/sqrt(3) rms; independent errors move the loss by
    sqrt(sum((dL/dy * y)**2)) * u / sqrt(3). Computed in fp64 from the fp32 model, so it is a
    property of the arithmetic, not of this CPU's kernels."""
    import dataclasses
    import math

    import torch

    from torchtitan_amp.config import load_config
    from torchtitan_amp.data import build_dataloader
    from torchtitan_amp.train import job as job_mod
    from torchtitan_amp.train.trainer import loss_fn

    job = job_mod.resolve(load_config(["--model.flavor", "debugmodel", *overrides,
                                       "--mixed_precision.enabled", "false"]), 1, "cpu")
    if shrink:
        job = dataclasses.replace(job, model_args=dataclasses.replace(job.model_args, **dict(shrink)))
    t = job.config.training
    model = job_mod.build_model_parts(job, torch.device("cpu"), [0]).parts[0]
    inputs, labels = next(iter(build_dataloader(t.dataset, job.tokenizer, t.seq_len, batch, 0, 1, t.seed)))
    outputs: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        outputs.append(out)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(keep)
    loss_fn(model(inputs), labels).backward()
    total = sum(float((y.grad.double() * y.detach().double()).pow(2).sum()) for y in outputs)
    return 2.0**-8 / math.sqrt(3) * math.sqrt(total)


def mask_labels(labels: Any) -> Any:
    """The labels with some set to -100 (ignored by the loss), chosen by each window's own content
    so that every layout masks the same labels of the same window wherever it lands: by the sum of
    the window's labels mod 4, the whole window, its first half, every third label, or none. Ranks
    and micro-batches then hold unequal counts of valid labels, some none at all."""
    out = labels.clone()
    for row in out:
        kind = int(row.sum()) % 4
        if kind == 0:
            row[:] = -100
        elif kind == 1:
            row[: len(row) // 2] = -100
        elif kind == 2:
            row[::3] = -100
    return out


def write_short_documents(path: Path) -> Path:
    """A jsonl corpus of 400 documents of 1-6 words: every 32-token window packs several, so
    document masking (model.attn_mask_type = "block_causal") changes the loss."""
    import random

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))}) + "\n"
                            for _ in range(400)))
    return path


def c_compiler() -> str | None:
    """The C++ compiler inductor needs on CPU, if any: torch.compile tests skip without one, and
    launches leave their compiled jobs out."""
    import shutil

    return shutil.which("g++") or shutil.which("c++") or shutil.which("cc")


NO_COMPILER = "torch.compile (inductor on CPU) needs a C++ compiler: none of g++ / c++ / cc is on PATH"


# The host-sync budget of a training step (torchtitan_amp/observability/host_syncs.py), as the layouts worker
# records it for each run's second step on every rank (rank{R}.json "host_syncs"): the one
# finiteness read of trainer.train_step (fp16 with a non-fused AdamW: and GradScaler.step's read
# of found_inf), plus one .tolist() of the split sizes per expert-parallel
# MoE layer and forward (none in backward or in an activation-checkpoint recompute). A logging
# step's line adds the loss and gradient norm reads and one per family metric.
def assert_step_sync_budget(ranks: list[dict], label: str = "") -> None:
    assert ranks, f"{label}: no rank records"
    for info in ranks:
        record = info["host_syncs"].get("2")
        assert record is not None, f"{label} rank {info['rank']}: step 2 was not counted"
        want = {"_local_scalar_dense": 1 + info["scaler_reads_found_inf"] + info["cpu_only_scaler_reads"]}
        if info["ep_layers"]:
            want["tolist"] = info["ep_layers"] * info["forwards_per_step"]
        assert record["syncs"] == want, f"{label} rank {info['rank']}: {record['where']}"


class _Done:
    def wait(self) -> None:
        pass


class SameValuesManager:
    """torchft's Manager for one replica group run in-process, its peer group holding the same
    values: the all-reduce's average is the tensor itself (the dtypes sent are kept in `sent`),
    the quorum is immediate, every step commits, and this group saves the shared checkpoint."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def register_state_dict_fn(self, *args: Any) -> None:
        pass

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 0

    def should_commit(self) -> bool:
        return True

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Done:
        """The average of equal values is the tensor itself; their sum (reduce_op SUM: the
        counts) is the tensor times the groups."""
        import torch.distributed as dist

        self.sent.append(t.dtype)
        if reduce_op == dist.ReduceOp.SUM:
            t.mul_(self.num_participants())
        return _Done()

    def shutdown(self, wait: bool = False) -> None:
        pass


def use_stand_in_manager(monkeypatch: Any) -> None:
    """Trainers built under `monkeypatch` run fault tolerance in-process against a SameValuesManager
    (no lighthouse), with a fixed peak FLOP/s (no matmul probe)."""
    from torchtitan_amp.train import build
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(build.fault_tolerance, "build", lambda config, plan, *device: FaultTolerance(
        config.fault_tolerance, plan, manager=SameValuesManager()))


def use_paired_managers(monkeypatch: Any, groups: "PairedGroups") -> None:
    """As use_stand_in_manager, each trainer built with fault tolerance taking its replica
    group's PairedManager (one built without it has none)."""
    from torchtitan_amp.train import build
    from torchtitan_amp.train.fault_tolerance import FaultTolerance

    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(build.fault_tolerance, "build", lambda config, plan, *device: FaultTolerance(
        config.fault_tolerance, plan, manager=groups.managers[config.fault_tolerance.replica_id])
        if config.fault_tolerance.enable else None)


class PairedGroups:
    """Replica groups trained in-process, one thread each, whose torchft Managers really average:
    every all-reduce waits (a barrier) for the same call of every group, and each group gets the
    same result, summed in group order, then divided by the groups for an average (torchft's
    AVG: sum, then divide). `managers[g]` is group g's (a PairedManager); `run(fns)` runs fns[g]
    in group g's thread and returns their results."""

    def __init__(self, n: int = 2, timeout_s: float = 120.0) -> None:
        import threading

        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.managers = [PairedManager(self, g) for g in range(n)]

    def reduce(self, g: int, t: Any, average: bool) -> None:
        self.slots[g] = t.clone()
        self.barrier.wait()
        total = self.slots[0].clone()
        for other in self.slots[1:]:
            total += other
        self.barrier.wait()  # every group has read the slots before any writes the next call's
        t.copy_(total / self.n if average else total)

    def run(self, fns: list[Any]) -> list[Any]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.n) as pool:
            futures = [pool.submit(fn) for fn in fns]
            try:
                return [f.result() for f in futures]
            except BaseException:
                self.barrier.abort()  # a group that failed must not leave the other waiting
                raise


class PairedManager(SameValuesManager):
    """Group `g` of a PairedGroups: its all-reduces average (or sum) with the other groups';
    the state functions the loop registers are kept in `state_fns` (name -> (load, save)), so
    that a test can heal one group from another as torchft does over HTTP."""

    def __init__(self, groups: PairedGroups, g: int) -> None:
        super().__init__()
        self.groups, self.g = groups, g
        self.state_fns: dict[str, tuple[Any, Any]] = {}

    def register_state_dict_fn(self, name: str, load: Any, save: Any) -> None:
        self.state_fns[name] = (load, save)

    def num_participants(self) -> int:
        return self.groups.n

    def participating_rank(self) -> int:
        return self.g

    def allreduce(self, t: Any, reduce_op: Any = None) -> _Done:
        import torch.distributed as dist

        self.sent.append(t.dtype)
        self.groups.reduce(self.g, t, average=reduce_op in (None, dist.ReduceOp.AVG))
        return _Done()

    def heal_from(self, live: "PairedManager") -> None:
        """Load every state the live group serves, as a healing group's quorum does."""
        for name, (load, _) in self.state_fns.items():
            load(live.state_fns[name][1]())
