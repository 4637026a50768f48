"""fp8 as the plan decided it: the skip patterns checked against the model, the Linears converted
(torchtitan_amp.fp8 does the torchao work), scales precomputed for fp8 all-gather."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp import fp8
from torchtitan_amp.errors import PrecisionError
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN, tied_modules

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def check_fp8_modules(plan: PrecisionPlan, model: nn.Module) -> None:
    """Every fp8 skip pattern names a Linear of the model (a typo would convert it), and no Linear
    whose weight another module shares (a tied output projection) is converted: the embedding
    would read a weight that fp8 all-gather and torchao's module swap do not keep one tensor."""
    if plan.fp8 != "none":
        unmatched = fp8.unmatched_patterns(model, plan.fp8_skip)
        if unmatched:
            raise PrecisionError(f"'mixed_precision.fp8_skip_modules' entry {unmatched[0]!r} matches no "
                                 "nn.Linear of the model (names such as 'output', 'layers.0.*')")
        for group in tied_modules(model):
            for name, module in group:
                if fp8.convertible(name, module, plan.fp8_skip, _keep_fp32):
                    shared = next(n for n, _ in group if n != name)
                    raise PrecisionError(f"'mixed_precision.fp8_skip_modules' must cover '{name}': its weight is "
                                         f"shared with '{shared}' (model enable_weight_tying), which fp8 cannot keep")


def _keep_fp32(module: nn.Module) -> bool:
    return getattr(module, FP32_BY_NAME, False) or getattr(module, FROZEN, False)


def is_fp8_linear(plan: PrecisionPlan, name: str, module: nn.Module) -> bool:
    """Whether the plan runs `module` (named `name` in the whole model) in fp8: the rule apply_fp8
    converts by, also true of a Float8Linear it converted (still an nn.Linear)."""
    return plan.fp8 != "none" and fp8.convertible(name, module, plan.fp8_skip, _keep_fp32)


def apply_fp8(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """Convert the model's fp8 Linears (before parallelizing); returns their names."""
    if plan.fp8 == "none":
        return []
    return fp8.convert(model, plan.fp8, plan.fp8_skip, plan.fp8_all_gather,
                       keep_fp32=_keep_fp32)


def after_optimizer_step(plan: PrecisionPlan, model_parts: list[nn.Module]) -> None:
    if plan.fp8_all_gather:
        fp8.precompute_scales(model_parts)
