"""The marks a precision plan leaves on the model's modules (read by `is_safe`, fp8 conversion, the
FSDP groups and the report), and the groups of modules that share a weight. The code that sets
them is in by_name.py (fp32 by name) and freeze.py (frozen); this module imports nothing of the
package, so that the plan, which reads the marks, can import it."""

from __future__ import annotations

from torch import nn

# The attributes by_name.mark_fp32_by_name and freeze.freeze set: they travel with the module
# through deepcopy (pipeline stages), FSDP and TP, which keep the module objects.
FP32_BY_NAME = "_torchtitan_amp_fp32_by_name"
FROZEN = "_torchtitan_amp_frozen"


def tied_modules(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Groups of (name, module) that own one parameter together (a tied embedding and output
    projection: enable_weight_tying), in model order."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, module))
    return [group for group in owners.values() if len(group) > 1]
