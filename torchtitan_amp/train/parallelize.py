"""Apply parallelisms to a family's model in a fixed order: TP, CP, EP, AC, compile, then FSDP or
DDP; and the layout checks that refuse what torch cannot run, before any process group exists.

What differs between families (a block's TP plan, its norms, its AC regions) comes from the
`ModelFamily`; the rest follows the decoder shape every family shares (models/spec.py).
Precision is not decided here: every dtype choice comes from the `PrecisionPlan`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from torchtitan_amp.config import ConfigError, JobConfig
from torchtitan_amp.distributed.activation_checkpoint import apply_ac
from torchtitan_amp.distributed.compile import apply_compile
from torchtitan_amp.distributed.context_parallel import apply_cp, check_seq_len
from torchtitan_amp.distributed.expert_parallel import apply_ep, expert_layers
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.distributed.pipeline import validate_pipeline
from torchtitan_amp.distributed.tensor_parallel import apply_async_tp, apply_tp, loss_parallel_enabled
from torchtitan_amp.models import get_family
from torchtitan_amp.models.moe.moe import grouped_mm_kernel
from torchtitan_amp.models.spec import ModelFamily
from torchtitan_amp.observability import traffic
from torchtitan_amp.precision import PrecisionPlan, autocast, freeze
from torchtitan_amp.train.data_parallel import apply_ddp, apply_fsdp

logger = logging.getLogger("torchtitan_amp")


def validate_layout(
    dims: ParallelDims, config: JobConfig, n_heads: int, n_kv_heads: int, n_layers: int, device_type: str
) -> tuple[list[int], int]:
    """Refuse combinations torch cannot run, naming the working alternative. Returns the pipeline
    split (first layer of each stage, microbatches per local batch): ([0], 1) without PP.

    Args:
        dims: the parallel degrees.
        config: the job config.
        n_heads: the model's attention heads (TP must divide them).
        n_kv_heads: the model's key/value heads (TP must divide them).
        n_layers: the model's transformer blocks (the pipeline split).
        device_type: the device the job trains on ("cuda", "cpu").
    """
    if dims.ddp_enabled and dims.tp_enabled:
        raise ConfigError(
            "'parallelism.data_parallel_replicate_degree' > 1 with tensor_parallel_degree > 1 and no "
            "sharding is not possible: DDP cannot hold DTensor parameters; use "
            "data_parallel_shard_degree (FSDP x TP) or both degrees (HSDP x TP) instead"
        )
    if dims.tp_enabled:
        for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            if heads % dims.tp:
                raise ConfigError(
                    f"'parallelism.tensor_parallel_degree' = {dims.tp} must divide the model's {name} = {heads}"
                )
    t, p = config.training, config.parallelism
    if dims.ep_enabled:
        validate_ep(dims, config)
    check_seq_len(t.seq_len, dims.cp)
    if dims.tp_enabled and p.enable_sequence_parallel and (t.seq_len // dims.cp) % dims.tp:
        per_rank = f" / context_parallel_degree {dims.cp}" if dims.cp_enabled else ""
        raise ConfigError(
            f"'training.seq_len' = {t.seq_len}{per_rank} must be divisible by tensor_parallel_degree = "
            f"{dims.tp} with sequence parallel on (or set parallelism.enable_sequence_parallel = false)"
        )
    if p.enable_async_tensor_parallel:
        unmet = {
            f"a CUDA device (this run is on {device_type})": device_type != "cuda",
            "compile.enable = true": not config.compile.enable,
            "tensor_parallel_degree > 1": not dims.tp_enabled,
        }
        missing = [need for need, bad in unmet.items() if bad]
        if missing:
            raise ConfigError(
                "'parallelism.enable_async_tensor_parallel' needs "
                + ", ".join(missing)
                + " (inductor overlaps TP collectives with the matmuls of compiled blocks, on CUDA only); "
                "set it to false otherwise"
            )
    if dims.pp_enabled:
        # Split points, microbatch counts per schedule: before any process group exists.
        return validate_pipeline(dims, p, n_layers, t.local_batch_size)
    return [0], 1


def validate_ep(dims: ParallelDims, config: JobConfig) -> None:
    """EP needs routed experts that split evenly (over ranks of dp_shard x cp: ParallelDims checks)."""
    args = get_family(config.model.name).flavors[config.model.flavor]
    n_experts = getattr(args, "n_routed_experts", 0)
    if not n_experts:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' = {dims.ep} needs a model with routed experts; "
            f"model.name = {config.model.name!r} has none: use 1"
        )
    if n_experts % dims.ep:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' = {dims.ep} must divide the model's n_routed_experts = {n_experts}"
        )


def check_weight_tying(args: object, dims: ParallelDims, flavor: str) -> None:
    """Refuse a tied output projection under pipeline parallel: it is the embedding table, and the
    first and last stages would each hold and update a copy (torchtitan refuses it too).

    Args:
        args: the model args (their `enable_weight_tying`, when the family has it).
        dims: the parallel degrees (pp).
        flavor: model.flavor, named in the message.
    """
    if dims.pp_enabled and getattr(args, "enable_weight_tying", False):
        raise ConfigError(
            f"'parallelism.pipeline_parallel_degree' = {dims.pp} cannot split model.flavor '{flavor}', whose "
            "output layer shares the embeddings' weight (enable_weight_tying): the first and last stages "
            "would each hold a copy; use pipeline_parallel_degree 1 (FSDP, HSDP, DDP and TP keep it one tensor)"
        )


def check_mtp(args: object, dims: ParallelDims, flavor: str) -> None:
    """Refuse multi-token prediction (DeepSeek-V3's mtp_depth > 0) on the layouts it does not run
    on: CP (depth k shifts every sequence by k tokens, across the cp ranks' chunks). FSDP, HSDP,
    DDP, EP, TP and PP run it: each depth is an FSDP unit like a block (train/data_parallel.py),
    its MoE layer split as any, in the family's TP plan (models/deepseek_v3/parallelize.py), and
    on the last pipeline stage, the embeddings passed along the stages to it.

    Args:
        args: the model args (their `mtp_depth`, when the family has it).
        dims: the parallel degrees.
        flavor: model.flavor, named in the message.
    """
    depth = getattr(args, "mtp_depth", 0)
    refused = [
        (dims.cp_enabled, "context_parallel_degree", dims.cp, "depth k shifts each sequence across the cp chunks"),
    ]
    for on, option, degree, why in refused:
        if depth and on:
            raise ConfigError(
                f"'parallelism.{option}' = {degree} cannot train model.flavor '{flavor}' with mtp_depth = {depth}: "
                f"multi-token prediction runs on FSDP, HSDP, DDP, EP, TP and PP, not here ({why}); use a flavor "
                "with mtp_depth 0 for this layout"
            )


def parallelize_model(
    model: nn.Module, family: ModelFamily, dims: ParallelDims, plan: PrecisionPlan, config: JobConfig
) -> nn.Module:
    """Apply the layout to one model part in place, in torchtitan's order: fp32 islands, TP, CP, EP,
    expert kernels, AC, compile, then FSDP or DDP. Returns the part.

    Args:
        model: the model or pipeline stage, on meta.
        family: the model family: TP plan, block norms, AC regions, compile settings.
        dims: the parallel degrees and meshes.
        plan: the precision plan.
        config: the job config (AC, compile, parallelism options).
    """
    autocast.apply_fp32_islands(plan, model)
    if dims.tp_enabled:
        apply_tp(
            model,
            family.tp_block_plan,
            family.block_norms,
            dims.mesh["tp"],
            loss_parallel_enabled(dims, config),
            config.parallelism.enable_sequence_parallel,
        )
        freeze.refreeze(model)
        if config.parallelism.enable_async_tensor_parallel:
            apply_async_tp(dims.mesh["tp"])
    if dims.cp_enabled:
        apply_cp(model, plan.context_parallel(dims.mesh["cp"].get_group()))
    if dims.ep_enabled:
        apply_ep(model, dims.get_mesh("ep"), dims.get_mesh("expert"))
    apply_expert_kernels(model, plan, config.compile.enable)
    if config.activation_checkpoint.mode != "none":
        apply_ac(model, config.activation_checkpoint, family.ac_regions)
    if config.compile.enable:
        # Blocks hold nested fp32 FSDP groups (norms) on the FSDP path, whose hooks dynamo cannot
        # trace, and a family may read sizes on the host (MoE): allow graph breaks there.
        apply_compile(model, fullgraph=plan.path != "fsdp" and family.compile_fullgraph)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.get_mesh("fsdp"),
            plan,
            config.parallelism.fsdp_reshard_after_forward,
            dims.pp_enabled,
            dims.get_mesh("expert_fsdp") if dims.ep_enabled else None,
        )
    elif dims.ddp_enabled:
        apply_ddp(
            model,
            dims.mesh["dp_replicate"],
            plan,
            config.parallelism.ddp_bucket_cap_mb,
            default_hook=traffic.default_ddp_hook(),
        )
    return model


def apply_expert_kernels(model: nn.Module, plan: PrecisionPlan, compiled: bool) -> None:
    """Decide once, here, whether each MoE layer's experts run the grouped matmul or the loop
    (moe.grouped_mm_kernel), for the dtype the plan has them compute in on this device.

    Args:
        model: the model whose expert layers are set.
        plan: the precision plan: device type and each module's compute dtype.
        compiled: True when the blocks are compiled (compile.enable).
    """
    layers = expert_layers(model)
    if not layers or (plan.device_type == "cuda" and not torch.cuda.is_available()):
        return  # nothing to decide, or a dry run sizing GPUs on a machine without one (nothing runs)
    device = f"cuda:{torch.cuda.current_device()}" if plan.device_type == "cuda" else plan.device_type
    for layer in layers:
        experts: Any = layer.experts  # an expert layer's (models/moe's MoE) routed experts and their kernel slot
        experts.grouped_mm = grouped_mm_kernel(device, plan.compute_dtype(experts), compiled)
