"""Test-side check of the trainer's gradient norm and clipping against an independent value.

`install()` replaces `torchtitan_amp.trainer.clip_grad_norm_` (the trainer calls it as a module
global, after `scaler.unscale_`) with a wrapper that, on every rank and every step:

1. computes the true global norm itself: every parameter's *full* gradient (`DTensor.full_tensor()`
   for sharded or replicated DTensors, the tensor otherwise), squares summed in float64 over this
   rank's parameters, then summed over the pipeline group when there is one (stages hold disjoint
   parameters; data-parallel and TP replicas hold the same full gradients and are not added up);
2. calls the trainer's function;
3. compares the clipped gradients with `g * min(1, max_norm / (true + 1e-6))`, the trainer's
   formula with the true norm, when max_norm > 0.

Nothing here shares code with the trainer's norm (foreach norms of local shards, DTensor
reductions, fp32): a shard counted twice, a stage left out or a scale not removed shows as a
reported norm that differs from `true`. Workers put `records()` into what they write per rank and
call `reset()` at the start of each run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp import trainer as trainer_mod

# The trainer's clipping formula adds this to the norm (clip_grad_norm_).
CLIP_EPS = 1e-6


@dataclass
class NormRecord:
    max_norm: float
    reported: float  # what the trainer's clip_grad_norm_ returned
    true: float  # fp64 norm of the full gradients, summed over pipeline stages
    clipped: bool  # true > max_norm > 0: clipping had to act
    # max over this rank's gradients of max |clipped - expected| / max |expected|; None when
    # max_norm <= 0 (nothing is clipped) or the gradients are not finite (an fp16 overflow step).
    clip_rel_err: float | None


_records: list[NormRecord] = []
_original = trainer_mod.clip_grad_norm_


def _full(g: torch.Tensor) -> torch.Tensor:
    """The whole gradient on this rank (a collective over the DTensor's mesh)."""
    return g.full_tensor() if isinstance(g, DTensor) else g


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def true_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None) -> float:
    """fp64 norm of the full gradients of `params`, summed over the pipeline stages. Every rank of
    a DTensor's mesh walks the same parameters in the same order (full_tensor is a collective)."""
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            g = _full(p.grad.detach()).double().flatten()
            total += torch.dot(g, g)  # fp64 products and sum: ~1e-11 relative at these sizes
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return math.sqrt(float(total))


def _clip_rel_err(before: list[torch.Tensor], after: list[torch.Tensor], coef: float) -> float:
    """max over gradients of max |clipped - g * coef| / max |g * coef|: per gradient, so that a
    small one left unclipped (e.g. the norm weights) is not hidden by the large ones. Computed in
    fp32 (a few 1e-8 of rounding, far below CLIP_RTOL) to keep the check cheap. Clipping scales
    every element alike, so each rank compares the elements it holds (its local shards): together
    the ranks cover every element, without gathering the gradients again."""
    worst = 0.0
    for b, a in zip(before, after):
        scale = float(b.abs().max()) * coef if b.numel() else 0.0
        if scale > 0:
            worst = max(worst, float(torch.sub(a, b, alpha=coef).abs_().max()) / scale)
    return worst


def checked_clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                            pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    true = true_norm(params, pp_group)
    before = [_local(p.grad.detach()).clone() for p in params if p.grad is not None]
    reported = _original(params, max_norm, pp_group)
    after = [_local(p.grad.detach()) for p in params if p.grad is not None]
    check = max_norm > 0 and math.isfinite(true)
    coef = min(1.0, max_norm / (true + CLIP_EPS)) if check else 1.0
    _records.append(NormRecord(max_norm=float(max_norm), reported=float(reported), true=true,
                               clipped=bool(max_norm > 0 and true > max_norm),
                               clip_rel_err=_clip_rel_err(before, after, coef) if check else None))
    return reported


def install() -> None:
    """Route the trainer's clipping through the check (idempotent)."""
    trainer_mod.clip_grad_norm_ = checked_clip_grad_norm_  # type: ignore[assignment]


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """The check installed for a block only (a worker whose other scenarios need no gathers)."""
    install()
    try:
        yield
    finally:
        trainer_mod.clip_grad_norm_ = _original  # type: ignore[assignment]


def reset() -> None:
    _records.clear()


def records() -> list[dict]:
    return [asdict(r) for r in _records]
