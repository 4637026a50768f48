"""What the GPU checks (tools/gpu_checks.py) run and read: the Trainer on one device, the losses
it logged, and a dispatch-level count of the matmul and attention kernels a pass ran, by dtype."""

from __future__ import annotations

import argparse
import gc
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_amp.config import load_config
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


def moe_combine_repeats(device: str) -> dict[str, bool]:
    """An MoE layer (8 experts, top 4, a shared expert) run forward and backward twice on the same
    input after a warm-up run, per dtype: whether outputs and every gradient are bit-identical
    across the two (the combine sums a token's k rows in a fixed order; fp32 index_add_ on CUDA
    adds them in a run-dependent one). The warm-up takes first-call effects out (on a CPU's
    thread pool the very first backward can sum an input gradient in another order)."""
    from torchtitan_amp.models.moe.moe import MoE

    same = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        layer = MoE(64, 64, 8, 4, 1, "softmax", False, 1.0, "bias", 0.0, 1e-3).to(device)
        layer.init_weights(0.02)
        layer = layer.to(dtype)
        x = torch.randn(4, 256, 64, device=device, dtype=dtype)
        runs = []
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out = layer(xi)
            out.float().square().sum().backward()
            runs.append([out.detach(), xi.grad, *(p.grad for p in layer.parameters() if p.grad is not None)])
        same[str(dtype).removeprefix("torch.")] = all(torch.equal(u, v) for u, v in zip(*runs[1:]))
    return same
