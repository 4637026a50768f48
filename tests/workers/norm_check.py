"""Test-side check of the trainer's gradient norm and clipping against an independent value.

`install()` replaces `torchtitan_amp.train.trainer.clip_grad_norm_` (the trainer calls it as a module
global, after `scaler.unscale_`) with a wrapper that, on every rank and every step:

1. computes the true global norm itself, in float64 and without DTensor's reductions: every rank
   sums the squares of the gradient elements it holds, each divided by how many ranks hold the
   same elements (DDP replicas, TP-replicated norms, HSDP's replicate dimension), and one
   all-reduce over all ranks adds them up, pipeline stages included;
2. on the first call after `reset()`, computes it a second way as well: every parameter's *full*
   gradient (`DTensor.full_tensor()`, the tensor itself otherwise), squares summed in float64,
   summed over the pipeline group (stages hold disjoint parameters; replicas are not added up).
   Only once per run: a gather per parameter per step cost as much as the training of an FSDP or
   TP run of test_parallelisms; once, it pins the replica counting of (1) to the gathered norm;
3. calls the trainer's function;
4. compares the clipped gradients with `g * min(1, max_norm / (true + 1e-6))`, the trainer's
   formula with the true norm, when max_norm > 0.

Nothing here shares code with the trainer's norm (fp32 foreach norms of local shards, DTensor
reductions, an all-reduce over the pipeline group): a shard counted twice, a stage left out or a
scale not removed shows as a reported norm that differs from `true`. Workers put `records()` into
what they write per rank and call `reset()` at the start of each run.
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

from torchtitan_amp.observability.host_syncs import uncounted
from torchtitan_amp.train import trainer as trainer_mod

# The trainer's clipping formula adds this to the norm (clip_grad_norm_).
CLIP_EPS = 1e-6


@dataclass
class NormRecord:
    max_norm: float
    reported: float  # what the trainer's clip_grad_norm_ returned
    true: float  # fp64 norm of all gradient elements, each counted once, over all ranks
    gathered: float | None  # the same from full_tensor() gathers (first step of a run only)
    clipped: bool  # true > max_norm > 0: clipping had to act
    # max over this rank's gradients of max |clipped - expected| / max |expected|; None when
    # max_norm <= 0 (nothing is clipped) or the gradients are not finite (an fp16 overflow step).
    clip_rel_err: float | None


_records: list[NormRecord] = []
_original = trainer_mod.clip_grad_norm_


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def _sum_squares(t: torch.Tensor) -> torch.Tensor:
    g = t.detach().double().flatten()
    return torch.dot(g, g)  # fp64 products and sum: ~1e-11 relative at these sizes


def _world(pp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(ranks in all, ranks per pipeline stage)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world, world // (dist.get_world_size(pp_group) if pp_group is not None else 1)


def _copies(g: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks hold the same elements as this rank's part of `g`: a plain tensor is whole
    on every rank of its pipeline stage; a DTensor's part is repeated on its mesh's Replicate
    dimensions and on the stage's ranks outside its mesh (e.g. DDP replicas of a TP mesh)."""
    if not isinstance(g, DTensor):
        return stage_ranks
    mesh = g.device_mesh
    replicated = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
    return stage_ranks // mesh.size() * replicated


def true_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None, device: torch.device) -> float:
    """fp64 norm of every gradient element once, from the parts the ranks hold: one all-reduce of
    one float64 over all ranks. Partial gradients (summands, not parts) are summed first."""
    world, stage_ranks = _world(pp_group)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            total += _sum_squares(g.full_tensor()) / stage_ranks
        else:
            total += _sum_squares(_local(g)) / _copies(g, stage_ranks)
    if world > 1:
        dist.all_reduce(total)
    return math.sqrt(float(total))


def gathered_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None, device: torch.device) -> float:
    """fp64 norm of the full gradients of `params`, summed over the pipeline stages. Every rank of
    a DTensor's mesh walks the same parameters in the same order (full_tensor is a collective)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            total += _sum_squares(g)
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
        b, a = b.float(), a.float()  # no copy for fp32 gradients; bf16 ones (pure bf16) compared in fp32
        scale = float(b.abs().max()) * coef if b.numel() else 0.0
        if scale > 0:
            worst = max(worst, float(torch.sub(a, b, alpha=coef).abs_().max()) / scale)
    return worst


def checked_clip_grad_norm_(
    params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None, *, device: torch.device
) -> torch.Tensor:
    with uncounted():  # the evidence's reads are not the step's host syncs (StepSyncs)
        true = true_norm(params, pp_group, device)
        gathered = gathered_norm(params, pp_group, device) if not _records else None
        before = [_local(p.grad.detach()).clone() for p in params if p.grad is not None]
    reported = _original(params, max_norm, pp_group, device=device)
    with uncounted():
        after = [_local(p.grad.detach()) for p in params if p.grad is not None]
        check = max_norm > 0 and math.isfinite(true)
        coef = min(1.0, max_norm / (true + CLIP_EPS)) if check else 1.0
        _records.append(
            NormRecord(
                max_norm=float(max_norm),
                reported=float(reported),
                true=true,
                gathered=gathered,
                clipped=bool(max_norm > 0 and true > max_norm),
                clip_rel_err=_clip_rel_err(before, after, coef) if check else None,
            )
        )
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
