"""Checkpoints: bitwise resume on every precision x layout (context parallel included), atomic
saves, resharding (also across cp degrees), seed and export, preemption (also through
torchtitan_amp.launch and scripts/multinode_trainer.slurm), crash + torchrun restart, and clear
errors for bad input.

Multi-process tests launch torchrun (gloo, CPU). To keep launches few, tests/workers/ckpt_jobs.py
runs several jobs in one process: the uninterrupted job A, then job B that starts from a copy of
A's step-3 checkpoint; B's steps 4..6 must equal A's exactly (==). Crash, preemption and seed
tests use fresh processes, so a resume there also starts from a cold process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.launch import (
    ONE_THREAD,
    WORKERS,
    RunResult,
    _env,
    by_step,
    digest,
    launch_cmd,
    launch_worker,
    probe_trainer,
    read_metrics,
    run_command,
    write_spec,
)
from torchtitan_amp.checkpoint import (
    CheckpointError,
    export_checkpoint,
    inspect_checkpoint,
    preemption,
    scan_folder,
    validate_config,
)
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.models import get_family
from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer
from torchtitan_amp.train import dry_run
from torchtitan_amp.train import trainer as trainer_module

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"

STEPS, RESUME_FROM = 6, 3
BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "3",
]
PRECISIONS = {
    "fp32": ["--mixed_precision.enabled", "false"],
    "bf16": ["--mixed_precision.param_dtype", "bfloat16"],
    # A large initial scale with fast growth: steps 1, 2 and 5 overflow and are skipped, the scale
    # grows in between, so a resume that lost the scale or growth tracker diverges at once.
    "fp16": [
        "--mixed_precision.param_dtype",
        "float16",
        "--mixed_precision.init_scale",
        "1048576",
        "--mixed_precision.growth_interval",
        "2",
    ],
}
LAYOUTS = {
    "single": (1, []),
    "tp": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "pp": (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "ddp": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "fsdp": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    # Two stages per rank (stages 0 and 2 on rank 0): the manager merges them into one module.
    "pp_interleaved": (
        2,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
    ),
    "fsdp_tp": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
    # Context parallel 2 x FSDP 2: data-parallel degree 2 (cp ranks read the same windows), FSDP
    # shards over dp_shard x cp (4 ranks).
    "cp_fsdp": (4, ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]),
}
# Fields of a metrics.jsonl record that must match exactly (timing fields are left out).
EXACT = ("loss", "grad_norm", "lr", "epoch", "loss_scale", "skipped_steps")
# Resharding changes which rank computes what, not the math: fp32 losses agree to float rounding.
RESHARD_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    """In-process Trainers: skip MFU's matmul benchmark (the workers skip it too)."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def job_args(layout: str, precision: str, dump: Path, *extra: str) -> list[str]:
    return [*BASE, *LAYOUTS[layout][1], *PRECISIONS[precision], "--job.dump_folder", str(dump), *extra]


def launch_train(args: list[str], nproc: int, *, max_restarts: int = 0, check: bool = True) -> RunResult:
    """train.py on one process directly (no torchrun) or under torchrun with nproc ranks; one thread each."""
    result = run_command(launch_cmd(nproc, TRAIN, *args, max_restarts=max_restarts), timeout=240, env=ONE_THREAD)
    if check and result.returncode != 0:
        pytest.fail(result.describe())
    return result


def assert_same_steps(got: dict[int, dict], want: dict[int, dict], steps) -> None:
    for step in steps:
        # A record without them would compare None == None below.
        assert {"loss", "grad_norm", "lr"} <= want[step].keys(), want[step]
        for key in EXACT:
            assert got[step].get(key) == want[step].get(key), (step, key, got[step].get(key), want[step].get(key))


def complete_steps(folder: Path) -> dict[int, str]:
    return {s: info.kind for s, info in scan_folder(folder)[0].items()}


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


# ---------------------------------------------------------------------------------------------
# Bitwise resume: precision x layout, one launch per layout


_MATRIX: dict[str, Path] = {}


def _async(layout: str, precision: str) -> list[str]:
    # The async writer is exercised where it is cheapest to check: its checkpoint must resume
    # bit for bit like a synchronous one.
    return ["--checkpoint.async_mode", "async"] if (layout, precision) == ("ddp", "bf16") else []


def _export(layout: str, precision: str) -> list[str]:
    if (layout, precision) == ("fsdp", "fp32"):
        return ["--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16"]
    return []


# Layouts whose jobs share one launch (the same ranks): the worker runs them one after another.
MATRIX_LAUNCHES = (("single",), ("ddp", "fsdp"))


