"""Training metrics: throughput, MFU, memory, and their sinks (log line, JSONL, the trackers of
trackers.py: TensorBoard, Weights & Biases); the run's step times, progress line and end-of-run
summary."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterable

import torch

from torchtitan_amp.core.matmul_speed import cpu_matmul_flops, gpu_peak_flops, measure_cpu_matmul_flops
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.observability.trackers import TensorBoardTracker, Tracker

logger = logging.getLogger("torchtitan_amp")

_GIB = 2**30
_JSONL_NAME = "metrics.jsonl"
_SAMPLES_NAME = "samples.jsonl"


def peak_flops(device: torch.device, dtypes: Iterable[torch.dtype]) -> float:
    """Per-device peak FLOP/s used as the MFU denominator; `dtypes`: those the step computes in."""
    if device.type == "cuda":
        # dtypes are deliberately ignored: like torchtitan, MFU is always relative to the bf16
        # tensor-core peak, so fp32 (TF32) runs show the utilization they leave on the table
        # instead of looking efficient against a lower ceiling.
        return gpu_peak_flops(torch.cuda.get_device_name(device))
    if device.type == "cpu":
        # The fastest of the step's dtypes: a bf16-autocast step still runs its fp32 islands, and
        # on a CPU that emulates bf16 the fp32 rate is the ceiling (the bf16 rate alone made MFU
        # read 106% there).
        return max(cpu_matmul_flops(d, torch.get_num_threads()) for d in set(dtypes))
    raise ValueError(f"peak_flops: unsupported device type {device.type!r}")


def peak_label(device: torch.device, dtypes: Iterable[torch.dtype]) -> str:
    """Where peak_flops(device, dtypes) comes from, for the log."""
    if device.type == "cuda":
        return f"bf16 tensor-core peak of {torch.cuda.get_device_name(device)}"
    names = "/".join(sorted(dtype_name(d) for d in set(dtypes)))
    return f"best measured {names} matmul on this {device.type.upper()}"


def remeasure_cpu_peak(dtypes: Iterable[torch.dtype]) -> float:
    """A fresh measurement (no cache), for when the first one was beaten by a real step."""
    return max(measure_cpu_matmul_flops(d) for d in set(dtypes))


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the last reset_peak_memory (CUDA) or process start (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / _GIB
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS.
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024
    return rss_bytes / _GIB


def reset_peak_memory(device: torch.device) -> None:
    # Peak RSS on CPU cannot be reset by the process, so CPU peaks are lifetime peaks.
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class StepMetrics:
    step: int
    loss: float
    grad_norm: float
    lr: float
    tps: float
    tflops: float
    mfu: float
    memory_gib: float
    elapsed_s: float
    extra: dict[str, float] = field(default_factory=dict)


# Fixed order of the built-in fields in every sink; extras follow them.
_BASE_KEYS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name != "extra")


class MetricsLogger:
    """Turns per-step scalars into throughput/MFU and writes them to every enabled sink.

    Every rank must call record_tokens and log so that interval counters stay in step;
    only the logging rank writes anything.
    """

    def __init__(
        self,
        dump_folder: str | Path,
        *,
        log_freq: int,
        enable_tensorboard: bool,
        tensorboard_folder: str = "tb",
        is_logging_rank: bool,
        flops_per_token: float,
        peak_flops: float,
        device: torch.device,
        num_ranks_for_mfu: int = 1,
        peak_label: str = "",
        remeasure_peak: Callable[[], float] | None = None,
        trackers: Sequence[Tracker] = (),
    ) -> None:
        """num_ranks_for_mfu: ranks that jointly process the same tokens (TP x PP x CP degree),
        so one device does only 1/num_ranks_for_mfu of the FLOPs of the tokens it records.
        peak_label: where peak_flops comes from (e.g. "best measured fp32/bf16 matmul"), for the
        log. remeasure_peak: called once if a step beats peak_flops (a start-up measurement
        taken while the machine was busy): MFU is never above 100%. trackers: where each logged
        step's scalars also go (the logging rank's; trackers.build_trackers), besides a
        TensorBoard one that enable_tensorboard adds; closed by close()."""
        if log_freq < 1:
            raise ValueError(f"log_freq must be >= 1, got {log_freq}")
        if num_ranks_for_mfu < 1:
            raise ValueError(f"num_ranks_for_mfu must be >= 1, got {num_ranks_for_mfu}")
        self._log_freq = log_freq
        self._is_logging_rank = is_logging_rank
        self._flops_per_token = float(flops_per_token)
        self._peak_flops = float(peak_flops)
        self._peak_label = peak_label
        self._remeasure_peak = remeasure_peak
        self._device = device
        self._num_ranks_for_mfu = num_ranks_for_mfu

        self._start_time = time.perf_counter()
        self._last_log_time = self._start_time
        self._tokens_since_log = 0
        # The training loop's run (start_run): step times, progress and the end-of-run summary.
        self._run_start: float | None = None
        self._total_steps = 0
        self._first_step = 0
        self._last_logged_step = 0
        self._logged: list[StepMetrics] = []

        self._samples_path = Path(dump_folder) / _SAMPLES_NAME  # log_samples appends there
        self._jsonl: IO[str] | None = None
        self._trackers: list[Tracker] = []
        if is_logging_rank:
            folder = Path(dump_folder)
            folder.mkdir(parents=True, exist_ok=True)
            # Append so a resumed run continues the same history instead of truncating it.
            self._jsonl = open(folder / _JSONL_NAME, "a", encoding="utf-8")
            self._trackers = list(trackers)
            if enable_tensorboard:
                self._trackers.append(TensorBoardTracker(folder / tensorboard_folder))

    def start_run(self, first_step: int, total_steps: int) -> None:
        """The training loop starts after `first_step` (0, or the step a run resumed from) and
        ends at `total_steps`: from now on intervals are measured from here, each log line is
        followed by a progress line, and `log_summary` reports the run."""
        now = time.perf_counter()
        self._run_start = self._last_log_time = now
        self._first_step = self._last_logged_step = first_step
        self._total_steps = total_steps
        self._logged = []

    def step_time_s(self, step: int) -> float:
        """Mean time of the steps since the last log (or the run's start) up to `step`."""
        now = time.perf_counter()
        return (now - self._last_log_time) / max(step - self._last_logged_step, 1)

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` spent outside training (an evaluation) out of the current interval's
        throughput, MFU and step time."""
        self._last_log_time += seconds

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self._log_freq == 0

    def record_tokens(self, n: int) -> None:
        self._tokens_since_log += n

    def log(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> StepMetrics | None:
        # Validated on every rank so a bad call fails everywhere instead of hanging the others.
        extra = {k: float(v) for k, v in (extra or {}).items()}
        clashing = extra.keys() & set(_BASE_KEYS)
        if clashing:
            raise ValueError(f"extra metrics clash with built-in keys: {sorted(clashing)}")

        now = time.perf_counter()
        interval_s = now - self._last_log_time
        tokens = self._tokens_since_log
        self._last_log_time = now
        self._last_logged_step = step
        self._tokens_since_log = 0
        if not self._is_logging_rank:
            return None

        tps = tokens / interval_s if interval_s > 0 else 0.0
        device_flops = tps * self._flops_per_token / self._num_ranks_for_mfu
        if device_flops > self._peak_flops:
            self._raise_peak(device_flops)
        metrics = StepMetrics(
            step=step,
            loss=float(loss),
            grad_norm=float(grad_norm),
            lr=float(lr),
            tps=tps,
            tflops=device_flops / 1e12,
            mfu=100.0 * device_flops / self._peak_flops,
            memory_gib=peak_memory_gib(self._device),
            elapsed_s=now - self._start_time,
            extra=extra,
        )
        # Each line reports the peak of its own interval rather than of the whole run.
        reset_peak_memory(self._device)

        logger.info(_format_line(metrics))
        self._write_jsonl(metrics)
        scalars = {k: v for k, v in _flat_items(metrics) if k != "step"}
        for tracker in self._trackers:
            tracker.log_scalars(step, scalars)
        if self._run_start is not None:
            self._logged.append(metrics)
            steps_done = step - self._first_step
            if steps_done:
                run_s = now - self._run_start
                remaining = run_s / steps_done * (self._total_steps - step)
                logger.info("progress: %d/%d steps, elapsed %s, eta: %s", step, self._total_steps,
                            _hms(run_s), _hms(remaining))
        return metrics

    @property
    def peak_flops(self) -> float:
        return self._peak_flops

    def _raise_peak(self, achieved: float) -> None:
        """A step ran faster than the peak: the peak measurement was too low. Measure again once;
        what a step achieved is a lower bound of the peak in any case."""
        old = self._peak_flops
        if self._remeasure_peak is not None:
            self._peak_flops = max(self._peak_flops, self._remeasure_peak())
            self._remeasure_peak = None
        self._peak_flops = max(self._peak_flops, achieved)
        logger.warning("a step reached %.1f GFLOP/s, above the peak measured at start-up (%.1f "
                       "GFLOP/s): measured again, MFU now relative to %.1f GFLOP/s",
                       achieved / 1e9, old / 1e9, self._peak_flops / 1e9)

    def log_summary(self, steps: int, tokens: int, checkpoints: int) -> None:
        """The end-of-run line (logging rank): means over the logged steps of this run, leaving
        out the first step's start-up (compile, first all-gathers) when there is more."""
        if not self._is_logging_rank or self._run_start is None:
            return
        wall_s = time.perf_counter() - self._run_start
        steady = [m for m in self._logged if m.step > self._first_step + 1] or self._logged
        mean = lambda key: sum(getattr(m, key) for m in steady) / max(len(steady), 1)  # noqa: E731
        peak = max((m.memory_gib for m in self._logged), default=0.0)
        logger.info("summary: %d steps, %s tokens, mean tps %s, mean mfu %.2f%%, peak memory %.2fGiB, "
                    "wall time %s, checkpoints written %d, mfu peak %s", steps, f"{tokens:,}",
                    f"{mean('tps'):,.0f}", mean("mfu"), peak, _hms(wall_s), checkpoints, self.describe_peak())

    def describe_peak(self) -> str:
        rate = f"{self._peak_flops / 1e12:.3g} TFLOP/s"
        return f"{rate} ({self._peak_label})" if self._peak_label else rate

    def describe_run(self, config: Mapping[str, Any], files: Sequence[Path]) -> None:
        """Hand every tracker the run's config and files (logging rank; a no-op elsewhere)."""
        for tracker in self._trackers:
            tracker.log_config(config)
            for path in files:
                tracker.attach_file(path)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text (e.g. generated samples) to every tracker at `step` (logging rank)."""
        for tracker in self._trackers:
            tracker.log_text(step, tag, text)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Generated continuations (generation.record's dicts; validation.sample_prompts): one log
        line each, one `samples.jsonl` line each with the step, text to every tracker. Logging rank only."""
        if not self._is_logging_rank:
            return
        with open(self._samples_path, "a", encoding="utf-8") as f:
            for i, sample in enumerate(samples):
                logger.info("step %d sample %d: %r -> %r", step, i, sample["prompt"], sample["text"])
                f.write(json.dumps({"step": step, **sample}) + "\n")
                self.log_text(step, f"samples/{i}", sample["prompt"] + sample["text"])

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.close()

    def _write_jsonl(self, metrics: StepMetrics) -> None:
        assert self._jsonl is not None
        record = {k: _json_number(v) for k, v in _flat_items(metrics)}
        # allow_nan=False keeps the file strict JSON; non-finite values are already null.
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        # Flush per line so a crash or kill loses at most the line being written.
        self._jsonl.flush()


def _hms(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _format_line(m: StepMetrics) -> str:
    line = (
        f"step: {m.step:3d}  loss: {m.loss:7.4f}  grad_norm: {m.grad_norm:7.4f}  "
        f"lr: {m.lr:.4e}  memory: {m.memory_gib:5.2f}GiB  tps: {m.tps:,.0f}  "
        f"tflops: {m.tflops:,.2f}  mfu: {m.mfu:.2f}%"
    )
    extras = "".join(f"  {k}: {_format_extra(v)}" for k, v in m.extra.items())
    return line + extras


def _format_extra(value: float) -> str:
    # Counters and power-of-two loss scales read best as plain integers ("65536", not "6.554e+04").
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _flat_items(m: StepMetrics) -> list[tuple[str, float]]:
    return [(k, getattr(m, k)) for k in _BASE_KEYS] + list(m.extra.items())


def _json_number(value: float) -> float | None:
    # JSON has no NaN/Infinity; null keeps the line parseable by strict readers.
    return value if math.isfinite(value) else None
