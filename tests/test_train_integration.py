"""End-to-end training on CPU + gloo: 1 and 2 processes, FSDP and DDP, the launcher script,
gradient accumulation, and what users see for bad data.

Launches are the expensive part (~5 s each), so each one checks several things.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.inputs import TINY
from tests.support.launch import REPO, WORKERS, assert_loss_falls, new_dump_folder, run_command, run_python, run_train
from torchtitan_amp.config import load_config

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

REQUIRED_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"}
DDP = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
FP32 = ("--mixed_precision.enabled", "false")
STEPS = 10


def assert_metrics_rows(rows: list[dict], steps: int, first: int = 1) -> None:
    assert [r["step"] for r in rows] == list(range(first, steps + 1))
    for row in rows:
        assert REQUIRED_KEYS <= row.keys(), row
        for key in REQUIRED_KEYS:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)
        assert row["tps"] > 0 and row["memory_gib"] > 0 and row["lr"] > 0
    assert all(a["elapsed_s"] < b["elapsed_s"] for a, b in zip(rows, rows[1:]))


def launcher(tmp_path: Path, *args: str, ngpu: int | None = None, timeout: float = 300):
    """./run_llama_train.sh with the test's interpreter (so it needs no ./.venv)."""
    env = {"PYTHON": sys.executable}
    if ngpu is not None:
        env["NGPU"] = str(ngpu)
    dump = new_dump_folder(tmp_path)
    return run_command(
        ["./run_llama_train.sh", "--job.dump_folder", str(dump), *args], timeout=timeout, env=env, dump_folder=dump
    )


