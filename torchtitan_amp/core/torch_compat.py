"""What the installed torch can do, where the oldest supported release (2.11) and the pinned one
(2.13) differ. Each answer is read from torch itself (a signature, an attribute), not from its
version string, so a backport or a nightly gets the right branch; callers ask here, never test
versions themselves."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def grouped_fsdp_casts_every_output() -> bool:
    """Whether `fully_shard([m1, m2], mp_policy=...)` casts each module's output to the policy's
    output_dtype. torch 2.13 does; 2.11 casts only the output of the module that completes the
    group, so an fp32 norm sharing a group with another would hand fp32 to a bf16 Linear
    ("expected m1 and m2 to have the same dtype"). Without it, fp32 modules get a group each."""
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    register = getattr(_fsdp_state, "_register_group_forward_hooks", None)
    return register is not None and "cast_output_dtype" in inspect.signature(register).parameters


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: torch 2.13 keeps a list (`_fsdp_param_groups`), 2.11 one
    group or None (`_fsdp_param_group`)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def sequence_collectives() -> tuple[Any, Any]:
    """(all_gather, reduce_scatter) of torch's functional collectives: torch 2.13 names them
    `*_single` and deprecates `all_gather_tensor` / `reduce_scatter_tensor`, which are all torch
    2.11 has. Same signatures: (tensor, dim, group) and (tensor, op, dim, group)."""
    from torch.distributed import _functional_collectives as funcol

    return (
        getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor,
        getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor,
    )


@functools.cache
def grouped_mm_supported(device: str, dtype: Any) -> bool:
    """Whether `torch._grouped_mm` runs forward and backward for `dtype` on `device` ("cpu",
    "cuda:3": the index matters, as the probe's thread does not inherit the current device) (CUDA
    sm90+ in bf16; torch 2.11-2.13's CPU kernel takes bf16 and fp32), asked by running a tiny
    grouped product of 2 groups. The probe runs in a thread of its own: the first call may come
    from inside a forward under activation checkpointing, whose thread-local saved-tensor hooks
    would otherwise record the probe's tensors in the forward but not in the recompute."""
    import threading

    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(_run_grouped_mm(device, dtype)))
    worker.start()
    worker.join()
    return result[0]


def _run_grouped_mm(device: str, dtype: Any) -> bool:
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():
            x = torch.randn(16, 16, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
            y = torch._grouped_mm(x, w, offs=offsets)
            y.backward(torch.ones_like(y))  # a dense gradient: CPU's kernel refuses sum()'s expanded one
        return True
    except (RuntimeError, NotImplementedError):
        return False
