"""The marks a precision plan leaves on the model's modules (read by `is_safe`, fp8 conversion and
the report), and tagging modules fp32 by name."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp.errors import PrecisionError

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan

# The attributes mark_fp32_by_name and freeze.freeze set: they travel with the module through
# deepcopy (pipeline stages), FSDP and TP, which keep the module objects.
FP32_BY_NAME = "_torchtitan_amp_fp32_by_name"
FROZEN = "_torchtitan_amp_frozen"


def mark_fp32_by_name(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """Tag the modules `fp32_names` match, and everything inside them, as outside the safe
    list: every path then asks `is_safe` and keeps them in fp32 (autocast islands, fp32 FSDP
    groups, fp32 gradient reduction, no fp8). Call on the whole model before it is split or
    parallelized; returns the names of the tagged modules that own parameters. A pattern
    naming no module is a PrecisionError."""
    named = dict(model.named_modules())
    unmatched = [p for p in plan.fp32_names if not any(fnmatch.fnmatchcase(n, p) for n in named if n)]
    if unmatched:
        raise PrecisionError(f"'mixed_precision.fp32_module_names' entry {unmatched[0]!r} matches no module "
                             "of the model (names such as 'output', 'layers.0', 'layers.*.attention.wo')")
    tagged = []
    for name, module in named.items():
        if name and any(fnmatch.fnmatchcase(name, p) for p in plan.fp32_names):
            for sub_name, sub in module.named_modules(prefix=name):
                setattr(sub, FP32_BY_NAME, True)
                if any(True for _ in sub.parameters(recurse=False)):
                    tagged.append(sub_name)
    return sorted(set(tagged))