def rows_of(x: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(r) for r in x.tolist()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def load_ranks(folder: Path, world: int = 2) -> list[dict]:
    return [torch.load(folder / f"first_step_rank{r}.pt", weights_only=False) for r in range(world)]


# ---------------------------------------------------------------------------------------------
# Single-process reference, in this process (no torchrun, no process group)


def first_step_in_process(dump: Path, *overrides: str) -> dict:
    from torchtitan_amp.train.trainer import Trainer

    with pytest.MonkeyPatch.context() as mp:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(key, raising=False)
        trainer = Trainer(load_config([*TINY, "--job.dump_folder", str(dump), *overrides]))
    seen: list[torch.Tensor] = []

    def recording(it):
        for inputs, labels in it:
            seen.append(inputs)
            yield inputs, labels

    try:
        loss, grad_norm, _ = trainer.train_step(recording(iter(trainer.run.dataloader)))
        grads = {n: p.grad.detach().clone() for n, p in trainer.run.model.named_parameters()}
    finally:
        trainer.run.metrics.close()
    return {
        "accum": trainer.run.accum,
        "loss": float(loss),
        "grad_norm": float(grad_norm),
        "grads": grads,
        "inputs": torch.cat(seen),
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """fp32, one process, one batch of 8 sequences, no clipping: the first step's loss and grads."""
    return first_step_in_process(
        tmp_path_factory.mktemp("reference"),
        *FP32,
        "--training.max_norm",
        "0",
        "--training.local_batch_size",
        "8",
        "--training.steps",
        "1",
    )


def test_gradient_accumulation_matches_one_big_batch(tmp_path: Path, reference: dict) -> None:
    accum = first_step_in_process(
        tmp_path,
        *FP32,
        "--training.max_norm",
        "0",
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "8",
        "--training.steps",
        "1",
    )
    assert (accum["accum"], reference["accum"]) == (2, 1)
    assert torch.equal(accum["inputs"], reference["inputs"]), "two micro-batches of 4 = the batch of 8"
    assert accum["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert accum["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    for name, grad in reference["grads"].items():
        assert rel_err(accum["grads"][name], grad) < 1e-5, name


# ---------------------------------------------------------------------------------------------
# torchrun runs


def test_single_process_run(tmp_path: Path) -> None:
    result = run_train(tmp_path, 1, *TINY, "--training.steps", str(STEPS), "--job.print_config")
    assert result.returncode == 0, result.describe()
    assert_metrics_rows(result.metrics, STEPS)
    assert_loss_falls(result.metrics)
    # warm-up 2 steps to lr 3e-3, then linear decay to 0 at step 10.
    lrs = [r["lr"] for r in result.metrics]
    assert lrs[:3] == pytest.approx([1e-3, 2e-3, 3e-3]) and lrs[-1] == pytest.approx(3e-3 / 8)
    # --job.print_config prints the resolved config, CLI overrides included.
    assert "resolved config" in result.stdout and "[training]" in result.stdout
    assert "seq_len = 64" in result.stdout and "steps = 10" in result.stdout
    assert "step:" in result.stdout and "summary: 10 steps" in result.stdout
    assert (result.dump_folder / "precision_report.json").is_file()
    assert "Traceback" not in result.output


def test_two_process_fsdp_with_launcher(tmp_path: Path) -> None:
    """NGPU=2 ./run_llama_train.sh on CPU: two gloo ranks, FSDP (the default layout)."""
    result = launcher(tmp_path, *TINY, "--training.steps", str(STEPS), ngpu=2)
    assert result.returncode == 0, result.describe()
    assert "world size 2" in result.stdout
    report = json.loads((result.dump_folder / "precision_report.json").read_text())
    # The default precision follows the CPU: bf16 through FSDP's policy where bf16 is native.
    assert report["path"] == ("fsdp" if report["low_precision_matmul"]["native"] else "full"), report
    assert_metrics_rows(result.metrics, STEPS)
    assert_loss_falls(result.metrics)


def test_two_process_ddp(tmp_path: Path) -> None:
    """DDP: ranks see different data, gradients after the all-reduce are identical on both ranks
    and equal the mean of the per-rank gradients; the loss falls over a short run."""
    result = run_train(
        tmp_path,
        2,
        *TINY,
        *DDP,
        "--training.steps",
        str(STEPS),
        "--training.max_norm",
        "0",
        script=WORKERS / "first_step.py",
        env={"WORKER_TRAIN": "1"},
    )
    assert result.returncode == 0, result.describe()
    r0, r1 = load_ranks(result.dump_folder)
    assert r0["ddp"] and not r0["fsdp"] and r0["world_size"] == 2

    assert r0["batch_sha256"] != r1["batch_sha256"]
    assert not rows_of(r0["inputs"]) & rows_of(r1["inputs"]), "ranks must see disjoint sequences"

    assert r0["grads"].keys() == r1["grads"].keys() == r0["local_grads"].keys()
    assert len(r0["grads"]) > 0
    local_differs = 0
    for name, g0 in r0["grads"].items():
        g1, l0, l1 = r1["grads"][name], r0["local_grads"][name], r1["local_grads"][name]
        assert torch.equal(g0, g1), f"{name}: gradients differ across ranks after the all-reduce"
        local_differs += not torch.equal(l0, l1)
        torch.testing.assert_close(g0, (l0 + l1) / 2, rtol=1e-5, atol=1e-8, msg=f"{name}: not the mean")
    assert local_differs == len(r0["grads"]), "different data must give different local gradients"
    assert r0["grad_norm"] == r1["grad_norm"] > 0

    assert_metrics_rows(result.metrics, STEPS, first=2)  # the worker ran step 1 itself
    assert_loss_falls(result.metrics)


def test_two_process_fsdp_matches_single_process(tmp_path: Path, reference: dict) -> None:
    """fp32 FSDP on 2 ranks x 4 sequences = one process on the same 8 sequences: same data,
    same loss; each rank's own gradient shard is its half (FSDP2 shards dim 0 as torch.chunk
    does) of the single process's gradient, and the gathered gradients equal it."""
    result = run_train(
        tmp_path, 2, *TINY, *FP32, "--training.steps", "1", "--training.max_norm", "0", script=WORKERS / "first_step.py"
    )
    assert result.returncode == 0, result.describe()
    r0, r1 = load_ranks(result.dump_folder)
    assert r0["fsdp"] and r0["world_size"] == 2

    assert r0["batch_sha256"] != r1["batch_sha256"]
    assert not rows_of(r0["inputs"]) & rows_of(r1["inputs"])
    assert rows_of(r0["inputs"]) | rows_of(r1["inputs"]) == rows_of(reference["inputs"])

    assert (r0["loss"] + r1["loss"]) / 2 == pytest.approx(reference["loss"], rel=1e-5)
    assert r0["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    assert r0["grads"].keys() == reference["grads"].keys()
    for name, ref in reference["grads"].items():
        # What each rank holds after the reduce-scatter, against the reference: a gathered copy
        # is the same all-gather on both ranks and could not differ between them.
        for rank, r in enumerate((r0, r1)):
            assert rel_err(r["shard_grads"][name], ref.chunk(2)[rank]) < 1e-5, (name, rank)
        assert rel_err(r0["grads"][name], ref) < 1e-5, name


# ---------------------------------------------------------------------------------------------
# The launcher as users run it


def test_launcher_default_debug_run(tmp_path: Path) -> None:
    # 3 steps, not more: each step of the shipped debug config costs seconds on a busy 2-core CPU.
    result = launcher(tmp_path, "--training.steps", "3")
    assert result.returncode == 0, result.describe()
    assert "step:   1" in result.stdout and "step:   3" in result.stdout
    assert "summary: 3 steps" in result.stdout
    assert [r["step"] for r in result.metrics] == [1, 3]  # log_freq 10: the first and the last step


def test_launcher_rejects_bad_override_in_one_line(tmp_path: Path) -> None:
    result = launcher(tmp_path, "--training.stepz", "5", ngpu=2)
    assert result.returncode == 2, result.describe()
    assert result.stderr.strip().splitlines() == [
        "error: unknown config key 'training.stepz'; did you mean 'training.steps'?"
    ]
    assert "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------
# Bad data: exit code 2, one line


def test_train_py_rejects_missing_dataset(tmp_path: Path) -> None:
    result = run_python(
        "train.py",
        "--training.dataset",
        f"path:{tmp_path / 'missing'}",
        "--training.seq_len",
        "16",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    )
    assert result.returncode == 2, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "does not exist" in lines[0], result.describe()
    assert "Traceback" not in result.output


def test_trainer_rejects_non_utf8_dataset(tmp_path: Path) -> None:
    from torchtitan_amp.data import DataError
    from torchtitan_amp.train.trainer import Trainer

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait ".encode("latin-1") * 100)
    with pytest.MonkeyPatch.context() as mp:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(key, raising=False)
        config = load_config(
            [
                "--training.dataset",
                f"path:{bad}",
                "--training.seq_len",
                "16",
                "--job.dump_folder",
                str(tmp_path / "dump"),
            ]
        )
        with pytest.raises(DataError, match="is not valid UTF-8") as info:
            Trainer(config)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# The fresh-machine story of scripts/ensure_env.sh (opt-in: it installs torch, minutes)


@pytest.mark.skipif(
    os.environ.get("TORCHTITAN_AMP_TEST_FRESH_ENV") != "1",
    reason="set TORCHTITAN_AMP_TEST_FRESH_ENV=1 to install torch into a fresh venv",
)
def test_ensure_env_sets_up_a_bare_python(tmp_path: Path) -> None:
    """A Python without any dependency: ./.venv is created with torch==2.13.0 and requirements.txt,
    isolated from the system site-packages, and reused by the next call."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns(".git", ".venv", "outputs", ".pytest_cache"))
    bare = tmp_path / "bare"
    assert run_python("-m", "venv", str(bare), timeout=120).returncode == 0
    bare_python = str(bare / "bin" / "python")
    assert run_command([bare_python, "-c", "import torch"], timeout=60).returncode != 0
    show = [
        "bash",
        "-c",
        'source scripts/ensure_env.sh && echo "PYTHON=$PYTHON" && "$PYTHON" -c '
        '"import torch, sys; print(torch.__version__, sys.prefix)"',
    ]
    first = run_command(show, timeout=1800, env={"PYTHON": bare_python}, cwd=repo)
    assert first.returncode == 0, first.describe()
    assert f"PYTHON={repo}/.venv/bin/python" in first.stdout and "2.13.0" in first.stdout
    assert "setting up" in first.stderr
    assert "include-system-site-packages = false" in (repo / ".venv" / "pyvenv.cfg").read_text()
    again = run_command(show, timeout=120, env={"PYTHON": bare_python}, cwd=repo)
    assert again.returncode == 0 and "setting up" not in again.stderr, again.describe()
    assert f"PYTHON={repo}/.venv/bin/python" in again.stdout
