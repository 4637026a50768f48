"""torch.compile per transformer block (regional compilation, as torchtitan)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from torch import nn

logger = logging.getLogger("torchtitan_amp")


def apply_compile(model: nn.Module, fullgraph: bool = True, backend: str | Callable[..., Any] = "inductor") -> None:
    """Compile each block in place; in-place `compile()` keeps parameter names unchanged.

    Args:
        model: the decoder (models/spec.py's shape) whose `layers` are compiled.
        fullgraph: refuse graph breaks inside a block.
        backend: torch.compile's (the tests' "aot_eager" skips inductor's code generation).
    """
    for block in cast(nn.ModuleDict, model.layers).children():  # the decoder shape of models/spec.py
        block.compile(fullgraph=fullgraph, backend=backend)
    logger.info("compiled each transformer block with torch.compile")
