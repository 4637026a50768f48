"""Activation checkpointing of transformer blocks: whole blocks (full), every N-th block, or op-level
selective AC that keeps the outputs of expensive ops (torchtitan's rule, one matmul in two)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_amp.config import ActivationCheckpointConfig
from torchtitan_amp.distributed.blocks import side_blocks
from torchtitan_amp.distributed.expert_parallel import is_expert_layer

logger = logging.getLogger("torchtitan_amp")


# Op-level selective AC keeps the outputs of these (expensive to recompute) ops: FlexAttention and
# every SDPA kernel torch may dispatch (cuDNN's comes first on sm90 with a recent cuDNN, flash/efficient on
# other GPUs, the CPU flash kernel here) and the TP collectives, so that backward neither reruns
# attention nor repeats a reduce-scatter / all-reduce (torchtitan's list, plus the all-reduce of
# TP without sequence parallel).
SAC_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    # CUDA's lower-right causal bias (context parallel's query chunks) calls the efficient kernel
    # by this name, not through SDPA's (torch.nn.attention.bias); flash keeps SDPA's name.
    torch.ops.aten._efficient_attention_forward.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    # FlexAttention (model.attention_backend = "flex"), as torchtitan keeps it: the op a compiled
    # block's checkpoint region sees (torch 2.11 and 2.13 name it so); eager flex on CUDA runs it too.
    torch.ops.higher_order.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    # fp8 scales come from amax: recomputing it in backward could give another scale.
    torch.ops.aten.max.default,
}


def _op_sac_policy(save_mm: str) -> Callable[..., CheckpointPolicy]:
    """Keep the outputs of SAC_SAVE_LIST's ops, but with save_mm="alternate" only the 1st, 3rd,
    5th... aten.mm of the region (torchtitan's rule: about half the matmul outputs, each
    recomputed one costing a matmul in backward). A fresh counter per region call, counted apart
    in forward and recompute (torch 2.13 asks the policy in forward only; older torch also asked
    it in the recompute, where the count must start again)."""
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            counts[ctx.is_recompute] += 1
            if save_mm == "alternate" and counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in SAC_SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_sac_contexts(save_mm: str) -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_op_sac_policy(save_mm))


def recomputed_whole(region: nn.Module) -> bool:
    """Whether op-level SAC recomputes this region whole (plain checkpointing) rather than op by
    op: an MoE layer's router and routed experts are FSDP units of their own (an fp32 group; the
    EP experts' efsdp group) whose hooks unshard again inside the recompute, an op sequence SAC's
    replay must match and cannot (torch 2.11-2.13: "fsdp.split_with_sizes_copy ... not found in
    storage"). Its op-level savings there were small anyway: the grouped matmuls and all-to-alls
    are not in SAC_SAVE_LIST, only the router's and shared expert's mm outputs."""
    return any(is_expert_layer(m) for m in region.modules())


def _wrap_block(block: nn.Module, ac: ActivationCheckpointConfig, regions: tuple[str, ...]) -> nn.Module:
    if not (ac.mode == "selective" and ac.selective_ac_option == "op"):
        return checkpoint_wrapper(block, preserve_rng_state=False)
    sac = partial(_op_sac_contexts, ac.per_op_sac_save_mm)
    if not any(recomputed_whole(getattr(block, name)) for name in regions):
        # The whole block, as torchtitan: its norms and residual adds are recomputed, not kept.
        # The norms' own fp32 FSDP group runs its hooks inside the region, and SAC's replay needs
        # the recompute to issue no op the forward did not: measured so (FSDP gathers no more
        # per step than without AC; FSDP 2 and CP 2 train as without AC, tests/test_parallelisms.py
        # and tests/test_context_parallel_compose.py).
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=sac)
    # An MoE block: its regions (attention, feed-forward), not the block; the feed-forward whole.
    for name in regions:
        region = getattr(block, name)
        kw: dict[str, Any] = {} if recomputed_whole(region) else {"context_fn": sac}
        block.register_module(name, checkpoint_wrapper(region, preserve_rng_state=False, **kw))
    return block


def apply_ac(model: nn.Module, ac: ActivationCheckpointConfig, regions: tuple[str, ...]) -> None:
    """Wrap the model's blocks for recomputation in backward, in place: whole blocks (full), every
    N-th block (selective N), or all but the saved ops (selective op).

    Args:
        model: the decoder (models/spec.py's shape) whose `layers` (and side blocks' `block`)
            are wrapped.
        ac: the activation_checkpoint config section: mode, selective option and, for op-level
            SAC, which matmuls to save.
        regions: the family's block submodules op-level SAC wraps one by one in an MoE block
            (attention, feed-forward) instead of the whole block.
    """
    op = ac.mode == "selective" and ac.selective_ac_option == "op"
    every = int(ac.selective_ac_option) if ac.mode == "selective" and not op else 1
    layers = cast(nn.ModuleDict, model.layers)  # the decoder shape of models/spec.py
    for i, (name, block) in enumerate(list(layers.named_children())):
        if i % every == 0:
            layers.register_module(name, _wrap_block(block, ac, regions))
    # A side block's (multi-token prediction depth's) block, counted on after the layers: its
    # norms, projection and the shared head around it stay outside, as the decoder's ends do.
    for i, depth in enumerate(side_blocks(model), start=len(layers)):
        if i % every == 0:
            depth.register_module("block", _wrap_block(depth.get_submodule("block"), ac, regions))
    whole = op and any(recomputed_whole(block) for block in layers.children())
    logger.info(
        "activation checkpointing: %s%s",
        ac.mode
        if ac.mode == "full"
        else f"selective ({ac.selective_ac_option}" + (f", {ac.per_op_sac_save_mm} mm outputs kept)" if op else ")"),
        "; MoE blocks by region, their feed-forwards recomputed whole (router and experts are FSDP units of their own)"
        if whole
        else "",
    )
