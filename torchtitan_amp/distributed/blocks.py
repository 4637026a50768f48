"""The blocks a model runs beside its `layers` (models/spec.py's optional `mtp`): what TP, AC,
compile and FSDP treat like the layers' blocks."""

from __future__ import annotations

from torch import nn


def side_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules a model runs beside its `layers` that are FSDP units of their own, like blocks
    (models/spec.py: the optional `mtp` ModuleDict, DeepSeek-V3's multi-token prediction depths,
    each with a `block` of the layers' kind)."""
    mtp = getattr(model, "mtp", None)
    return list(mtp.children()) if isinstance(mtp, nn.ModuleDict) else []