def _matrix_jobs(layout: str, root: Path) -> list[dict]:
    """Each precision's job A and its resume B on `layout`."""
    jobs = []
    for precision in PRECISIONS:
        a, b = root / precision / "a", root / precision / "b"
        jobs.append(
            {
                "args": job_args(layout, precision, a, *_async(layout, precision)),
                "perturb_rng": True,
                "rng_out": str(root / precision / "rng_a.json"),
            }
        )
        jobs.append(
            {
                "args": job_args(layout, precision, b, *_async(layout, precision), *_export(layout, precision)),
                "copy": [
                    [str(a / "checkpoint" / f"step-{RESUME_FROM}"), str(b / "checkpoint" / f"step-{RESUME_FROM}")]
                ],
                "rng_out": str(root / precision / "rng_b.json"),
            }
        )
    return jobs


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    def run(layout: str) -> Path:
        if layout not in _MATRIX:
            (launch,) = [group for group in MATRIX_LAUNCHES if layout in group]
            roots = {name: tmp_path_factory.mktemp(f"matrix_{name}") for name in launch}
            jobs = [job for name in launch for job in _matrix_jobs(name, roots[name])]
            launch_worker("ckpt_jobs", roots[layout], jobs, LAYOUTS[layout][0], timeout=240 * len(launch))
            _MATRIX.update(roots)
        return _MATRIX[layout]

    return run


MATRIX_LAYOUTS = ("single", "ddp", "fsdp")


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("layout", MATRIX_LAYOUTS)
def test_resume_is_bitwise(matrix, layout, precision):
    root = matrix(layout)
    a, b = by_step(root / precision / "a"), by_step(root / precision / "b")
    assert sorted(a) == list(range(1, STEPS + 1))
    # B really resumed: its first logged step is the one after the checkpoint.
    assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1))
    assert_same_steps(b, a, range(RESUME_FROM + 1, STEPS + 1))
    # RNG states are saved per rank and restored (A reseeded each rank differently).
    rng_a = json.loads((root / precision / "rng_a.json").read_text())
    assert rng_a == json.loads((root / precision / "rng_b.json").read_text())
    assert len({json.dumps(r) for r in rng_a}) == len(rng_a)
    a_ckpt = inspect_checkpoint(root / precision / "a" / "checkpoint" / f"step-{STEPS}")
    tokens = STEPS * 2 * 32 * LAYOUTS[layout][0]
    assert a_ckpt.meta["tokens_seen"] == tokens
    if not _export(layout, precision):
        assert inspect_checkpoint(root / precision / "b" / "checkpoint" / f"step-{STEPS}").meta["tokens_seen"] == tokens
    if precision == "fp16":
        # The scaler state is what this case is about: make sure the run really exercises it.
        assert a[RESUME_FROM]["skipped_steps"] > 0
        assert len({a[s]["loss_scale"] for s in range(RESUME_FROM, STEPS + 1)}) > 1


PP_EXPORT = ("--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "bfloat16")


def test_resume_is_bitwise_tensor_and_pipeline_parallel(tmp_path):
    """TP 2 (DTensor params, loss parallel), PP 2 (one stage per rank, its own keys only) and
    Interleaved1F1B (two stages per rank), bf16. The interleaved resume ends with a model-only
    export, which must gather every rank's stages into one file."""
    layouts = ("tp", "pp", "pp_interleaved")
    jobs = []
    for layout in layouts:
        a, b = tmp_path / layout / "a", tmp_path / layout / "b"
        export = PP_EXPORT if layout == "pp_interleaved" else ()
        jobs += [
            {"args": job_args(layout, "bf16", a)},
            {
                "args": job_args(layout, "bf16", b, *export),
                "copy": [
                    [str(a / "checkpoint" / f"step-{RESUME_FROM}"), str(b / "checkpoint" / f"step-{RESUME_FROM}")]
                ],
            },
        ]
    launch_worker("ckpt_jobs", tmp_path, jobs, 2)
    for layout in layouts:
        a, b = by_step(tmp_path / layout / "a"), by_step(tmp_path / layout / "b")
        assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1)), layout
        assert_same_steps(b, a, range(RESUME_FROM + 1, STEPS + 1))
    # Every rank's stages of A's full checkpoint hold the same weights as B's export (resume is bitwise).
    root = tmp_path / "pp_interleaved"
    assert_export_equals_checkpoint(
        root / "b" / "checkpoint" / f"step-{STEPS}", root / "a" / "checkpoint" / f"step-{STEPS}", tmp_path / "a.pt"
    )


def assert_export_equals_checkpoint(export_dir: Path, full_dir: Path, scratch: Path) -> None:
    """A model-only export (bf16) holds exactly the full checkpoint's weights, loads strictly
    into a plain Transformer, and is not taken as a resume point."""
    info = inspect_checkpoint(export_dir)
    assert info.kind == "model_only" and sorted(p.name for p in export_dir.iterdir()) == ["checkpoint.json", "model.pt"]
    exported = torch.load(export_dir / "model.pt", weights_only=True)
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    reference = torch.load(export_checkpoint(full_dir, scratch, "bfloat16"), weights_only=True)
    assert list(exported) == list(reference)  # the plain model's key order
    assert all(torch.equal(exported[k], reference[k]) for k in exported)
    Transformer(LlamaModelArgs(**info.meta["model_args"])).load_state_dict(exported, strict=True)
    assert complete_steps(export_dir.parent) == {RESUME_FROM: "full", STEPS: "model_only"}


