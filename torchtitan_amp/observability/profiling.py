"""torch.profiler traces on chosen steps and CUDA memory snapshots, driven by [profiling]."""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from torchtitan_amp.config import ConfigError, JobConfig

logger = logging.getLogger("torchtitan_amp")

# Steps recorded per trace after one warm-up step; the cycle repeats every profile_freq steps.
_WARMUP, _ACTIVE = 1, 1


def validate(config: JobConfig, device_type: str) -> None:
    p = config.profiling
    if p.profile_freq < _WARMUP + _ACTIVE + 1:
        raise ConfigError(f"'profiling.profile_freq' must be >= {_WARMUP + _ACTIVE + 1}, got {p.profile_freq}")
    if p.enable_memory_snapshot and device_type != "cuda":
        raise ConfigError(
            "'profiling.enable_memory_snapshot' needs CUDA (torch.cuda.memory._record_memory_history); "
            "on CPU use profiling.enable_profiling with its memory columns instead"
        )


def _trace_handler(folder: Path, rank: int) -> Callable[[torch.profiler.profile], None]:
    def handler(prof: torch.profiler.profile) -> None:
        step_folder = folder / f"iteration_{prof.step_num}"
        step_folder.mkdir(parents=True, exist_ok=True)
        path = step_folder / f"rank{rank}_trace.json"
        prof.export_chrome_trace(str(path))
        logger.info("profiler trace written to %s", path)

    return handler


@contextlib.contextmanager
def maybe_profile(config: JobConfig, rank: int, start_step: int) -> Iterator[torch.profiler.profile | None]:
    """Yields a profiler whose `.step()` the loop calls once per train step, or None.

    Args:
        config: the job config (its profiling section and dump folder).
        rank: this rank (traces are named by it).
        start_step: the step training starts from (a resumed run's), so the schedule counts from it.
    """
    p = config.profiling
    if not p.enable_profiling:
        yield None
        return
    folder = Path(config.job.dump_folder) / p.save_traces_folder
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait = p.profile_freq - _WARMUP - _ACTIVE
    schedule = torch.profiler.schedule(wait=wait, warmup=_WARMUP, active=_ACTIVE)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        record_shapes=True,
        profile_memory=True,
        on_trace_ready=_trace_handler(folder, rank),
    ) as prof:
        # Align the schedule with global step numbers on a resumed run.
        prof.step_num = start_step
        yield prof


@contextlib.contextmanager
def maybe_memory_snapshot(config: JobConfig, rank: int) -> Iterator[None]:
    """Record CUDA allocator history for the run and dump it at the end (or on an exception)."""
    if not config.profiling.enable_memory_snapshot:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        folder = Path(config.job.dump_folder) / config.profiling.save_memory_snapshot_folder
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank{rank}_memory_snapshot.pickle", "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
        torch.cuda.memory._record_memory_history(enabled=None)
