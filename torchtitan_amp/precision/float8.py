"""fp8 as the plan decided it: the skip patterns checked against the model, the Linears converted
(torchtitan_amp.fp8 does the torchao work), scales precomputed for fp8 all-gather."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp import fp8
from torchtitan_amp.errors import PrecisionError
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def check_fp8_modules(plan: PrecisionPlan, model: nn.Module) -> None:
    """Every fp8 skip pattern names a Linear of the model (a typo would convert it)."""
    if plan.fp8 != "none":
        unmatched = fp8.unmatched_patterns(model, plan.fp8_skip)
        if unmatched:
            raise PrecisionError(f"'mixed_precision.fp8_skip_modules' entry {unmatched[0]!r} matches no "
                                 "nn.Linear of the model (names such as 'output', 'layers.0.*')")


def apply_fp8(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """Convert the model's fp8 Linears (before parallelizing); returns their names."""
    if plan.fp8 == "none":
        return []
    return fp8.convert(model, plan.fp8, plan.fp8_skip, plan.fp8_all_gather,
                       keep_fp32=lambda m: getattr(m, FP32_BY_NAME, False) or getattr(m, FROZEN, False))


def after_optimizer_step(plan: PrecisionPlan, model_parts: list[nn.Module]) -> None:
    if plan.fp8_all_gather:
        fp8.precompute_scales(model_parts)
