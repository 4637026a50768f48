"""torch.compile per transformer block (regional compilation, as torchtitan)."""

from __future__ import annotations

import logging
from typing import cast

from torch import nn

from torchtitan_amp.distributed.blocks import side_blocks

logger = logging.getLogger("torchtitan_amp")


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile each block in place, a side block's (multi-token prediction depth's) `block` too;
    in-place `compile()` keeps parameter names unchanged."""
    blocks = list(cast(nn.ModuleDict, model.layers).children())  # the decoder shape of models/spec.py
    for block in blocks + [depth.get_submodule("block") for depth in side_blocks(model)]:
        block.compile(fullgraph=fullgraph)
    logger.info("compiled each transformer block with torch.compile")
