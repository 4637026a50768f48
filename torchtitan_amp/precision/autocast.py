"""The autocast path's contexts: forward-only autocast, a backward without it, fp32 islands
(modules outside the safe list run with autocast off), the output dtype, and the guard against a
caller's own autocast."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.rules import dtype_name

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def forward_context(plan: PrecisionPlan) -> contextlib.AbstractContextManager:
    """Wraps forward + loss. Never wrap backward in it: autocast belongs to forward only."""
    dtype = plan.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(plan.device_type, dtype=dtype)


def apply_forward_context(plan: PrecisionPlan, module: nn.Module) -> None:
    """Run `module`'s forward (only) in the forward context: for pipeline stages, whose
    schedule interleaves forward and backward so no context can wrap forward alone."""
    _wrap_forward(module, functools.partial(forward_context, plan))


def apply_fp32_islands(plan: PrecisionPlan, model: nn.Module) -> None:
    """On the autocast path, run modules outside the safe list in fp32 (autocast off, float
    inputs upcast). The FSDP path gets the same from its fp32 groups' policy."""
    if plan.autocast_dtype is None:
        return
    no_autocast = functools.partial(torch.autocast, plan.device_type, enabled=False)
    for module in plan.fp32_modules(model):
        if not getattr(module, "computes_in_fp32", False):
            _wrap_forward(module, no_autocast, cast_inputs=torch.float32)


def backward_context(plan: PrecisionPlan) -> contextlib.AbstractContextManager:
    """Backward runs with autocast explicitly off, whatever a caller's context holds."""
    return torch.autocast(plan.device_type, enabled=False)


def cast_output(plan: PrecisionPlan, output: torch.Tensor) -> torch.Tensor:
    """On the autocast path the model's output dtype is ours to set (FSDP sets it itself)."""
    if plan.path == "autocast" and output.is_floating_point():
        return output.to(plan.output_dtype)
    return output


def check_no_user_autocast(plan: PrecisionPlan) -> None:
    """Called at every step's entry: a caller's autocast would override this plan silently."""
    for device_type in {plan.device_type, "cpu"}:
        if torch.is_autocast_enabled(device_type):
            dtype = dtype_name(torch.get_autocast_dtype(device_type))
            raise PrecisionError(
                f"the train step is running inside a torch.autocast('{device_type}') region "
                f"(dtype {dtype}); remove it and set mixed_precision.param_dtype = '{dtype}' "
                f"in the job config instead"
            )


def _wrap_forward(
    module: nn.Module, context: Callable[[], contextlib.AbstractContextManager], cast_inputs: torch.dtype | None = None
) -> None:
    """Make `module(...)` run its forward inside `context()`, optionally upcasting float inputs.

    An instance attribute, not a wrapper module, so parameter names (and checkpoints) are unchanged.
    """
    forward = module.forward

    def cast(x: Any) -> Any:
        return x.to(cast_inputs) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    @functools.wraps(forward)
    def forward_in_context(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs is not None:
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        with context():
            return forward(*args, **kwargs)

    module.forward = forward_in_context