def test_model_only_export_loads_into_plain_transformer(matrix, tmp_path):
    root = matrix("fsdp") / "fp32"
    assert_export_equals_checkpoint(
        root / "b" / "checkpoint" / f"step-{STEPS}", root / "a" / "checkpoint" / f"step-{STEPS}", tmp_path / "a.pt"
    )


# ---------------------------------------------------------------------------------------------
# Resharding: FSDP 2 checkpoint -> single process, DDP 2, TP 2, FSDP 2, FSDP 2 x TP 2


CP_PRECISIONS = ("fp32", "bf16")


def _from(src: Path, dst: Path, step: int = RESUME_FROM) -> list[list[str]]:
    """A job's "copy": src's step-`step` checkpoint into dst's checkpoint folder (dst resumes from it)."""
    return [[str(src / "checkpoint" / f"step-{step}"), str(dst / "checkpoint" / f"step-{step}")]]


@pytest.fixture(scope="module")
def four_ranks(matrix, tmp_path_factory):
    """The one 4-rank launch: the FSDP 2 x TP 2 probe of the FSDP 2 checkpoint (the resharding
    test below); CP 2 x FSDP 2 jobs A and B (resumed from A's step 3) in fp32 and bf16; and
    'from_fsdp', CP 2 x FSDP 2 resumed from the FSDP 2 (cp 1) job A's step-3 checkpoint."""
    root = tmp_path_factory.mktemp("four_ranks")
    fsdp_a = matrix("fsdp") / "fp32" / "a"
    jobs = [{"args": reshard_args("fsdp_tp", root), "probe": str(root / "probe_fsdp_tp.json")}]
    for precision in CP_PRECISIONS:
        a, b = root / "cp" / precision / "a", root / "cp" / precision / "b"
        jobs += [
            {
                "args": job_args("cp_fsdp", precision, a),
                "perturb_rng": True,
                "rng_out": str(root / "cp" / precision / "rng_a.json"),
            },
            {
                "args": job_args("cp_fsdp", precision, b),
                "copy": _from(a, b),
                "rng_out": str(root / "cp" / precision / "rng_b.json"),
            },
        ]
    jobs.append(
        {
            "args": job_args("cp_fsdp", "fp32", root / "cp" / "from_fsdp"),
            "copy": _from(fsdp_a, root / "cp" / "from_fsdp"),
        }
    )
    launch_worker("ckpt_jobs", root, jobs, 4)
    return root


def reshard_args(layout: str, out: Path, *extra: str) -> list[str]:
    """Load the FSDP 2 fp32 job A's step-3 checkpoint (in place, read only) into `layout`."""
    folder = _MATRIX["fsdp"] / "fp32" / "a" / "checkpoint"
    return job_args(
        layout,
        "fp32",
        out / layout,
        "--checkpoint.folder",
        str(folder),
        "--checkpoint.load_step",
        str(RESUME_FROM),
        *extra,
    )


@pytest.fixture(scope="module")
def resharded(matrix, four_ranks, tmp_path_factory):
    """The FSDP 2 checkpoint probed on 2-rank layouts (one launch, which also resumes CP 2 x FSDP 2's
    fp32 checkpoint on FSDP 2 without cp: job 'cp_to_fsdp'), and on FSDP 2 x TP 2 (four_ranks)."""
    root = tmp_path_factory.mktemp("resharded")
    folder = matrix("fsdp") / "fp32" / "a" / "checkpoint"
    before = snapshot(folder)
    two_rank = {"fsdp": (), "ddp": (), "tp": ("--checkpoint.exclude_from_loading", "dataloader")}
    cp_a = four_ranks / "cp" / "fp32" / "a"
    launch_worker(
        "ckpt_jobs",
        root,
        [
            *(
                {"args": reshard_args(layout, root, *extra), "probe": str(root / f"probe_{layout}.json")}
                for layout, extra in two_rank.items()
            ),
            {"args": job_args("fsdp", "fp32", root / "cp_to_fsdp"), "copy": _from(cp_a, root / "cp_to_fsdp")},
        ],
        2,
    )
    results = {k: json.loads((root / f"probe_{k}.json").read_text()) for k in two_rank}
    results["fsdp_tp"] = json.loads((four_ranks / "probe_fsdp_tp.json").read_text())
    # One process cannot take over two ranks' data positions: it restarts the data stream.
    single = trainer_module.Trainer(
        load_config(reshard_args("single", root, "--checkpoint.exclude_from_loading", "dataloader"))
    )
    results["single"] = probe_trainer(single)
    single.run.metrics.close()
    assert snapshot(folder) == before
    return root, results


