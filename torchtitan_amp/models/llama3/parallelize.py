"""Llama 3's tensor-parallel plan: which of a block's modules split how (Megatron-style)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

# Sequence-parallel under TP with SP on, replicated DTensor params without.
BLOCK_NORMS = ("attention_norm", "ffn_norm")
# Op-level selective AC wraps these where a block holds an MoE layer; a dense block whole.
AC_REGIONS = ("attention", "feed_forward")


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    """q/k/v and w1/w3 column-wise, wo and w2 row-wise; attention and the MLP gather the
    residual stream (`seq`: Shard(1) with sequence parallel, else Replicate()) on entry and
    reduce(-scatter) it back on exit."""
    return {
        "attention": PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "feed_forward.w3": ColwiseParallel(),
    }
