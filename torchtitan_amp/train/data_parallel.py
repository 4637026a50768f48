"""Data-parallel wrapping as the precision plan asks: FSDP2 `fully_shard` groups (expert-parallel
experts first, fp32 and frozen groups, blocks, root) with the plan's policies, or DDP (`replicate`)
with the plan's comm hook."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed._composable.replicate import DDP as ReplicateModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Shard

from torchtitan_amp.core.rules import ReshardPolicy, reshard_after_forward
from torchtitan_amp.core.torch_compat import grouped_fsdp_casts_every_output
from torchtitan_amp.distributed.blocks import side_blocks
from torchtitan_amp.distributed.expert_parallel import expert_layers
from torchtitan_amp.precision import PrecisionPlan, comm_hooks, freeze, fsdp, lora
from torchtitan_amp.precision.tags import tied_modules

logger = logging.getLogger("torchtitan_amp")


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: PrecisionPlan,
    reshard_policy: ReshardPolicy,
    pp_enabled: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """FSDP2 in place, bottom-up: expert-parallel experts on their own mesh, fp32 groups for modules
    outside the safe list, then blocks, then root.

    Args:
        model: the model (or pipeline stage) to shard.
        mesh: the FSDP mesh (dp_shard x cp, with dp_replicate for HSDP).
        plan: the precision plan: mixed-precision policies and which modules stay fp32.
        reshard_policy: parallelism.fsdp_reshard_after_forward: "default", "always" or "never".
        pp_enabled: True under pipeline parallel (changes the default resharding).
        expert_mesh: the EP experts' FSDP mesh (None: no expert parallel).
    """
    shard = partial(fully_shard, mesh=mesh)
    reshard = partial(reshard_after_forward, reshard_policy, pp_enabled=pp_enabled)
    if expert_mesh is not None:
        shard_ep_experts(model, expert_mesh, mesh.size(), plan, reshard)
    # LoRA's adapters (fp32 masters) in groups of their own, before the frozen base's take them in.
    for group in reversed(group_by_block(model, lora.adapter_modules(model))):
        shard(group, mp_policy=fsdp.fsdp_policy(plan, low_precision=True), reshard_after_forward=reshard(False))
    if plan.path == "fsdp":
        fp32 = [m for m in plan.fp32_modules(model) if m is not model]
        # A group's output_dtype must reach each norm's output (torch_compat says where it does).
        for group in reversed(group_by_block(model, fp32, grouped=grouped_fsdp_casts_every_output())):
            shard(group, mp_policy=fsdp.fsdp_policy(plan, low_precision=False), reshard_after_forward=reshard(False))
        # Frozen modules stored in param_dtype: no group mixes them with fp32 trained parameters.
        for group in reversed(group_by_block(model, freeze.frozen_low_precision_modules(plan, model))):
            shard(group, mp_policy=fsdp.fsdp_policy(plan, low_precision=True), reshard_after_forward=reshard(False))
    blocks = list(cast(nn.ModuleDict, model.layers).children())  # the decoder shape of models/spec.py
    # Multi-token prediction's depths (models/spec.py's optional `mtp`): a unit each, like a block,
    # whose forward computes all the depth does (its fp32 norms are the nested units above).
    for depth in side_blocks(model):
        shard(
            depth,
            mp_policy=fsdp.fsdp_policy(plan, low_precision=True, cast_forward_inputs=False),
            reshard_after_forward=reshard(False),
        )
        fsdp.cast_block_inputs(plan, depth)
    for i, block in enumerate(blocks):
        # Only the hidden state is cast to param dtype: the rotary tables must stay fp32.
        shard(
            block,
            mp_policy=fsdp.fsdp_policy(plan, low_precision=True, cast_forward_inputs=False),
            reshard_after_forward=reshard(i == len(blocks) - 1),
        )
        fsdp.cast_block_inputs(plan, block)
    # The root's forward ends the step, so keeping its params gathered saves one all-gather
    # (rules.reshard_after_forward's is_last).
    # Only the stage that produces logits casts to output_dtype: earlier pipeline stages send
    # hidden states to the next stage in param dtype, not at twice the bytes in fp32.
    output_dtype = plan.output_dtype if model.output is not None else None
    shard(
        model,
        mp_policy=fsdp.fsdp_policy(plan, low_precision=True, output_dtype=output_dtype),
        reshard_after_forward=reshard(True),
    )
    logger.info("applied FSDP2 fully_shard over mesh %s", mesh.mesh_dim_names)


def shard_ep_experts(model: nn.Module, mesh: DeviceMesh, dp_size: int, plan: PrecisionPlan, reshard: partial) -> None:
    """FSDP for EP-sharded experts, first, so that no later group takes their parameters.

    Their gradients are sums over every EP rank's tokens (the all-to-all's backward brings them),
    so FSDP's mean over the expert mesh alone would leave them ep times the other parameters';
    dividing by the full data-parallel size gives the mean over every rank's loss.
    On dim 1: dim 0 is already split by EP, and a second split of it would be a strided layout.

    Args:
        model: the model whose expert layers' experts are sharded.
        mesh: the experts' FSDP mesh (efsdp ranks).
        dp_size: the full data-parallel size the gradients are divided by.
        plan: the precision plan, for the experts' mixed-precision policy.
        reshard: rules.reshard_after_forward with the policy bound: is_last -> reshard or not.
    """
    for layer in expert_layers(model):
        experts = cast(nn.Module, layer.experts)  # an expert layer's (models/moe's MoE) routed experts
        fully_shard(
            experts,
            mesh=mesh,
            mp_policy=fsdp.fsdp_policy(plan, low_precision=plan.is_safe(experts)),
            reshard_after_forward=reshard(False),
            shard_placement_fn=lambda _: Shard(1),
        )
        sharded = cast(FSDPModule, experts)  # fully_shard made it one
        sharded.set_gradient_divide_factor(float(dp_size))
        # Gloo has no pre-multiplied sum: sum, then FSDP divides the shard itself. Not on one
        # efsdp rank, where torch divides its copy already and forcing would divide twice.
        efsdp = mesh.get_group(mesh.ndim - 1)
        sharded.set_force_sum_reduction_for_comms(efsdp.size() > 1 and dist.get_backend(efsdp) == "gloo")


def group_by_block(
    model: nn.Module, modules: list[nn.Module], grouped: bool = True
) -> list[nn.Module | list[nn.Module]]:
    """FSDP units for modules that must not share their blocks' groups (fp32 norms, frozen
    modules): one per transformer block for those inside it, one for all those outside blocks
    (embeddings, final norm), in first-appearance order; a side block (multi-token prediction's
    depth) counts as a block. Each unit gathers and reduces once where
    a group per module would pay a collective's latency each; every parameter is padded and
    sharded on its own either way, so bytes and numerics do not change.

    Args:
        model: the decoder whose `layers` define the blocks.
        modules: the modules to group, in order.
        grouped: False: one unit per module, except that modules sharing a weight are always one
            unit (FSDP holds a parameter in one group).
    """
    if not grouped:  # but modules sharing a weight (a tied embedding and output) stay one unit
        tie = {id(m): id(group[0][1]) for group in tied_modules(model) for _, m in group}
        by_key: dict[int, list[nn.Module]] = {}
        for m in modules:
            by_key.setdefault(tie.get(id(m), id(m)), []).append(m)
        return [unit[0] if len(unit) == 1 else unit for unit in by_key.values()]
    layers = cast(nn.ModuleDict, model.layers)  # the decoder shape of models/spec.py
    blocks = [(name, block) for name, block in layers.named_children()]
    blocks += [(f"mtp.{i}", depth) for i, depth in enumerate(side_blocks(model))]
    block_of = {id(m): name for name, block in blocks for m in block.modules()}
    units: dict[str | None, list[nn.Module]] = {}
    for m in modules:
        units.setdefault(block_of.get(id(m)), []).append(m)
    return [unit[0] if len(unit) == 1 else unit for unit in units.values()]


def apply_ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: PrecisionPlan,
    bucket_cap_mb: float = 25.0,
    default_hook: Callable[..., Any] | None = None,
) -> None:
    """DDP (`replicate`) in place, with the plan's compress hook.

    Args:
        model: the model (or pipeline stage) to replicate.
        mesh: the dp_replicate mesh.
        plan: the precision plan, whose comm hook reduces the gradients.
        bucket_cap_mb: DDP's gradient bucket size in MiB.
        default_hook: the hook to install when the plan has none (None: DDP's own all-reduce); the
            traffic recorder's visible all-reduce, observability.traffic.default_ddp_hook.
    """
    # QLoRA: DDP's first-forward broadcast of every parameter from rank 0 would carry each NF4 base
    # through a dense flatten and copy it back by requantizing (torchao's copy_), which is not the
    # base it was. Every rank already holds the same model (seeded init, the same base load).
    quantized = plan.lora is not None and (plan.lora.nf4 or plan.lora.fp8)  # every rank quantizes alike
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb, init_sync=not quantized)
    comm_hooks.install_comm_hook(model, comm_hooks.comm_hook_state(plan, model, mesh.get_group()))
    if plan.comm_hook == "none" and default_hook is not None:
        cast(ReplicateModule, model).register_comm_hook(mesh.get_group(), default_hook)  # replicate() made it one
    logger.info("applied DDP (replicate) over mesh %s, comm hook %s", mesh.mesh_dim_names, plan.comm_hook)
