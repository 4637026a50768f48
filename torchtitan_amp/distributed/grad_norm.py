"""The global gradient norm and clipping by it: the squared norms of every shard (DTensors of each
mesh, plain tensors) summed over the pipeline stages, one value on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _grad_groups(params: list[nn.Parameter]) -> list[list[torch.Tensor]]:
    """Gradients grouped so that each group is all plain tensors or all DTensors of one mesh:
    foreach kernels refuse a mixture of the two, or DTensors of different meshes."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    return list(groups.values())


def clip_grad_norm_(
    params: list[nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None = None, *, device: torch.device
) -> torch.Tensor:
    """The global gradient norm (over every shard and pipeline stage), clipping the gradients in
    place when `max_norm` > 0. Returns the norm before clipping.

    Args:
        params: this rank's trained parameters (any mix of plain tensors and DTensors).
        max_norm: the norm to clip to; 0 or less: measure only.
        pp_group: the pipeline group whose stages' squared norms are summed (None: no PP).
        device: the rank's device (the trainer's): a stage with nothing trained has no parameter
            to take it from.
    """
    groups = _grad_groups(params)
    squares = []
    for grads in groups:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    # A stage whose parameters got no gradient (or that trains none) still joins the pipeline
    # all-reduce, on the rank's device (nccl takes no CPU tensor).
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    if pp_group is not None:
        # Stages hold disjoint parameters: add squared norms across them.
        dist.all_reduce(total, group=pp_group)
    total = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return total
