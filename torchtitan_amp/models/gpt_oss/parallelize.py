"""The gpt-oss family's tensor-parallel plan: the MoE family's (Llama's for attention, whose q / k /
v biases are split with their heads and o's bias replicated; the MoE layer replicated), plus the
sinks split with the heads: each TP rank holds the sink logits of its own heads (a Shard(0)
DTensor used through its local values), whose gradients are that rank's alone."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan_amp.models.moe.parallelize import tp_block_plan as moe_plan


class HeadShardedSinks(ParallelStyle):
    """SinkAttention's `sinks` [n_heads] split over the TP ranks like the heads (Shard(0))."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        sinks = module.get_parameter("sinks")
        sharded = distribute_tensor(sinks.data, device_mesh, [Shard(0)])
        module.register_parameter("sinks", nn.Parameter(sharded, requires_grad=sinks.requires_grad))
        return module


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    plan = moe_plan(seq, block)
    plan["attention.core"] = HeadShardedSinks()
    return plan
