"""The test-only tiny_gelu family (tests/families/tiny_gelu: Llama blocks with a GELU MLP, one
registration) goes through the same generic code as Llama 3: it trains on 1 process and on 2
(FSDP, TP), resumes a checkpoint bitwise, dry-runs with the analytic state matching the meta
model, and round-trips a Hugging Face export/import."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.families import tiny_gelu
from tests.support.launch import assert_loss_falls, by_step, run_python, run_train
from torchtitan_amp.models import FAMILIES

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).resolve().parent / "families" / "train_tiny_gelu.py"
ARGS = (
    "--model.name",
    "tiny_gelu",
    "--model.flavor",
    "tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--mixed_precision.enabled",
    "false",
)
STEPS, RESUME_FROM = 6, 3
CKPT = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", str(RESUME_FROM))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One single-process run of STEPS steps with checkpoints every RESUME_FROM steps."""
    result = run_train(tmp_path_factory.mktemp("a"), 1, *ARGS, *CKPT, script=SCRIPT)
    assert result.returncode == 0, result.describe()
    return result.dump_folder


def test_tiny_gelu_trains_on_one_process(trained: Path) -> None:
    """The checkpointed run's own curve: one launch serves this and the resume / export tests."""
    rows = [by_step(trained)[s] for s in range(1, STEPS + 1)]
    assert_loss_falls(rows)


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallelism.data_parallel_shard_degree", "2"),
        ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"),
    ],
    ids=["fsdp", "tp"],
)
def test_tiny_gelu_trains(tmp_path: Path, layout: tuple[str, ...]) -> None:
    result = run_train(tmp_path, 2, *ARGS, "--training.steps", "10", *layout, script=SCRIPT)
    assert result.returncode == 0, result.describe()
    assert_loss_falls(result.metrics)


def test_tiny_gelu_resumes_bitwise(trained: Path, tmp_path: Path) -> None:
    dump = tmp_path / "b"
    shutil.copytree(trained / "checkpoint" / f"step-{RESUME_FROM}", dump / "checkpoint" / f"step-{RESUME_FROM}")
    result = run_train(tmp_path, 1, *ARGS, *CKPT, "--job.dump_folder", str(dump), script=SCRIPT)
    assert result.returncode == 0, result.describe()
    a, b = by_step(trained), by_step(dump)
    assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1))
    for step in b:
        assert b[step]["loss"] == a[step]["loss"], step


def test_tiny_gelu_dry_run(tmp_path: Path) -> None:
    result = run_python(
        str(SCRIPT),
        "--job.dump_folder",
        str(tmp_path),
        *ARGS,
        "--job.dry_run",
        "--dry_run.world_size",
        "4",
        "--parallelism.tensor_parallel_degree",
        "2",
        timeout=120,
    )
    assert result.returncode == 0, result.describe()
    report = json.loads((tmp_path / "dry_run.json").read_text())
    assert report["model"]["total_params"] == 123456
    assert report["memory"]["analytic_state_matches"]


def test_tiny_gelu_hf_round_trip(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Export the last checkpoint as a Hugging Face folder and import it into a fresh model: the
    same tensors, through checkpoint/hf.py's generic code and the family's adapter."""
    from torchtitan_amp.checkpoint.format import export_checkpoint
    from torchtitan_amp.checkpoint.hf import check_config, export_hf, load_hf

    monkeypatch.setitem(FAMILIES, "tiny_gelu", tiny_gelu.FAMILY)
    step = trained / "checkpoint" / f"step-{STEPS}"
    out = export_hf(step, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_act"], cfg["intermediate_size"]) == ("gelu", 256)
    family = tiny_gelu.FAMILY
    args = family.build_args("tiny", 258, 32)
    check_config(out, args, "tiny", family)
    with torch.device("meta"):
        model = family.build_model(args)
    model.to_empty(device="cpu")
    load_hf(model, out, args, complete_model=True, family=family)
    expected = torch.load(export_checkpoint(step, tmp_path / "model.pt"), weights_only=True)
    got = model.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