def test_reshard_fsdp_checkpoint_into_other_layouts(matrix, resharded, tmp_path):
    folder = matrix("fsdp") / "fp32" / "a" / "checkpoint"
    results = resharded[1]
    # The checkpoint's own tensors, read on one process without any model.
    saved = torch.load(dcp_to_torch_save_file(folder / f"step-{RESUME_FROM}", tmp_path / "full.pt"), weights_only=False)
    want_model = {k: digest(v) for k, v in saved["model"].items()}
    want_optim = {
        k: digest(v)
        for k, v in _flatten(saved["optimizer"]).items()
        if k.startswith("state.") and isinstance(v, torch.Tensor) and v.dim() > 0
    }
    assert len(want_optim) == 2 * len(want_model)  # exp_avg and exp_avg_sq of every parameter
    ref = results["fsdp"]
    for layout, r in results.items():
        assert r["step"] == RESUME_FROM, layout
        # Exactly the saved weights and AdamW moments, whatever the layout.
        assert r["model_sums"] == want_model, layout
        assert r["optim_sums"] == want_optim, layout
        for key in ("loss_before", "train_loss", "grad_norm", "loss_after"):
            assert r[key] == pytest.approx(ref[key], rel=RESHARD_RTOL), (layout, key)


# ---------------------------------------------------------------------------------------------
# Context parallel: bitwise resume on CP 2 x FSDP 2, and checkpoints across cp degrees


@pytest.mark.parametrize("precision", CP_PRECISIONS)
def test_resume_is_bitwise_context_parallel(four_ranks, precision):
    root = four_ranks / "cp" / precision
    a, b = by_step(root / "a"), by_step(root / "b")
    assert sorted(a) == list(range(1, STEPS + 1))
    assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1))
    assert_same_steps(b, a, range(RESUME_FROM + 1, STEPS + 1))
    rng_a = json.loads((root / "rng_a.json").read_text())
    assert rng_a == json.loads((root / "rng_b.json").read_text()) and len({json.dumps(r) for r in rng_a}) == 4
    # Two data-parallel ranks of 2 windows each per step: cp ranks split windows, they add none.
    assert inspect_checkpoint(root / "a" / "checkpoint" / f"step-{STEPS}").meta["tokens_seen"] == STEPS * 2 * 2 * 32


def _close_steps(got: dict[int, dict], want: dict[int, dict]) -> None:
    """Another layout resumed the same checkpoint: same data, same math, another reduction order."""
    assert sorted(got) == list(range(RESUME_FROM + 1, STEPS + 1))
    for step in got:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=RESHARD_RTOL), (step, key)
        assert got[step]["lr"] == want[step]["lr"]


def test_context_parallel_checkpoint_resumes_at_another_cp_degree(matrix, four_ranks, resharded):
    """cp does not change the data-parallel degree, and the data position is kept per dp rank: a
    CP 2 x FSDP 2 checkpoint resumes on FSDP 2 without cp (and the reverse) where it left off,
    weights and AdamW moments resharded by DCP. Not bit for bit (the attention and FSDP's
    reductions run in another order), to fp32 rounding; RNG states are not restored (another
    world size; the model has no dropout)."""
    cp_a = by_step(four_ranks / "cp" / "fp32" / "a")
    _close_steps(by_step(resharded[0] / "cp_to_fsdp"), cp_a)
    _close_steps(by_step(four_ranks / "cp" / "from_fsdp"), by_step(matrix("fsdp") / "fp32" / "a"))


def test_context_parallel_checkpoint_on_another_data_parallel_degree_keeps_its_data_position(
    four_ranks, tmp_path, caplog
):
    """CP 2 x FSDP 2 has data-parallel degree 2 (not 4): one process takes over its global data
    position (samples consumed), says so in one line, and holds exactly the saved weights and AdamW moments."""
    folder = four_ranks / "cp" / "fp32" / "a" / "checkpoint"
    with caplog.at_level("INFO", logger="torchtitan_amp"):
        single = trainer_module.Trainer(
            load_config(
                job_args(
                    "single",
                    "fp32",
                    tmp_path / "single",
                    "--checkpoint.folder",
                    str(folder),
                    "--checkpoint.load_step",
                    str(RESUME_FROM),
                )
            )
        )
    assert single.run.dataloader.samples == RESUME_FROM * 2 * 2  # 2 dp ranks x local batch 2 per step
    assert (
        "data resumes at sample 12 (epoch 0); saved on 2 data-parallel ranks, now 1; global batch was 4 "
        "sequences, now 2"
    ) in caplog.text
    got = probe_trainer(single)
    single.run.metrics.close()
    saved = torch.load(dcp_to_torch_save_file(folder / f"step-{RESUME_FROM}", tmp_path / "full.pt"), weights_only=False)
    assert got["step"] == RESUME_FROM
    assert got["model_sums"] == {k: digest(v) for k, v in saved["model"].items()}
    assert got["optim_sums"] == {
        k: digest(v)
        for k, v in _flatten(saved["optimizer"]).items()
        if k.startswith("state.") and isinstance(v, torch.Tensor) and v.dim() > 0
    }


def dcp_to_torch_save_file(step_dir: Path, out: Path) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(out))
    return out


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


# ---------------------------------------------------------------------------------------------
# Crash + restart, preemption


