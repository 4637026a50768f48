"""torch.compile per transformer block (regional compilation, as torchtitan)."""

from __future__ import annotations

import logging
from typing import cast

from torch import nn

logger = logging.getLogger("torchtitan_amp")


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile each block in place; in-place `compile()` keeps parameter names unchanged."""
    for block in cast(nn.ModuleDict, model.layers).children():  # the decoder shape of models/spec.py
        block.compile(fullgraph=fullgraph)
    logger.info("compiled each transformer block with torch.compile")
