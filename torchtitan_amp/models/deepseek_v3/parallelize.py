"""DeepSeek-V3's tensor-parallel plan: not yet written for MLA (its latent projections and norms
would stay replicated while wq_b / wkv_b split by head); asked for, it refuses in one line."""

from __future__ import annotations

from typing import Any

from torchtitan_amp.core.errors import ConfigError


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    raise ConfigError(
        "model.name 'deepseek_v3' has no tensor-parallel plan for multi-head latent attention yet; "
        "use parallelism.tensor_parallel_degree = 1 (FSDP, HSDP, PP and EP apply)"
    )