def test_fault_injection_restart_resumes_bitwise(matrix, tmp_path):
    reference = by_step(matrix("fsdp") / "bf16" / "a")
    dump = tmp_path / "job"
    proc = launch_train(
        job_args("fsdp", "bf16", dump, "--debug.fault_inject_at_step", "5", "--debug.fault_inject_rank", "1"),
        2,
        max_restarts=1,
    )
    assert (dump / ".fault_injected_at_step_5").exists()
    assert f"checkpoint/step-{RESUME_FROM} (" in proc.stdout  # the restarted job loaded step-3
    steps = [r["step"] for r in read_metrics(dump)]
    assert steps.count(RESUME_FROM + 1) == 2  # step 4 ran before the crash and again after it
    assert_same_steps(by_step(dump), reference, range(1, STEPS + 1))


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """torchrun's worker processes by RANK."""
    pids = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == launcher_pid:
                env = (stat.parent / "environ").read_bytes().split(b"\0")
                rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
                pids[rank] = int(stat.parent.name)
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return pids


def _wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it could be signalled"
        jsonl = dump / "metrics.jsonl"
        if jsonl.exists() and any(json.loads(line)["step"] >= step for line in jsonl.read_text().splitlines()):
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout} s")


def test_sigterm_and_sigusr1_request_a_stop(monkeypatch):
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        for sig in previous:
            monkeypatch.setattr(preemption, "_stop_signal", None)
            preemption.install_preemption_handlers()
            assert preemption.stop_requested() is None
            os.kill(os.getpid(), sig)
            assert preemption.stop_requested() == sig.name
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_preemption_signal_on_one_rank_stops_all_and_resumes(matrix, tmp_path):
    layout, nproc, target_rank = "fsdp", 2, 1
    dump = tmp_path / "job"
    # No interval saves: the only checkpoint is the one the signal causes. Steps are slowed down
    # so the signal lands mid-run.
    args = job_args(layout, "fp32", dump, "--checkpoint.interval", "1000")
    spec = write_spec(tmp_path / "spec", [{"args": args}], step_delay=0.5)
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            launch_cmd(nproc, WORKERS / "ckpt_jobs.py", spec),
            cwd=ROOT,
            env=_env(ONE_THREAD),
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        ranks: dict[int, int] = {}
        try:
            _wait_for_step(dump, 2, proc)
            ranks = _rank_pids(proc.pid)
            sent = time.monotonic()
            os.kill(ranks[target_rank], signal.SIGUSR1)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:  # hung: kill torchrun and its workers, which may have left its group
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in ranks.values():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    out = log.read_text()
    assert proc.returncode == 0, out[-4000:]
    assert time.monotonic() - sent < 60
    saved = complete_steps(dump / "checkpoint")
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert saved == {stopped_at: "full"} and 2 <= stopped_at < STEPS, (saved, stopped_at)
    assert "stop requested (SIGUSR1" in out
    # Rank 0 never saw the signal, yet both stopped after the same step (a save needs every
    # rank), and the resumed job continues exactly like the uninterrupted one.
    launch_train(job_args(layout, "fp32", dump), nproc)
    assert_same_steps(by_step(dump), by_step(matrix(layout) / "fp32" / "a"), range(1, STEPS + 1))


# ---------------------------------------------------------------------------------------------
# Pre-emption through torchtitan_amp.launch: the sender's deadline, not torchrun's
#
# torchrun's agent SIGKILLs its ranks --shutdown-timeout seconds after it forwarded a signal. The
# launcher hands the signal to the ranks instead and waits for them. Unit tests of the launcher
# and of the deadline check are in tests/test_preemption.py.

GRACE_S, STEP_DELAY_S = 1, 3  # torchrun's SIGKILL grace for these tests, shorter than one step


