"""Gradients DTensor leaves partial (TP's replicated parameters under sequence parallel, outside
FSDP), summed once per step in the plan's reduce dtype."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


@dataclass
class PartialGradReducer:
    """Sums, once per step, the gradients that are still partial sums over a mesh dimension.

    Under TP with sequence parallel (and no FSDP, which reduces them itself) DTensor leaves a
    replicated parameter's gradient Partial, and every later use all-reduces it again: 4 times
    per step in fp32 on torch 2.13 (the gradient norm, then three AdamW ops), outside the plan
    (pytorch#190626). This does it once, flat per (mesh dims, wire dtype), in the plan's dtype.
    """

    dtype: torch.dtype  # reduce_dtype, for lower-precision-safe modules' parameters
    low_precision_params: frozenset[int]

    def __call__(self, params: list[nn.Parameter]) -> None:
        buckets: dict[tuple[Any, ...], list[nn.Parameter]] = defaultdict(list)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                if any(pl.is_partial() and cast(Partial, pl).reduce_op != "sum" for pl in g.placements):
                    p.grad = g.redistribute(
                        g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements]
                    )
                    continue
                wire = self.dtype if id(p) in self.low_precision_params else g.dtype
                dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
                buckets[(g.device_mesh, dims, wire)].append(p)
        for (mesh, dims, wire), group in buckets.items():
            self._reduce(group, mesh, dims, wire)

    def _reduce(self, params: list[nn.Parameter], mesh: Any, dims: tuple[int, ...], wire: torch.dtype) -> None:
        partial = [cast(DTensor, p.grad) for p in params]  # __call__ buckets DTensor gradients only
        grads = [g.to_local() for g in partial]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(wire)
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for p, g, before in zip(params, grads, partial):
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
            placements = [Replicate() if pl.is_partial() else pl for pl in before.placements]
            p.grad = DTensor.from_local(
                g, mesh, placements, run_check=False, shape=before.shape, stride=before.stride()
            )


def partial_grad_reducer(plan: PrecisionPlan, model_parts: list[nn.Module]) -> PartialGradReducer:
    """Who reduces the gradients DTensor leaves partial (TP's replicated norm weights under
    sequence parallel, outside FSDP): safe modules' in reduce_dtype, the rest in their own."""
    low = {
        id(p)
        for part in model_parts
        for m in part.modules()
        if plan.is_safe(m) and plan.path != "full"
        for p in m.parameters(recurse=False)
    }
    return PartialGradReducer(plan.reduce_dtype, frozenset(low))
