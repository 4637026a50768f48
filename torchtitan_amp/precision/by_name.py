"""Modules kept in fp32 by name (mixed_precision.fp32_module_names), and one precision for the
modules that share a weight (a tied embedding and output projection)."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.tags import FP32_BY_NAME, tied_modules

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def mark_fp32_by_name(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """Tag the modules `fp32_names` match, and everything inside them, as outside the safe
    list: every path then asks `is_safe` and keeps them in fp32 (autocast islands, fp32 FSDP
    groups, fp32 gradient reduction, no fp8). Call on the whole model before it is split or
    parallelized; returns the names of the tagged modules that own parameters. A pattern
    naming no module is a PrecisionError."""
    named = dict(model.named_modules())
    unmatched = [p for p in plan.fp32_names if not any(fnmatch.fnmatchcase(n, p) for n in named if n)]
    if unmatched:
        raise PrecisionError(
            f"'mixed_precision.fp32_module_names' entry {unmatched[0]!r} matches no module "
            "of the model (names such as 'output', 'layers.0', 'layers.*.attention.wo')"
        )
    tagged = []
    for name, module in named.items():
        if name and any(fnmatch.fnmatchcase(name, p) for p in plan.fp32_names):
            for sub_name, sub in module.named_modules(prefix=name):
                setattr(sub, FP32_BY_NAME, True)
                if any(True for _ in sub.parameters(recurse=False)):
                    tagged.append(sub_name)
    tagged += align_tied_modules(plan, model)
    return sorted(set(tagged))


def align_tied_modules(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """One parameter gets one precision: modules sharing it must sit in one FSDP group and reduce
    it in one dtype. fp32 if any of them is named in fp32_module_names, else what the module that
    multiplies by it (not an nn.Embedding: the output projection) is, which the lookup then
    reads too; an embedding lookup has no rounding of its own to protect. Returns the names
    newly tagged fp32."""
    tagged = []
    for group in tied_modules(model):
        matmuls = [m for _, m in group if not isinstance(m, nn.Embedding)]
        by_name = any(getattr(m, FP32_BY_NAME, False) for _, m in group)
        if by_name or (matmuls and not plan.is_safe(matmuls[0])):
            tagged += [n for n, m in group if not getattr(m, FP32_BY_NAME, False)]
            for _, m in group:
                setattr(m, FP32_BY_NAME, True)
        elif matmuls:
            for _, m in group:
                if not plan.is_safe(m):
                    m.safe_as = type(matmuls[0])  # type: ignore[assignment]  # stubs: Tensor or Module; read by PrecisionPlan.is_safe
    return tagged