def _kill_tree(root: int) -> None:
    # The launcher runs torchrun in a session of its own, so a killpg of the test's group misses it.
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [root], []
    while todo:
        tree.append(pid := todo.pop())
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _signal_and_wait(
    cmd: list[str],
    dump: Path,
    log: Path,
    sig: signal.Signals,
    *,
    env: dict[str, str],
    after_step: int = 2,
    group: bool = False,
) -> tuple[int, str]:
    """Start cmd in its own session, send `sig` to it (to its whole process group with `group`, as
    a terminal's Ctrl-C does) once step `after_step` is logged, return its exit code and output;
    kill everything it started if it hangs."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(env), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_for_step(dump, after_step, proc)
            (os.killpg if group else os.kill)(proc.pid, sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
    return proc.returncode, log.read_text()


def launcher_cmd(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "torchtitan_amp.launch", "--standalone", "--nproc_per_node=2", *map(str, args)]


def _torchrun_has_shutdown_timeout() -> bool:
    from torch.distributed.run import get_args_parser

    return "--shutdown-timeout" in get_args_parser()._option_string_actions


@pytest.mark.skipif(
    not _torchrun_has_shutdown_timeout(),
    reason="this torch's torchrun has no --shutdown-timeout (2.11: a fixed 30 s grace) to shorten",
)
def test_sigterm_to_launcher_saves_after_a_step_longer_than_torchruns_grace_and_resumes_bitwise(matrix, tmp_path):
    dump = tmp_path / "job"
    # No interval saves: the only checkpoint is the pre-emption's. Each step sleeps STEP_DELAY_S
    # and torchrun's agent would SIGKILL its ranks GRACE_S after a signal reached it: only a
    # signal that bypasses the agent leaves time for the step and the save.
    args = job_args("fsdp", "fp32", dump, "--checkpoint.interval", "1000")
    cmd = launcher_cmd(f"--shutdown-timeout={GRACE_S}", WORKERS / "slow_steps.py", STEP_DELAY_S, *args)
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGTERM, env=ONE_THREAD)
    assert code == 0, out[-4000:]
    assert "launch: SIGTERM: asking 2 rank(s) to finish the step" in out
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert complete_steps(dump / "checkpoint") == {stopped_at: "full"} and stopped_at < STEPS, out[-4000:]
    result = launch_train(job_args("fsdp", "fp32", dump), 2)
    assert f"step-{stopped_at} (" in result.stdout  # it resumed from the pre-emption's checkpoint
    assert_same_steps(by_step(dump), by_step(matrix("fsdp") / "fp32" / "a"), range(1, STEPS + 1))


def test_ctrl_c_to_the_launchers_process_group_saves_and_exits_0(tmp_path):
    # A terminal sends SIGINT to its whole foreground process group; were the ranks in it, they
    # would die of KeyboardInterrupt instead of saving.
    dump = tmp_path / "job"
    cmd = launcher_cmd(
        TRAIN, *job_args("fsdp", "fp32", dump, "--checkpoint.interval", "1000", "--training.steps", "1000")
    )
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGINT, env=ONE_THREAD, group=True)
    assert code == 0, out[-4000:]
    assert "launch: SIGINT: asking 2 rank(s) to finish the step" in out
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert complete_steps(dump / "checkpoint") == {stopped_at: "full"}, out[-4000:]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_slurm_script_passes_the_warning_signal_to_the_ranks_which_save_and_exit_0(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", "echo node1\n")
    _stub(bin_dir, "hostname", "echo 127.0.0.1\n")
    # srun on one node: drop its options and become the task, as slurmstepd would run it. srun's
    # own forwarding of SIGTERM to its tasks is SLURM's and cannot be run here.
    _stub(bin_dir, "srun", 'while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\nexec "$@"\n')
    dump = tmp_path / "job"
    env = {
        **ONE_THREAD,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "GPUS_PER_NODE": "2",
        "RDZV_PORT": str(_free_port()),
        "CONFIG_FILE": "train_configs/debug_model.toml",
        "PREEMPT_WARNING_S": "90",
    }
    # debugmodel_h64, not BASE's debugmodel_tiny: the size check below holds within 5% only where
    # the tensors outweigh the checkpoint's fixed pickled entries (10% of a tiny rank's share).
    # fp32 is not emulated on CPUs without bf16, so the larger model costs little here.
    args = job_args(
        "fsdp",
        "fp32",
        dump,
        "--checkpoint.interval",
        "1000",
        "--training.steps",
        "1000",
        "--model.flavor",
        "debugmodel_h64",
    )
    cmd = ["bash", str(ROOT / "scripts" / "multinode_trainer.slurm"), *args]
    # What `#SBATCH --signal=B:USR1@N` does N seconds before the time limit: SIGUSR1 to the batch shell.
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGUSR1, env=env)
    assert code == 0, out[-4000:]
    assert "SIGUSR1: asking ranks to checkpoint and exit (deadline in 90 s)" in out
    assert "launch: SIGTERM: asking 2 rank(s)" in out
    assert "pre-emption: 90 s warning" in out  # PREEMPT_WARNING_S became checkpoint.preemption_warning_s
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert complete_steps(dump / "checkpoint") == {stopped_at: "full"}, out[-4000:]
    # The deadline arithmetic starts from the dry run's per-rank checkpoint size: it is what each
    # rank wrote, to DCP's overhead (0.8% here), plus, on the rank DCP picks for them, the pickled
    # non-tensor entries (per-parameter optimizer settings, LR schedule: ~1.2 MB, 3.9% of this
    # tiny model's share, a vanishing fraction of a real one's).
    config = load_config([*args, "--job.dump_folder", str(tmp_path / "dry")])
    for rank in (0, 1):
        estimate = dry_run.run(config, world_size=2, rank=rank, write=False)["memory"]["checkpoint"]
        written = (dump / "checkpoint" / f"step-{stopped_at}" / f"__{rank}_0.distcp").stat().st_size
        assert estimate <= written <= 1.05 * estimate, (rank, estimate, written)


# ---------------------------------------------------------------------------------------------
# Atomic saves, corrupt checkpoints, keep_latest_k


def test_interrupted_and_corrupt_checkpoints_are_skipped(matrix, tmp_path):
    reference_root = matrix("single") / "bf16" / "a"
    dump = tmp_path / "job"
    folder = dump / "checkpoint"
    args = job_args("single", "bf16", dump, "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1")
    # Die after every file of step-4 is written but before its completion marker.
    proc = launch_worker("ckpt_jobs", tmp_path, [{"args": args}], 1, check=False, crash_in_save_step=4)
    assert proc.returncode != 0
    assert complete_steps(folder) == {2: "full"}  # step-2 is only removed once step-4 is complete
    assert (folder / "step-4.tmp" / "rank_0.pt").exists() and not (folder / "step-4").exists()
    # A newer checkpoint with a truncated file, and one without a completion marker.
    shutil.copytree(reference_root / "checkpoint" / "step-3", folder / "step-3")
    with open(folder / "step-3" / "__0_0.distcp", "r+b") as fh:
        fh.truncate(1000)
    shutil.copytree(folder / "step-2", folder / "step-5")
    (folder / "step-5" / "checkpoint.json").unlink()

    proc = launch_worker("ckpt_jobs", tmp_path, [{"args": args}], 1)
    log = proc.stdout + proc.stderr
    assert "step-3: file __0_0.distcp has 1000 bytes" in log
    assert "step-5 has no checkpoint.json" in log
    assert "step-4.tmp: an unfinished save" in log
    assert "resuming from the newest complete checkpoint" in log and "step-2" in log
    assert_same_steps(by_step(dump), by_step(reference_root), range(3, STEPS + 1))
    # keep_latest_k = 1 left the newest; the broken folders were not deleted, the dead .tmp was.
    assert complete_steps(folder) == {STEPS: "full"}
    assert (folder / "step-3").is_dir() and (folder / "step-5").is_dir()
    assert not list(folder.glob("*.tmp"))
    # Asking for the corrupt step by name is an error that says why, not a silent fallback.
    with pytest.raises(
        CheckpointError, match=r"load_step = 3: no complete checkpoint step-3 .*1000 bytes.*available steps: 6"
    ):
        trainer_module.Trainer(load_config(args + ["--checkpoint.load_step", "3"]))


def test_bit_flip_is_caught_by_checksums(matrix, tmp_path):
    """One flipped bit, same size: only the CRC-32 can tell. Of 2 ranks, rank 1 checks this file
    (ranks split the files); the job names it, resumes from the previous checkpoint, and keeps
    the bad one aside when it saves that step again."""
    dump = tmp_path / "job"
    shutil.copytree(matrix("ddp") / "fp32" / "a" / "checkpoint", dump / "checkpoint")
    bad = dump / "checkpoint" / f"step-{STEPS}" / "__0_0.distcp"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    assert inspect_checkpoint(bad.parent).step == STEPS  # the sizes alone pass
    verify = [sys.executable, "-m", "torchtitan_amp.checkpoint", "verify"]
    cli = run_command([*verify, str(bad.parent)], timeout=120)
    assert cli.returncode == 2 and "__0_0.distcp has CRC-32" in cli.stderr
    # Asking for it by name is an error that says why, never a fallback.
    with pytest.raises(
        CheckpointError,
        match=rf"load_step = {STEPS}: no complete checkpoint step-{STEPS} .*"
        r"__0_0.distcp has CRC-32 \w+, the manifest says \w+ \(corrupt\)",
    ):
        trainer_module.Trainer(load_config(job_args("single", "fp32", dump, "--checkpoint.load_step", str(STEPS))))
    # So is starting a new job from its weights.
    with pytest.raises(CheckpointError, match=r"initial_load_path: .*__0_0.distcp has CRC-32"):
        trainer_module.Trainer(
            load_config(
                job_args("single", "fp32", tmp_path / "other", "--checkpoint.initial_load_path", str(bad.parent))
            )
        )

    proc = launch_worker("ckpt_jobs", tmp_path, [{"args": job_args("ddp", "fp32", dump)}], 2)
    assert f"skipping {bad.parent}: file __0_0.distcp has CRC-32" in proc.stdout + proc.stderr
    assert_same_steps(by_step(dump), by_step(matrix("ddp") / "fp32" / "a"), range(RESUME_FROM + 1, STEPS + 1))
    assert (dump / "checkpoint" / f"step-{STEPS}.corrupt" / "__0_0.distcp").read_bytes() == bytes(data)
    assert run_command([*verify, str(bad.parent)], timeout=120).returncode == 0


def test_keep_latest_k_never_counts_checkpoints_of_later_steps(matrix, tmp_path):
    """A run resumed from step 3 past a corrupt step-6 saves steps 4 and 5 with keep_latest_k = 1:
    it removes 3 and 4 but keeps 5, the one it just wrote, and leaves step-6 (a later step from
    another timeline) alone rather than counting it as the latest."""
    reference = matrix("single") / "fp32" / "a"
    dump = tmp_path / "job"
    shutil.copytree(reference / "checkpoint", dump / "checkpoint")
    later = dump / "checkpoint" / f"step-{STEPS}" / "__0_0.distcp"
    data = bytearray(later.read_bytes())
    data[len(data) // 3] ^= 0x01
    later.write_bytes(bytes(data))
    trainer_module.Trainer(
        load_config(
            job_args(
                "single",
                "fp32",
                dump,
                "--training.steps",
                "5",
                "--checkpoint.interval",
                "2",
                "--checkpoint.keep_latest_k",
                "1",
            )
        )
    ).train()
    assert complete_steps(dump / "checkpoint") == {5: "full", STEPS: "full"}
    assert later.read_bytes() == bytes(data)
    assert sorted(by_step(dump)) == [RESUME_FROM + 1, 5]  # resumed from step-3, past the corrupt step-6


# ---------------------------------------------------------------------------------------------
# Seed checkpoint and initial_load_path


def test_seed_checkpoint_starts_any_layout(matrix, tmp_path):
    seed_dump = tmp_path / "seed"
    trainer_module.Trainer(
        load_config(
            job_args("single", "fp32", seed_dump, "--checkpoint.create_seed_checkpoint", "--training.seed", "7")
        )
    ).train()
    seed = seed_dump / "checkpoint" / "step-0"
    assert complete_steps(seed_dump / "checkpoint") == {0: "seed"}
    assert not read_metrics(seed_dump)  # nothing trained
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(seed)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith("model.") for k in keys)

    short = ["--training.steps", "2"]
    x, y = tmp_path / "x", tmp_path / "y"
    launch_worker(
        "ckpt_jobs",
        tmp_path,
        [
            {"args": job_args("fsdp", "fp32", x, *short), "copy": [[str(seed), str(x / "checkpoint" / "step-0")]]},
            {"args": job_args("fsdp", "fp32", y, *short, "--checkpoint.initial_load_path", str(seed))},
        ],
        2,
    )
    rx, ry = by_step(x), by_step(y)
    assert sorted(rx) == [1, 2]
    assert_same_steps(ry, rx, [1, 2])
    # The seed's weights (training.seed 7) were used, not this job's own init (seed 0).
    assert rx[1]["loss"] != by_step(matrix("fsdp") / "fp32" / "a")[1]["loss"]
    assert complete_steps(y / "checkpoint") == {2: "full"}


# ---------------------------------------------------------------------------------------------
# Bad input: one-line errors, nothing saved is touched


def test_missing_load_step_is_a_one_line_error(matrix):
    folder = matrix("single") / "bf16" / "a" / "checkpoint"
    before = snapshot(folder)
    proc = launch_train(
        job_args(
            "single",
            "bf16",
            folder.parent / "other",
            "--checkpoint.folder",
            str(folder),
            "--checkpoint.load_step",
            "99",
        ),
        1,
        check=False,
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert f"no complete checkpoint step-99 in {folder}; available steps: 3, 6" in errors[0]
    assert snapshot(folder) == before


def test_checkpoint_of_another_model_shape_names_the_key(matrix, monkeypatch):
    folder = matrix("single") / "bf16" / "a" / "checkpoint"
    flavors = get_family("llama3").flavors  # BASE's flavor, narrowed for this run only
    monkeypatch.setitem(flavors, "debugmodel_tiny", dataclasses.replace(flavors["debugmodel_tiny"], dim=32))
    before = snapshot(folder)
    with pytest.raises(CheckpointError) as e:
        trainer_module.Trainer(
            load_config(job_args("single", "bf16", folder.parent / "other", "--checkpoint.folder", str(folder)))
        )
    assert "'tok_embeddings.weight' has shape (258, 64) in the checkpoint but (258, 32) in the model" in str(e.value)
    assert "\n" not in str(e.value)
    assert snapshot(folder) == before


def test_unwritable_checkpoint_folder(tmp_path):
    dump = tmp_path / "job"
    dump.mkdir()
    (dump / "checkpoint").write_text("a file where the folder should be")
    with pytest.raises(CheckpointError, match=r"checkpoint folder .*checkpoint is not writable"):
        trainer_module.Trainer(load_config(job_args("single", "fp32", dump)))
    assert (dump / "checkpoint").read_text() == "a file where the folder should be"


def test_read_only_checkpoint_folder(tmp_path):
    if os.geteuid() == 0:
        pytest.skip(
            "runs as root, which ignores permission bits: a read-only checkpoint folder "
            "cannot be made; run the suite as a non-root user to check this"
        )
    locked = tmp_path / "locked"
    (locked / "checkpoint").mkdir(parents=True)
    (locked / "checkpoint" / "keep.txt").write_text("saved")
    (locked / "checkpoint").chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="not writable: Permission denied"):
            trainer_module.Trainer(load_config(job_args("single", "fp32", locked)))
    finally:
        (locked / "checkpoint").chmod(0o755)
    assert (locked / "checkpoint" / "keep.txt").read_text() == "saved"


@pytest.mark.parametrize(
    "extra,world,message",
    [
        (["--checkpoint.async_mode", "async_with_pinned_mem"], 1, "needs CUDA"),
        (["--checkpoint.create_seed_checkpoint"], 2, "must run on one process"),
        (["--checkpoint.exclude_from_loading", "model,optimiser"], 1, "unknown state 'optimiser'"),
    ],
)
def test_checkpoint_config_errors(tmp_path, extra, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(job_args("single", "fp32", tmp_path, *extra)), world, "cpu")
