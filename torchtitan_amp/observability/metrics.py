"""Training metrics on every rank: the device's peak FLOP/s and memory, and `MetricsLogger`, which
times the intervals between logged steps, computes their throughput and MFU (step_metrics.py,
no I/O), logs the step line, and hands every logged step to its sinks: metrics.jsonl and the
trackers of trackers.py (TensorBoard, Weights & Biases). It also times the run for the progress
line and the end-of-run summary."""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from torchtitan_amp.core.matmul_speed import cpu_matmul_flops, gpu_peak_flops, measure_cpu_matmul_flops
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.observability.step_metrics import (
    RunSummary,
    StepMetrics,
    checked_extra,
    format_line,
    format_progress,
    scalars,
    throughput,
)
from torchtitan_amp.observability.trackers import JsonlTracker, TensorBoardTracker, Tracker

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
    # All of this process's threads (what peak_flops measured with), where the start-up precision
    # line's "native" check timed one thread.
    return f"best measured {names} matmul on this {device.type.upper()}, {torch.get_num_threads()} threads"


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


class MetricsLogger:
    """Turns per-step scalars into throughput/MFU, logs the step line and writes the step to every
    sink: metrics.jsonl, the trackers it is given, TensorBoard when enable_tensorboard.

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
        step's scalars also go (the logging rank's; trackers.build_trackers), after
        <dump_folder>/metrics.jsonl and before a TensorBoard one that enable_tensorboard adds;
        all closed by close()."""
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

        folder = Path(dump_folder)
        self._samples_path = folder / _SAMPLES_NAME  # log_samples appends there
        self._sinks: list[Tracker] = []
        if is_logging_rank:
            self._sinks = [JsonlTracker(folder / _JSONL_NAME), *trackers]
            if enable_tensorboard:
                self._sinks.append(TensorBoardTracker(folder / tensorboard_folder))

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
        """Close the interval at `step`: its metrics on the logging rank (logged, written to
        every sink, returned), None elsewhere.

        Args:
            step: the step that closes the interval.
            loss: the step's loss.
            grad_norm: the step's gradient norm before clipping.
            lr: the learning rate the step used.
            extra: further metrics of the step by name (validation, MoE load, ...); None: none.
        """
        # Validated on every rank so a bad call fails everywhere instead of hanging the others.
        extra = checked_extra(extra)
        now = time.perf_counter()
        interval_s = now - self._last_log_time
        tokens = self._tokens_since_log
        self._last_log_time = now
        self._last_logged_step = step
        self._tokens_since_log = 0
        if not self._is_logging_rank:
            return None

        rate = throughput(tokens, interval_s, self._flops_per_token, self._num_ranks_for_mfu)
        if rate.device_flops > self._peak_flops:
            self._raise_peak(rate.device_flops)
        metrics = StepMetrics(
            step=step,
            loss=float(loss),
            grad_norm=float(grad_norm),
            lr=float(lr),
            tps=rate.tps,
            tflops=rate.device_flops / 1e12,
            mfu=rate.mfu(self._peak_flops),
            memory_gib=peak_memory_gib(self._device),
            elapsed_s=now - self._start_time,
            extra=extra,
        )
        # Each line reports the peak of its own interval rather than of the whole run.
        reset_peak_memory(self._device)

        logger.info(format_line(metrics))
        values = scalars(metrics)
        for sink in self._sinks:
            sink.log_scalars(step, values)
        if self._run_start is not None:
            self._logged.append(metrics)
            progress = format_progress(step, self._total_steps, self._first_step, now - self._run_start)
            if progress is not None:
                logger.info(progress)
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
        logger.warning(
            "a step reached %.1f GFLOP/s, above the peak measured at start-up (%.1f "
            "GFLOP/s): measured again, MFU now relative to %.1f GFLOP/s",
            achieved / 1e9,
            old / 1e9,
            self._peak_flops / 1e9,
        )

    def log_summary(self, steps: int, tokens: int, checkpoints: int) -> None:
        """The end-of-run line (logging rank): step_metrics.RunSummary of this run's logged steps.

        Args:
            steps: the optimizer steps this run took.
            tokens: the tokens it trained on (this rank's).
            checkpoints: the checkpoints it saved.
        """
        if not self._is_logging_rank or self._run_start is None:
            return
        wall_s = time.perf_counter() - self._run_start
        summary = RunSummary.of(self._logged, self._first_step)
        logger.info(summary.line(steps, tokens, wall_s, checkpoints, self.describe_peak()))

    def describe_peak(self) -> str:
        rate = f"{self._peak_flops / 1e12:.3g} TFLOP/s"
        return f"{rate} ({self._peak_label})" if self._peak_label else rate

    def describe_run(self, config: Mapping[str, Any], files: Sequence[Path]) -> None:
        """Hand every sink the run's config and files (logging rank; a no-op elsewhere)."""
        for sink in self._sinks:
            sink.log_config(config)
            for path in files:
                sink.attach_file(path)

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text (e.g. generated samples) to every sink at `step` (logging rank).

        Args:
            step: the training step it belongs to.
            tag: the name it is filed under (e.g. "samples").
            text: the text, markdown where the tracker renders it.
        """
        for sink in self._sinks:
            sink.log_text(step, tag, text)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Generated continuations (generation.record's dicts; validation.sample_prompts): one log
        line each, one `samples.jsonl` line each with the step, text to every sink. Logging rank only."""
        if not self._is_logging_rank:
            return
        with open(self._samples_path, "a", encoding="utf-8") as f:
            for i, sample in enumerate(samples):
                logger.info("step %d sample %d: %r -> %r", step, i, sample["prompt"], sample["text"])
                f.write(json.dumps({"step": step, **sample}) + "\n")
                self.log_text(step, f"samples/{i}", sample["prompt"] + sample["text"])

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()
