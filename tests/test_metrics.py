import json
import logging
import math
import time
from pathlib import Path

import pytest
import torch

from tests.support.inputs import TINY
from torchtitan_amp.core import matmul_speed
from torchtitan_amp.observability import metrics, step_metrics
from torchtitan_amp.observability.metrics import MetricsLogger, peak_flops, peak_memory_gib

CPU = torch.device("cpu")
BASE_KEYS = {"step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory_gib", "elapsed_s"}


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", fake)
    return fake


def make_logger(folder: Path, **overrides) -> MetricsLogger:
    kwargs = dict(
        log_freq=10,
        enable_tensorboard=False,
        is_logging_rank=True,
        flops_per_token=6e9,
        peak_flops=60e12,
        device=CPU,
    )
    kwargs.update(overrides)
    return MetricsLogger(folder, **kwargs)


def read_jsonl(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_peak_flops_cpu_is_positive_finite_and_cached() -> None:
    first = peak_flops(CPU, [torch.float32])
    hits_before = matmul_speed.cpu_matmul_flops.cache_info().hits
    start = time.perf_counter()
    second = peak_flops(CPU, [torch.float32])
    assert time.perf_counter() - start < 0.01
    assert matmul_speed.cpu_matmul_flops.cache_info().hits == hits_before + 1
    assert first == second
    assert first > 0 and math.isfinite(first)


def test_cpu_peak_is_the_fastest_dtype_the_step_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16-autocast step on a CPU that emulates bf16 still runs fp32 at full speed: the peak is
    fp32's (the bf16 rate alone made MFU read 106% on such a CPU)."""
    rates = {torch.float32: 75e9, torch.bfloat16: 1.3e9}
    monkeypatch.setattr(metrics, "cpu_matmul_flops", lambda dtype, threads: rates[dtype])
    assert peak_flops(CPU, [torch.float32, torch.bfloat16]) == 75e9
    assert peak_flops(CPU, [torch.bfloat16]) == 1.3e9
    # The MFU peak runs on every thread of the process (the start-up precision line: one thread).
    assert metrics.peak_label(CPU, [torch.float32, torch.bfloat16]) == (
        f"best measured bfloat16/float32 matmul on this CPU, {torch.get_num_threads()} threads"
    )


def test_mfu_never_exceeds_100_percent_with_a_low_first_peak(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up peak came out 1000x too low (a busy machine): the first step that beats it
    triggers one fresh measurement; what a step achieved is a lower bound of the peak anyway."""
    remeasured = []

    def remeasure() -> float:
        remeasured.append(1)
        return 50e12

    logger = make_logger(tmp_path, peak_flops=60e9, remeasure_peak=remeasure, peak_label="test peak")
    logger.start_run(0, 3)
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        for step, tokens in ((1, 1000), (2, 1000), (3, 20_000)):
            logger.record_tokens(tokens)  # 6e9 FLOPs/token: 6, 6, then 120 TFLOP/s over 1 s
            clock.now += 1.0
            m = logger.log(step, 2.0, 1.0, 1e-3)
            assert m is not None and m.mfu <= 100.0
        logger.log_summary(3, 22_000, 0)
    logger.close()
    assert len(remeasured) == 1
    mfus = [r["mfu"] for r in read_jsonl(tmp_path)]
    # Step 1 beat 60 GFLOP/s -> re-measured 50 TFLOP/s; step 3 beat that -> its own 120 TFLOP/s.
    assert mfus == [pytest.approx(12.0), pytest.approx(12.0), pytest.approx(100.0)]
    assert logger.peak_flops == pytest.approx(120e12)
    assert sum("above the peak measured at start-up" in r.getMessage() for r in caplog.records) == 2
    assert caplog.records[-1].getMessage().endswith("mfu peak 120 TFLOP/s (test peak)")


def test_trainer_mfu_stays_at_most_100_percent_when_the_first_measurement_is_low(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A real run whose start-up peak measurement is absurdly low (1 kFLOP/s): the trainer's
    logger measures again and no logged MFU passes 100%; the summary names the peak it used."""
    from torchtitan_amp.config import load_config
    from torchtitan_amp.train.trainer import Trainer

    monkeypatch.setattr(metrics, "cpu_matmul_flops", lambda dtype, threads: 1e3)
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        trainer = Trainer(
            load_config(
                [
                    *TINY,
                    "--training.steps",
                    "3",
                    "--job.dump_folder",
                    str(tmp_path),
                    "--training.seq_len",
                    "16",
                    "--no-mixed_precision.enabled",
                ]
            )
        )
        trainer.train()
    threads = torch.get_num_threads()
    assert (
        f"mfu is relative to 1e-09 TFLOP/s (best measured float32 matmul on this CPU, {threads} threads)"
        in caplog.messages
    )
    mfus = [r["mfu"] for r in read_jsonl(tmp_path)]
    assert len(mfus) == 3 and all(0 < m <= 100.0 for m in mfus), mfus
    # The fresh measurement replaced the bad one (1e3): at least what a step achieved, which is
    # machine- and load-dependent (a busy 2-core machine measured under 1e9), but far above 1e6.
    assert trainer.run.metrics.peak_flops > 1e6
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("summary:"))
    assert f"(best measured float32 matmul on this CPU, {threads} threads)" in summary, summary


@pytest.mark.parametrize(
    ("device_name", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA B200", 2.25e15),
        ("AMD Instinct MI300X", 1307e12),
    ],
)
def test_peak_flops_cuda_table(monkeypatch: pytest.MonkeyPatch, device_name: str, expected: float) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == expected
    # fp32 runs are still measured against the bf16 peak.
    assert peak_flops(torch.device("cuda"), torch.float32) == expected


def test_peak_flops_unknown_gpu_falls_back_to_h100_and_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU 9000")
    with caplog.at_level(logging.WARNING, logger="torchtitan_amp"):
        assert peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
        assert peak_flops(torch.device("cuda"), torch.bfloat16) == 989e12
    warnings = [r for r in caplog.records if "Mystery GPU 9000" in r.getMessage()]
    assert len(warnings) == 1


def test_peak_memory_cpu_is_positive() -> None:
    assert peak_memory_gib(CPU) > 0


def test_should_log(tmp_path: Path) -> None:
    logger = make_logger(tmp_path, log_freq=5)
    assert [s for s in range(1, 16) if logger.should_log(s)] == [1, 5, 10, 15]
    logger.close()


@pytest.mark.parametrize("num_ranks_for_mfu", [1, 2])
def test_tps_tflops_mfu_from_recorded_tokens(tmp_path: Path, clock: FakeClock, num_ranks_for_mfu: int) -> None:
    """tps counts this rank's tokens; tflops and mfu are divided by the ranks (TP x PP x CP) that
    jointly process those tokens, tps is not."""
    logger = make_logger(tmp_path, num_ranks_for_mfu=num_ranks_for_mfu)
    logger.record_tokens(1000)
    logger.record_tokens(500)
    clock.now += 1.5
    m = logger.log(1, loss=2.0, grad_norm=1.0, lr=1e-3)
    assert m is not None
    assert m.tps == pytest.approx(1000.0)
    assert m.tflops == pytest.approx(6.0 / num_ranks_for_mfu)
    assert m.mfu == pytest.approx(10.0 / num_ranks_for_mfu)
    assert m.elapsed_s == pytest.approx(1.5)

    # Counters restart at each log, while elapsed_s keeps counting from construction.
    logger.record_tokens(8000)
    clock.now += 2.0
    m = logger.log(10, loss=2.0, grad_norm=1.0, lr=1e-3)
    assert m is not None
    assert m.tps == pytest.approx(4000.0)
    assert m.tflops == pytest.approx(24.0 / num_ranks_for_mfu)
    assert m.mfu == pytest.approx(40.0 / num_ranks_for_mfu)
    assert m.elapsed_s == pytest.approx(3.5)
    logger.close()


def test_run_step_times_progress_and_summary(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """After start_run the logger owns the run's timing: intervals start at the run (a resumed one
    at its step), a progress line follows each log line, and the summary averages the steady
    steps (the first step's start-up is left out) over the run's wall time."""
    logger = make_logger(tmp_path, log_freq=2)
    clock.now += 30.0  # construction to loop start (e.g. a checkpoint load) counts in no interval
    logger.start_run(first_step=2, total_steps=6)
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        times, logged = [], []
        for step, (seconds, tokens) in enumerate([(10.0, 1000), (2.0, 1000), (2.0, 1000), (4.0, 1000)], start=3):
            clock.now += seconds
            logger.record_tokens(tokens)
            if logger.should_log(step) or step == 6:
                times.append(logger.step_time_s(step))
                logged.append(logger.log(step, loss=2.0, grad_norm=1.0, lr=1e-3))
        logger.log_summary(steps=6, tokens=4000, checkpoints=1)
    # Steps 3-4 (10 s + 2 s), then 5-6 (2 s + 4 s).
    assert times == [pytest.approx(6.0), pytest.approx(3.0)]
    assert [m.tps for m in logged] == [pytest.approx(2000 / 12), pytest.approx(2000 / 6)]
    assert logged[0].elapsed_s == pytest.approx(42.0)  # elapsed_s still counts from construction
    lines = [r.getMessage() for r in caplog.records if r.name == "torchtitan_amp"]
    assert [x for x in lines if x.startswith("progress")] == [
        "progress: 4/6 steps, elapsed 0m12s, eta: 0m12s",
        "progress: 6/6 steps, elapsed 0m18s, eta: 0m00s",
    ]
    # Both logged steps are past the resumed run's first step: both count in the means.
    assert lines[-1] == (
        "summary: 6 steps, 4,000 tokens, mean tps 250, mean mfu 2.50%, peak memory "
        f"{max(m.memory_gib for m in logged):.2f}GiB, wall time 0m18s, checkpoints written 1, "
        "mfu peak 60 TFLOP/s"
    )
    logger.close()


def test_summary_without_start_run_or_off_the_logging_rank_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        plain = make_logger(tmp_path / "a")
        plain.log(1, 2.0, 1.0, 1e-3)
        plain.log_summary(1, 10, 0)
        other = make_logger(tmp_path / "b", is_logging_rank=False)
        other.start_run(0, 1)
        other.log(1, 2.0, 1.0, 1e-3)
        other.log_summary(1, 10, 0)
    lines = [r.getMessage() for r in caplog.records if r.name == "torchtitan_amp"]
    assert len(lines) == 1 and lines[0].startswith("step:"), lines
    plain.close()
    other.close()


def test_log_line_format(tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    logger = make_logger(tmp_path, peak_flops=100e12)
    logger.record_tokens(24690)
    clock.now += 2.0
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        logger.log(10, 5.4321, 1.2345, 3e-4, extra={"loss_scale": 65536.0, "skipped_steps": 0})
    logger.close()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "torchtitan_amp"]
    for fragment in [
        "step:  10",
        "loss:  5.4321",
        "grad_norm:  1.2345",
        "lr: 3.0000e-04",
        "GiB",
        "tps: 12,345",
        "tflops: 74.07",
        "mfu: 74.07%",
        "loss_scale: 65536",
        "skipped_steps: 0",
    ]:
        assert fragment in line, (fragment, line)


def test_jsonl_one_object_per_step_appended_across_loggers(tmp_path: Path) -> None:
    first = make_logger(tmp_path)
    first.log(1, 3.0, 1.0, 1e-3, extra={"loss_scale": 1024.0})
    first.log(10, 2.5, 0.9, 1e-3, extra={"loss_scale": 1024.0})
    first.close()
    resumed = make_logger(tmp_path)
    resumed.log(20, 2.0, 0.8, 5e-4, extra={"loss_scale": 2048.0})
    resumed.close()

    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [1, 10, 20]
    for record in records:
        assert set(record) == BASE_KEYS | {"loss_scale"}
    assert records[2]["loss"] == 2.0
    assert records[2]["loss_scale"] == 2048.0


def test_jsonl_is_flushed_before_close(tmp_path: Path) -> None:
    logger = make_logger(tmp_path)
    logger.log(1, 3.0, 1.0, 1e-3)
    assert len(read_jsonl(tmp_path)) == 1
    logger.close()


def test_non_finite_values_written_as_null(tmp_path: Path) -> None:
    logger = make_logger(tmp_path)
    m = logger.log(1, float("nan"), float("inf"), 1e-3)
    logger.close()
    assert m is not None and math.isnan(m.loss)
    (record,) = read_jsonl(tmp_path)
    assert record["loss"] is None
    assert record["grad_norm"] is None
    assert record["lr"] == 1e-3


def test_non_logging_rank_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "dump"
    logger = make_logger(folder, is_logging_rank=False, enable_tensorboard=True)
    logger.record_tokens(100)
    assert logger.log(1, 3.0, 1.0, 1e-3) is None
    logger.close()
    assert not folder.exists()


@pytest.mark.parametrize("is_logging_rank", [True, False])
def test_extra_clashing_with_builtin_key_is_rejected_on_every_rank(tmp_path: Path, is_logging_rank: bool) -> None:
    logger = make_logger(tmp_path, is_logging_rank=is_logging_rank)
    with pytest.raises(ValueError, match="loss"):
        logger.log(1, 3.0, 1.0, 1e-3, extra={"loss": 1.0})
    logger.close()


def test_tensorboard_scalars_written(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_logger(tmp_path, enable_tensorboard=True, tensorboard_folder="tb")
    logger.log(1, 3.0, 1.0, 1e-3, extra={"loss_scale": 1024.0})
    logger.log(10, 2.5, 0.9, 1e-3, extra={"loss_scale": 2048.0})
    logger.close()

    event_files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    loss = accumulator.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 3.0), (10, 2.5)]
    assert [e.value for e in accumulator.Scalars("train/loss_scale")] == [1024.0, 2048.0]


# ---------------------------------------------------------------------------------------------
# The computation without I/O (step_metrics) and metrics.jsonl as a sink


def step(n: int, tps: float, mfu: float, memory_gib: float) -> step_metrics.StepMetrics:
    return step_metrics.StepMetrics(n, 2.0, 1.0, 1e-3, tps, 0.0, mfu, memory_gib, 0.0)


def test_throughput_and_mfu_are_pure_arithmetic() -> None:
    rate = step_metrics.throughput(tokens=3000, seconds=1.5, flops_per_token=6e9, num_ranks_for_mfu=2)
    assert rate.tps == pytest.approx(2000.0) and rate.device_flops == pytest.approx(6e12)
    assert rate.mfu(60e12) == pytest.approx(10.0)
    assert step_metrics.throughput(100, 0.0, 6e9, 1) == step_metrics.Throughput(0.0, 0.0)


def test_run_summary_leaves_out_the_first_step_and_keeps_the_peak_memory() -> None:
    logged = [step(1, 10.0, 1.0, 9.0), step(2, 100.0, 10.0, 2.0), step(4, 300.0, 30.0, 3.0)]
    summary = step_metrics.RunSummary.of(logged, first_step=0)
    assert (summary.mean_tps, summary.mean_mfu, summary.peak_memory_gib) == (200.0, 20.0, 9.0)
    # Only the start-up step logged: it is the mean.
    assert step_metrics.RunSummary.of(logged[:1], first_step=0).mean_tps == 10.0
    assert summary.line(4, 12345, 3725.0, 2, "1 TFLOP/s") == (
        "summary: 4 steps, 12,345 tokens, mean tps 200, mean mfu 20.00%, peak memory 9.00GiB, "
        "wall time 1h02m, checkpoints written 2, mfu peak 1 TFLOP/s"
    )


def test_progress_line_estimates_the_rest_from_the_mean_step_time() -> None:
    assert (
        step_metrics.format_progress(4, 10, first_step=2, run_s=20.0)
        == "progress: 4/10 steps, elapsed 0m20s, eta: 1m00s"
    )
    assert step_metrics.format_progress(2, 10, first_step=2, run_s=5.0) is None


def test_jsonl_sink_writes_step_then_scalars_with_null_for_non_finite(tmp_path: Path) -> None:
    from torchtitan_amp.observability.trackers import JsonlTracker

    sink = JsonlTracker(tmp_path / "sub" / "metrics.jsonl")
    sink.log_scalars(3, {"loss": float("inf"), "lr": 1e-3, "loss_scale": 8.0})
    sink.log_text(3, "samples/0", "ignored")
    sink.close()
    sink.close()  # closing twice is harmless
    text = (tmp_path / "sub" / "metrics.jsonl").read_text()
    assert text == '{"step": 3, "loss": null, "lr": 0.001, "loss_scale": 8.0}\n'
