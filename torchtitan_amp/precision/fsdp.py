"""The FSDP path's casting: one `MixedPrecisionPolicy` per `fully_shard` group, and the
transformer blocks' own input cast."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def fsdp_policy(
    plan: PrecisionPlan,
    *,
    low_precision: bool,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
) -> MixedPrecisionPolicy:
    """Policy for one `fully_shard` group: safe modules in param/reduce dtype, others fp32.

    Args:
        plan: the precision plan; off the "fsdp" path the policy casts nothing.
        low_precision: whether the group's modules are lower-precision safe (param / reduce
            dtype) or kept in fp32 (fp32 in and compute, param dtype out).
        output_dtype: the dtype the group's outputs are cast to; None leaves them (an fp32
            group then returns param dtype, so the low-precision ops around it continue).
        cast_forward_inputs: whether FSDP casts the group's floating inputs to param dtype.
            Transformer blocks pass False and get `cast_block_inputs` instead: FSDP's own input
            cast converts every floating argument, the rotary cos/sin tables too.
    """
    if plan.path != "fsdp":
        return MixedPrecisionPolicy(output_dtype=output_dtype)
    if low_precision:
        return MixedPrecisionPolicy(plan.param_dtype, plan.reduce_dtype, output_dtype, cast_forward_inputs)
    # fp32 in, fp32 compute, and back to param dtype out, so the bf16 ops around it continue.
    return MixedPrecisionPolicy(torch.float32, torch.float32, output_dtype or plan.param_dtype, True)


def cast_block_inputs(plan: PrecisionPlan, block: nn.Module) -> None:
    """FSDP path: cast a block's hidden state (its first argument) to param_dtype, and nothing
    else. The rotary tables that follow it stay fp32 (an fp32 island): FSDP's
    `cast_forward_inputs` would round them to bf16, blurring positions by ~2**-9."""
    if plan.path != "fsdp" or plan.param_dtype == torch.float32:
        return
    dtype = plan.param_dtype

    def cast_hidden_state(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (args[0].to(dtype),) + tuple(args[1:])
        return args

    block.register_forward_pre_hook(cast_hidden_state)
