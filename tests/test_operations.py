"""Operating a run: non-finite handling, collective timeouts, progress/summary lines, profiling."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest

from tests.support.launch import WORKERS, read_metrics, run_train
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.train import trainer as trainer_mod
from torchtitan_amp.train.trainer import NonFiniteError, Trainer

pytestmark = pytest.mark.dist

# The smallest flavor: these tests are about the run's control flow, not the model.
TINY = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--mixed_precision.enabled",
    "false",
]


def _trainer(tmp_path: Path, *extra: str) -> Trainer:
    return Trainer(load_config(["--job.dump_folder", str(tmp_path), *TINY, *extra]))


def _nan_loss_at(monkeypatch: pytest.MonkeyPatch, trainer: Trainer, bad_steps: set[int]) -> None:
    real = trainer_mod.loss_fn

    def loss_fn(logits, labels, **kwargs):  # type: ignore[no-untyped-def]
        loss = real(logits, labels, **kwargs)
        return loss * math.nan if trainer.step in bad_steps else loss

    monkeypatch.setattr(trainer_mod, "loss_fn", loss_fn)


def test_nonfinite_stops_with_step_and_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path, "--training.steps", "5")
    _nan_loss_at(monkeypatch, trainer, {3})
    with pytest.raises(NonFiniteError, match=r"step 3: gradient norm is nan.*skip_nonfinite_steps"):
        trainer.train()
    # Steps 1-2 were logged; nothing of step 3 reached the optimizer.
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]


def test_skip_nonfinite_steps_counts_and_keeps_weights_and_lr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path, "--training.steps", "5", "--training.skip_nonfinite_steps")
    _nan_loss_at(monkeypatch, trainer, {2, 3})
    snapshots = {}
    step_fn = trainer.train_step

    def recording_step(batches):  # type: ignore[no-untyped-def]
        before = [p.detach().clone() for p in trainer.run.params]
        lr = trainer.run.lr_scheduler.get_last_lr()[0]
        out = step_fn(batches)
        snapshots[trainer.step] = (before, [p.detach().clone() for p in trainer.run.params], lr)
        return out

    trainer.train_step = recording_step  # type: ignore[method-assign]
    trainer.train()
    assert trainer.nonfinite_skipped == 2
    for step in (2, 3):
        before, after, _ = snapshots[step]
        assert all((a == b).all() for a, b in zip(before, after)), f"step {step} changed weights"
    # The schedule did not advance on skipped steps: step 4 uses the LR step 2 would have used.
    assert snapshots[4][2] == snapshots[2][2]
    rows = read_metrics(tmp_path)
    assert rows[-1]["nonfinite_skipped"] == 2 and math.isfinite(rows[-1]["loss"])


def test_progress_eta_summary_and_timing_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        _trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "2").train()
    text = caplog.text
    assert "progress: 2/4 steps" in text and "eta: " in text
    assert "summary: 4 steps, 256 tokens, mean tps" in text and "checkpoints written 0" in text
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 4]  # the first step, then every log_freq
    assert all(r["step_time_s"] > 0 and r["data_time_s"] >= 0 for r in rows)


def test_profiler_writes_traces_on_schedule(tmp_path: Path) -> None:
    _trainer(tmp_path, "--training.steps", "6", "--profiling.enable_profiling", "--profiling.profile_freq", "3").train()
    traces = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "profile_traces").rglob("*.json"))
    assert traces == ["profile_traces/iteration_3/rank0_trace.json", "profile_traces/iteration_6/rank0_trace.json"]
    assert json.loads((tmp_path / traces[0]).read_text())["traceEvents"]


def test_profiling_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enable_memory_snapshot' needs CUDA"):
        _trainer(tmp_path, "--profiling.enable_memory_snapshot")
    with pytest.raises(ConfigError, match="profile_freq' must be >= 3"):
        _trainer(tmp_path, "--profiling.profile_freq", "2")
    with pytest.raises(ConfigError, match="timeout_seconds' must be >= 1"):
        load_config(["--comm.timeout_seconds", "0"])


def test_hung_rank_ends_the_job_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 stops at step 3; rank 0's next collective fails after comm.timeout_seconds and the
    job exits non-zero instead of hanging (the worker would otherwise sleep 600 s)."""
    begin = time.monotonic()
    res = run_train(
        tmp_path,
        2,
        *TINY,
        "--training.steps",
        "6",
        "--comm.timeout_seconds",
        "5",
        script=WORKERS / "hang_worker.py",
        timeout=180,
    )
    elapsed = time.monotonic() - begin
    assert res.returncode != 0, res.describe()
    assert elapsed < 150, f"took {elapsed:.0f} s"
    assert "timed out" in res.output.lower() or "timeout" in res.output.lower(), res.describe()
    assert [r["step"] for r in res.metrics] == [1, 2]
