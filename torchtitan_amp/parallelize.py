"""Apply parallelisms to a Llama model in a fixed order: TP, AC, compile, then FSDP or DDP.

Precision is not decided here: every dtype choice comes from the `PrecisionPlan`.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_amp.config import ActivationCheckpoint, ConfigError, JobConfig
from torchtitan_amp.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan, install_comm_hook

logger = logging.getLogger("torchtitan_amp")

# Op-level selective AC keeps the outputs of these (expensive to recompute) ops.
_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def validate_layout(dims: ParallelDims) -> None:
    """Refuse combinations this build cannot run, naming the working alternative."""
    if dims.tp_enabled:
        raise ConfigError(
            "'parallelism.tensor_parallel_degree' > 1 is not supported yet in this build; "
            "use data_parallel_shard_degree (FSDP) or data_parallel_replicate_degree (DDP)"
        )
    if dims.pp_enabled:
        raise ConfigError(
            "'parallelism.pipeline_parallel_degree' > 1 is not supported yet in this build; "
            "use data_parallel_shard_degree (FSDP) or data_parallel_replicate_degree (DDP)"
        )


def parallelize_llama(model: nn.Module, dims: ParallelDims, plan: PrecisionPlan, config: JobConfig) -> nn.Module:
    if config.activation_checkpoint.mode != "none":
        apply_ac(model, config.activation_checkpoint)
    if config.compile.enable:
        apply_compile(model)
    if dims.fsdp_enabled:
        mesh_dims = ("dp_replicate", "dp_shard") if dims.hsdp_enabled else ("dp_shard",)
        apply_fsdp(model, dims.mesh[mesh_dims], plan, config.parallelism.fsdp_reshard_after_forward)
    elif dims.ddp_enabled:
        apply_ddp(model, dims.mesh["dp_replicate"], plan)
    return model


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_LIST else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap_block(block: nn.Module, ac: ActivationCheckpoint) -> nn.Module:
    if ac.mode == "selective" and ac.selective_ac_option == "op":
        return checkpoint_wrapper(
            block, context_fn=partial(create_selective_checkpoint_contexts, _selective_policy),
            preserve_rng_state=False,
        )
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_ac(model: nn.Module, ac: ActivationCheckpoint) -> None:
    """Recompute whole blocks (full), every N-th block, or all but the saved ops (op)."""
    every = int(ac.selective_ac_option) if ac.mode == "selective" and ac.selective_ac_option != "op" else 1
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if i % every == 0:
            model.layers.register_module(name, _wrap_block(block, ac))
    logger.info("activation checkpointing: %s", ac.mode if ac.mode == "full" else
                f"selective ({ac.selective_ac_option})")


def apply_compile(model: nn.Module) -> None:
    """Compile each block in place; in-place `compile()` keeps parameter names unchanged."""
    for block in model.layers.children():
        block.compile(fullgraph=True)
    logger.info("compiled each transformer block with torch.compile")


def _reshard(policy: str, is_last: bool) -> bool:
    return {"always": True, "never": False}.get(policy, not is_last)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, plan: PrecisionPlan, reshard_policy: str) -> None:
    """Shard bottom-up: fp32 groups for modules outside the safe list, then blocks, then root."""
    shard = partial(fully_shard, mesh=mesh)
    if plan.path == "fsdp":
        for module in reversed(list(model.modules())):
            owns_params = any(True for _ in module.parameters(recurse=False))
            if module is not model and owns_params and not plan.is_safe(module):
                shard(module, mp_policy=plan.fsdp_policy(low_precision=False),
                      reshard_after_forward=_reshard(reshard_policy, False))
    blocks = list(model.layers.children())
    for i, block in enumerate(blocks):
        shard(block, mp_policy=plan.fsdp_policy(low_precision=True),
              reshard_after_forward=_reshard(reshard_policy, i == len(blocks) - 1))
    # The root's forward ends the step, so keeping its params gathered saves one all-gather.
    shard(model, mp_policy=plan.fsdp_policy(low_precision=True, output_dtype=plan.output_dtype),
          reshard_after_forward=_reshard(reshard_policy, True))
    logger.info("applied FSDP2 fully_shard over mesh %s", mesh.mesh_dim_names)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, plan: PrecisionPlan) -> None:
    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
    install_comm_hook(model, plan.comm_hook_state(model, mesh.get_group()))
    logger.info("applied DDP (replicate) over mesh %s, comm hook %s", mesh.mesh_dim_names, plan.comm_hook)
