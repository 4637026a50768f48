"""What the GPU checks (tools/gpu_checks.py) run and read: the Trainer on one device, the losses
it logged, a dispatch-level count of the matmul and attention kernels a pass ran, by dtype, and
the host syncs of its training steps."""

from __future__ import annotations

import argparse
import gc
import json
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_amp.config import load_config
from torchtitan_amp.host_syncs import StepSyncs
from torchtitan_amp.trainer import Trainer

_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm")


class OpDtypes(TorchDispatchMode):
    """Counts (op, dtype of its first tensor argument) for matmuls and attention kernels (SDPA's
    flash / efficient / cuDNN / CPU variants and their backward ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in _MATMULS or "attention" in name:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None:
                self.seen[f"{name}:{str(first.dtype).removeprefix('torch.')}"] += 1
        return func(*args, **(kwargs or {}))


def base_args(a: argparse.Namespace, dump: Path) -> list[str]:
    # --tiny proves the plumbing, not the numbers: the smallest flavour keeps a CPU without native
    # bf16 (AVX2, where bf16 matmuls are emulated) at ~0.05 s a step.
    shape = (["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2"]
             if a.tiny else ["--model.flavor", "debugmodel", "--training.seq_len", "256",
                             "--training.local_batch_size", "8"])
    return [*shape, "--training.device", a.device, "--training.steps", str(a.steps), "--metrics.log_freq", "1",
            "--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(dump)]


def records(dump: Path) -> dict[int, dict[str, Any]]:
    """The last metrics record of each step (a resumed run appends)."""
    return {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def losses(dump: Path) -> dict[int, float]:
    """Each step's loss; a non-finite one (null in metrics.jsonl) as inf, so that it fails a bound."""
    return {s: math.inf if r["loss"] is None else r["loss"] for s, r in records(dump).items()}


def train(args: list[str]) -> Trainer:
    trainer = Trainer(load_config(args))
    trainer.train()
    trainer.metrics.close()
    return trainer


def free_memory() -> None:
    """Between runs: a finished Trainer's tensors (and an interrupted one's) go before the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# trainer.train_step's one device read (the finiteness flag), on one device without EP, dense or MoE.
STEP_SYNC_BUDGET = 1


class _CudaSyncWarnings:
    """Wraps a trainer's train_step: with torch.cuda.set_sync_debug_mode("warn") on, CUDA itself
    reports every synchronizing call (what the dispatcher count cannot see: a blocking copy made
    inside an op, a stream sync in a library). Per step: the warnings' first lines."""

    def __init__(self, trainer: Trainer) -> None:
        self.per_step: dict[int, list[str]] = {}
        step_fn = trainer.train_step

        def warned(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return step_fn(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    self.per_step[trainer.step] = [str(w.message).splitlines()[0] for w in caught
                                                   if "synchroniz" in str(w.message)]

        trainer.train_step = warned


def step_syncs(args: list[str]) -> dict[str, Any]:
    """Train; for every step after the first (which builds lazily): the host syncs counted at the
    dispatcher (host_syncs.StepSyncs, with the line of each) and, on CUDA, the synchronizing calls
    CUDA's sync debug mode reported inside train_step."""
    trainer = Trainer(load_config(args))
    recorder = StepSyncs(only=set(range(2, trainer.config.training.steps + 1)), where=True)
    recorder.install(trainer)
    cuda = _CudaSyncWarnings(trainer) if trainer.device.type == "cuda" else None
    trainer.train()
    recorder.finish()
    trainer.metrics.close()
    steps = {s: {**r, "cuda_sync_warnings": cuda.per_step.get(s) if cuda else None} for s, r in recorder.steps.items()}
    return {"budget": STEP_SYNC_BUDGET, "steps": steps}


def sync_budget_kept(result: dict[str, Any]) -> bool:
    """Every counted step's train_step within the budget, at the dispatcher and (CUDA) by CUDA."""
    steps = result["steps"].values()
    return bool(steps) and all(max(r["train_step"], len(r["cuda_sync_warnings"] or ())) <= STEP_SYNC_BUDGET
                               for r in steps)
