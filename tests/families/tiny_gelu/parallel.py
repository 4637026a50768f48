"""tiny_gelu's TP plan: Llama's attention, the MLP's w_in column-wise and w_out row-wise."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from torchtitan_amp.models.llama3.parallelize import tp_block_plan as llama_plan


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    plan = {k: v for k, v in llama_plan(seq).items() if not k.startswith("feed_forward")}
    plan.update(
        {
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w_in": ColwiseParallel(),
            "feed_forward.w_out": RowwiseParallel(output_layouts=seq),
        }
    )
    return plan
