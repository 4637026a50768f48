"""The MoE family's tensor-parallel plan: Llama's for attention, dense blocks and the shared
expert; the router and routed experts are not split (TP for the dense parts, as the issue asks;
experts are split by expert parallel).

Under TP an MoE layer takes the whole sequence (gathered from sequence parallel), holds its
parameters as DTensors replicated over the TP ranks (so that FSDP x TP and the optimizer see one
kind of parameter), computes on their local values, and hands its output back in the residual
stream's layout. Every TP rank computes the same routing and the same expert outputs and
gradients from the same inputs and output gradients, so the replicated gradients are already
complete: no TP reduction is needed.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from torchtitan_amp.models.llama3.parallelize import tp_block_plan as llama_plan
from torchtitan_amp.models.moe.moe import MoE


class ReplicatedMoE(ParallelStyle):
    """Whole input in, parameters replicated, output back to `seq` (the residual stream's layout)."""

    def __init__(self, seq: Any) -> None:
        super().__init__()
        self.io = PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # The shared expert is a dense MLP: split like Llama's (tp_block_plan), not replicated.
        moe = cast(MoE, module)  # the plan puts this style on MoE modules only
        for sub in (moe.router, moe.experts):
            for name, param in list(sub.named_parameters(recurse=False)):
                replicated = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
                sub.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        return self.io._apply(module, device_mesh)


class HeadShardedNorm(ParallelStyle):
    """Qwen3's per-head query/key norm under TP: each rank normalises its own heads (dim 2 of
    [B, S, H, D]) with the one weight, so its gradient is each rank's partial sum (a Partial
    DTensor, which the plan's partial-gradient reducer sums over the TP ranks)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            # torch types input_fn as returning None; the inputs it returns replace the module's.
            input_fn=lambda _m, args, mesh: tuple(  # type: ignore[arg-type]
                DTensor.from_local(a, mesh, [Shard(2)], run_check=False) for a in args
            ),
            output_fn=lambda _m, out, _mesh: out.to_local(),
        )


def tp_block_plan(seq: Any, block: Any = None) -> dict[str, Any]:
    plan = llama_plan(seq)
    if block is not None and hasattr(block.attention, "q_norm"):
        plan.update({"attention.q_norm": HeadShardedNorm(), "attention.k_norm": HeadShardedNorm()})
    if block is not None and isinstance(block.feed_forward, MoE):
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")}
        plan["feed_forward"] = ReplicatedMoE(seq)
        if block.feed_forward.shared_expert is not None:
            # Its input is the MoE layer's whole (local) sequence, handed to w1 and w3 as one
            # replicated DTensor so that their partial input gradients are added before one
            # all-reduce (two otherwise); its output is summed back whole.
            plan.update(
                {
                    "feed_forward.shared_expert": PrepareModuleInput(
                        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                    ),
                    "feed_forward.shared_expert.w1": ColwiseParallel(),
                    "feed_forward.shared_expert.w3": ColwiseParallel(),
                    "feed_forward.shared_expert.w2": RowwiseParallel(output_layouts=Replicate()),
                }
            )
    return plan
