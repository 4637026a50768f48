"""What a logged step reports, computed without I/O or clocks: throughput and MFU from an
interval's tokens and seconds, the run's progress and end-of-run means, and the text of the log,
progress and summary lines. metrics.MetricsLogger reads the clock and the device's memory, calls
these, and hands the result to its sinks (trackers.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


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
BASE_KEYS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name != "extra")


@dataclass(frozen=True)
class Throughput:
    """One interval on one device: tokens per second of this rank, FLOP/s of this device."""

    tps: float
    device_flops: float

    def mfu(self, peak_flops: float) -> float:
        """Model FLOPs utilization in percent of `peak_flops`."""
        return 100.0 * self.device_flops / peak_flops


def throughput(tokens: int, seconds: float, flops_per_token: float, num_ranks_for_mfu: int) -> Throughput:
    """`tokens` recorded by this rank over `seconds`. The ranks that jointly process the same tokens
    (TP x PP x CP) each do 1/num_ranks_for_mfu of their FLOPs; tps is not divided.

    Args:
        tokens: the tokens this rank processed.
        seconds: the interval's wall time.
        flops_per_token: the model's training FLOPs per token.
        num_ranks_for_mfu: the ranks sharing each token's FLOPs (TP x PP x CP).
    """
    tps = tokens / seconds if seconds > 0 else 0.0
    return Throughput(tps, tps * flops_per_token / num_ranks_for_mfu)


def checked_extra(extra: Mapping[str, float] | None) -> dict[str, float]:
    """A step's extra scalars as floats; a name of a built-in key is a ValueError."""
    values = {k: float(v) for k, v in (extra or {}).items()}
    clashing = values.keys() & set(BASE_KEYS)
    if clashing:
        raise ValueError(f"extra metrics clash with built-in keys: {sorted(clashing)}")
    return values


def flat_items(m: StepMetrics) -> list[tuple[str, float]]:
    """Every key of a step in the sinks' order: the built-in ones, then the extras."""
    return [(k, getattr(m, k)) for k in BASE_KEYS] + list(m.extra.items())


def scalars(m: StepMetrics) -> dict[str, float]:
    """What a sink gets besides the step itself."""
    return {k: v for k, v in flat_items(m) if k != "step"}


def hms(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def format_line(m: StepMetrics) -> str:
    """The step's log line."""
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


def format_progress(step: int, total_steps: int, first_step: int, run_s: float) -> str | None:
    """The line after a log line: steps done, time so far and the estimate of the rest, from the
    mean step time since the run (or its resume at `first_step`) started; None before a step.

    Args:
        step: the step just done.
        total_steps: the steps the run trains to.
        first_step: the step the run (or its resume) started from.
        run_s: seconds since then.
    """
    steps_done = step - first_step
    if not steps_done:
        return None
    remaining = run_s / steps_done * (total_steps - step)
    return f"progress: {step}/{total_steps} steps, elapsed {hms(run_s)}, eta: {hms(remaining)}"


@dataclass(frozen=True)
class RunSummary:
    """Means over the logged steps of a run, leaving out the first step's start-up (compile, first
    all-gathers) when there is more; the peak memory of all of them."""

    mean_tps: float
    mean_mfu: float
    peak_memory_gib: float

    @classmethod
    def of(cls, logged: Sequence[StepMetrics], first_step: int) -> RunSummary:
        steady = [m for m in logged if m.step > first_step + 1] or list(logged)
        count = max(len(steady), 1)
        return cls(
            mean_tps=sum(m.tps for m in steady) / count,
            mean_mfu=sum(m.mfu for m in steady) / count,
            peak_memory_gib=max((m.memory_gib for m in logged), default=0.0),
        )

    def line(self, steps: int, tokens: int, wall_s: float, checkpoints: int, peak: str) -> str:
        """The end-of-run line; `peak` says what MFU is relative to.

        Args:
            steps: the steps the run took.
            tokens: the tokens it trained on.
            wall_s: its wall time, in seconds.
            checkpoints: the checkpoints it saved.
            peak: the peak FLOPs MFU is relative to, in words.
        """
        return (
            f"summary: {steps} steps, {tokens:,} tokens, mean tps {self.mean_tps:,.0f}, "
            f"mean mfu {self.mean_mfu:.2f}%, peak memory {self.peak_memory_gib:.2f}GiB, "
            f"wall time {hms(wall_s)}, checkpoints written {checkpoints}, mfu peak {peak}"
        )
