"""torch.compile per transformer block (regional compilation, as torchtitan)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from torchtitan_amp.distributed.blocks import side_blocks

logger = logging.getLogger("torchtitan_amp")


def apply_compile(model: nn.Module, fullgraph: bool = True, backend: str | Callable[..., Any] = "inductor") -> None:
    """Compile each block in place, a side block's (multi-token prediction depth's) `block` too;
    in-place `compile()` keeps parameter names unchanged.

    Args:
        model: the decoder (models/spec.py's shape) whose `layers` are compiled.
        fullgraph: refuse graph breaks inside a block.
        backend: torch.compile's (the tests' "aot_eager" skips inductor's code generation).
    """
    blocks = list(cast(nn.ModuleDict, model.layers).children())  # the decoder shape of models/spec.py
    for block in blocks + [depth.get_submodule("block") for depth in side_blocks(model)]:
        block.compile(fullgraph=fullgraph, backend=backend)
    logger.info("compiled each transformer block with torch.compile")
