"""Apply parallelisms to a family's model in a fixed order: TP, AC, compile, then FSDP or DDP.

What differs between families (a block's TP plan, its norms, its AC regions) comes from the
`ModelFamily`; the rest follows the decoder shape every family shares (models/spec.py).

Precision is not decided here: every dtype choice comes from the `PrecisionPlan`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan_amp.config import ActivationCheckpoint, ConfigError, JobConfig
from torchtitan_amp.context_parallel import ContextParallel, check_seq_len
from torchtitan_amp.expert_parallel import ExpertParallel, shard_experts
from torchtitan_amp.models.moe.moe import MoE, grouped_mm_kernel
from torchtitan_amp.models.spec import ModelFamily
from torchtitan_amp.parallel_dims import ParallelDims
from torchtitan_amp.pipeline import validate_pipeline
from torchtitan_amp.precision import PrecisionPlan, install_comm_hook
from torchtitan_amp.precision.tags import tied_modules
from torchtitan_amp.rules import reshard_after_forward
from torchtitan_amp.torch_compat import grouped_fsdp_casts_every_output

logger = logging.getLogger("torchtitan_amp")

# Op-level selective AC keeps the outputs of these (expensive to recompute) ops: every SDPA
# kernel torch may dispatch (cuDNN's comes first on sm90 with a recent cuDNN, flash/efficient on
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
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    # fp8 scales come from amax: recomputing it in backward could give another scale.
    torch.ops.aten.max.default,
}


def validate_layout(dims: ParallelDims, config: JobConfig, n_heads: int, n_kv_heads: int, n_layers: int,
                    device_type: str) -> tuple[list[int], int]:
    """Refuse combinations torch cannot run, naming the working alternative. Returns the pipeline
    split (first layer of each stage, microbatches per local batch): ([0], 1) without PP."""
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
                    f"'parallelism.tensor_parallel_degree' = {dims.tp} must divide the model's "
                    f"{name} = {heads}"
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
        unmet = {f"a CUDA device (this run is on {device_type})": device_type != "cuda",
                 "compile.enable = true": not config.compile.enable,
                 "tensor_parallel_degree > 1": not dims.tp_enabled}
        missing = [need for need, bad in unmet.items() if bad]
        if missing:
            raise ConfigError(
                "'parallelism.enable_async_tensor_parallel' needs " + ", ".join(missing)
                + " (inductor overlaps TP collectives with the matmuls of compiled blocks, on CUDA only); "
                "set it to false otherwise"
            )
    if dims.pp_enabled:
        # Split points, microbatch counts per schedule: before any process group exists.
        return validate_pipeline(dims, p, n_layers, t.local_batch_size)
    return [0], 1


def validate_ep(dims: ParallelDims, config: JobConfig) -> None:
    """EP needs routed experts that split evenly (over ranks of dp_shard x cp: ParallelDims checks)."""
    from torchtitan_amp.models import get_family

    args = get_family(config.model.name).flavors[config.model.flavor]
    n_experts = getattr(args, "n_routed_experts", 0)
    if not n_experts:
        raise ConfigError(f"'parallelism.expert_parallel_degree' = {dims.ep} needs a model with routed experts; "
                          f"model.name = {config.model.name!r} has none: use 1")
    if n_experts % dims.ep:
        raise ConfigError(f"'parallelism.expert_parallel_degree' = {dims.ep} must divide the model's "
                          f"n_routed_experts = {n_experts}")


def check_weight_tying(args: object, dims: ParallelDims, flavor: str) -> None:
    """A tied output projection is the embedding table: under pipeline parallel the first and
    last stages would each hold and update a copy (torchtitan refuses it too)."""
    if dims.pp_enabled and getattr(args, "enable_weight_tying", False):
        raise ConfigError(
            f"'parallelism.pipeline_parallel_degree' = {dims.pp} cannot split model.flavor '{flavor}', whose "
            "output layer shares the embeddings' weight (enable_weight_tying): the first and last stages "
            "would each hold a copy; use pipeline_parallel_degree 1 (FSDP, HSDP, DDP and TP keep it one tensor)"
        )


def loss_parallel_enabled(dims: ParallelDims, config: JobConfig) -> bool:
    return dims.tp_enabled and not config.parallelism.disable_loss_parallel


def parallel_context(dims: ParallelDims, config: JobConfig) -> contextlib.AbstractContextManager:
    """The context both forward+loss and backward need for parallelism (not precision)."""
    return loss_parallel() if loss_parallel_enabled(dims, config) else contextlib.nullcontext()


def parallelize_model(model: nn.Module, family: ModelFamily, dims: ParallelDims, plan: PrecisionPlan,
                      config: JobConfig) -> nn.Module:
    plan.apply_fp32_islands(model)
    if dims.tp_enabled:
        apply_tp(model, family, dims.mesh["tp"], loss_parallel_enabled(dims, config),
                 config.parallelism.enable_sequence_parallel)
        plan.refreeze(model)
        if config.parallelism.enable_async_tensor_parallel:
            apply_async_tp(dims.mesh["tp"])
    if dims.cp_enabled:
        apply_cp(model, plan.context_parallel(dims.mesh["cp"].get_group()))
    if dims.ep_enabled:
        apply_ep(model, dims.ep_mesh, dims.expert_mesh)
    apply_expert_kernels(model, plan, config.compile.enable)
    if config.activation_checkpoint.mode != "none":
        apply_ac(model, config.activation_checkpoint, family.ac_regions)
    if config.compile.enable:
        # Blocks hold nested fp32 FSDP groups (norms) on the FSDP path, whose hooks dynamo cannot
        # trace, and a family may read sizes on the host (MoE): allow graph breaks there.
        apply_compile(model, fullgraph=plan.path != "fsdp" and family.compile_fullgraph)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.fsdp_mesh, plan, config.parallelism.fsdp_reshard_after_forward,
                   dims.pp_enabled, dims.expert_fsdp_mesh if dims.ep_enabled else None)
    elif dims.ddp_enabled:
        apply_ddp(model, dims.mesh["dp_replicate"], plan, config.parallelism.ddp_bucket_cap_mb)
    return model


def apply_tp(model: nn.Module, family: ModelFamily, mesh: DeviceMesh, loss_parallel_on: bool,
             sequence_parallel: bool) -> None:
    """Megatron-style TP: each block by the family's plan (Llama: q/k/v and w1/w3 column-wise, wo
    and w2 row-wise), its norms sequence-parallel; the embedding row-wise, the output column-wise.

    Absent stage ends (pipeline parallel sets them to None) are skipped.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    tied = model.tok_embeddings is not None and model.output is not None and \
        model.output.weight is model.tok_embeddings.weight
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel_on else Replicate(),
            use_local_output=not loss_parallel_on,
        )
    parallelize_module(model, mesh, top)
    if tied:
        # Each style distributed its own module's copy; both shard the vocab rows (Shard(0)), so
        # the embedding's DTensor serves the output too, and both uses add into one gradient.
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        block_plan = family.tp_block_plan(seq, block)
        if sequence_parallel:
            block_plan.update({name: SequenceParallel() for name in family.block_norms})
        else:
            for name in family.block_norms:
                _replicate_params(getattr(block, name), mesh)
        parallelize_module(block, mesh, block_plan)
    if model.norm is not None and not sequence_parallel:
        _replicate_params(model.norm, mesh)
    logger.info("applied tensor parallel (degree %d, sequence parallel %s, loss parallel %s)",
                mesh.size(), sequence_parallel, loss_parallel_on)


def apply_cp(model: nn.Module, cp: ContextParallel) -> None:
    """Hand the cp group to every module of the model that attends across the sequence (those
    declaring a `context_parallel` attribute: the model, for its mask, and each attention)."""
    for module in model.modules():
        if hasattr(type(module), "context_parallel"):
            module.context_parallel = cp
    logger.info("applied context parallel (degree %d): K/V all-gathered per layer, gradients "
                "reduce-scattered in %s", cp.group.size(), str(cp.reduce_dtype).removeprefix("torch."))


def expert_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, expert_mesh: DeviceMesh) -> None:
    """Split each MoE layer's routed experts over `ep_mesh` and let the layer dispatch to them.

    Under TP `expert_mesh` is (ep, tp): the experts are not split by TP (ETP = 1) and the MoE layer
    is replicated over tp (models/moe/parallelize.py), so every TP rank routes the whole sequence
    and exchanges the same tokens with its EP peers of the same tp coordinate (redundantly:
    torchtitan's ETP = 1 instead takes the tp ranks into the ep group and splits the tokens).
    """
    layers = expert_layers(model)
    for layer in layers:
        shard_experts(layer.experts, expert_mesh)
        layer.expert_parallel = ExpertParallel(ep_mesh.get_group(), ep_mesh.size())
    logger.info("applied expert parallel (degree %d) to %d MoE layers: tokens dispatched and combined by "
                "all-to-all in the activations' dtype", ep_mesh.size(), len(layers))


def apply_expert_kernels(model: nn.Module, plan: PrecisionPlan, compiled: bool) -> None:
    """Decide once, here, whether each MoE layer's experts run the grouped matmul or the loop
    (moe.grouped_mm_kernel), for the dtype the plan has them compute in on this device."""
    layers = expert_layers(model)
    if not layers or (plan.device_type == "cuda" and not torch.cuda.is_available()):
        return  # nothing to decide, or a dry run sizing GPUs on a machine without one (nothing runs)
    device = f"cuda:{torch.cuda.current_device()}" if plan.device_type == "cuda" else plan.device_type
    for layer in layers:
        experts = layer.experts
        experts.grouped_mm = grouped_mm_kernel(device, plan.compute_dtype(experts), compiled)


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Let inductor micro-pipeline TP (all-gather/reduce-scatter fused with the matmuls) in the
    compiled blocks. validate_layout has checked CUDA + compile + TP degree > 1."""
    import torch._inductor.config
    from torch.distributed import _symmetric_memory

    torch._inductor.config._micro_pipeline_tp = True
    # Older torch needs the TP group registered for symmetric memory; newer torch (2.13 here)
    # registers groups itself and marks this call deprecated.
    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None and not getattr(enable, "__deprecated__", None):
        enable(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel enabled (inductor micro-pipeline TP)")


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make a module's params replicated DTensors while its inputs/outputs stay plain tensors,
    so that foreach optimizer and norm kernels never see plain and DTensor params mixed."""
    distribute_module(
        module, mesh,
        input_fn=lambda _m, args, mesh: tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args),
        output_fn=lambda _m, out, _mesh: out.to_local(),
    )


def _op_sac_policy(save_mm: str) -> Callable[..., CheckpointPolicy]:
    """Keep the outputs of SAC_SAVE_LIST's ops, but with save_mm="alternate" only the 1st, 3rd,
    5th... aten.mm of the region (torchtitan's rule: about half the matmul outputs, each
    recomputed one costing a matmul in backward). A fresh counter per region call, counted apart
    in forward and recompute (torch 2.13 asks the policy in forward only; older torch also asked
    it in the recompute, where the count must start again)."""
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
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
    return any(isinstance(m, MoE) for m in region.modules())


def _wrap_block(block: nn.Module, ac: ActivationCheckpoint, regions: tuple[str, ...]) -> nn.Module:
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
        kw = {} if recomputed_whole(region) else {"context_fn": sac}
        block.register_module(name, checkpoint_wrapper(region, preserve_rng_state=False, **kw))
    return block


def apply_ac(model: nn.Module, ac: ActivationCheckpoint, regions: tuple[str, ...]) -> None:
    """Recompute whole blocks (full), every N-th block, or all but the saved ops (op)."""
    op = ac.mode == "selective" and ac.selective_ac_option == "op"
    every = int(ac.selective_ac_option) if ac.mode == "selective" and not op else 1
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if i % every == 0:
            model.layers.register_module(name, _wrap_block(block, ac, regions))
    whole = op and any(recomputed_whole(block) for block in model.layers.children())
    logger.info("activation checkpointing: %s%s", ac.mode if ac.mode == "full" else
                f"selective ({ac.selective_ac_option}" + (f", {ac.per_op_sac_save_mm} mm outputs kept)" if op else ")"),
                "; MoE blocks by region, their feed-forwards recomputed whole (router and experts "
                "are FSDP units of their own)" if whole else "")


def apply_compile(model: nn.Module, fullgraph: bool = True) -> None:
    """Compile each block in place; in-place `compile()` keeps parameter names unchanged."""
    for block in model.layers.children():
        block.compile(fullgraph=fullgraph)
    logger.info("compiled each transformer block with torch.compile")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, plan: PrecisionPlan, reshard_policy: str,
               pp_enabled: bool = False, expert_mesh: DeviceMesh | None = None) -> None:
    """Shard bottom-up: expert-parallel experts on their own mesh, fp32 groups for modules outside
    the safe list, then blocks, then root."""
    shard = partial(fully_shard, mesh=mesh)
    reshard = partial(reshard_after_forward, reshard_policy, pp_enabled=pp_enabled)
    if expert_mesh is not None:
        shard_ep_experts(model, expert_mesh, mesh.size(), plan, reshard)
    if plan.path == "fsdp":
        fp32 = [m for m in plan.fp32_modules(model) if m is not model]
        # A group's output_dtype must reach each norm's output (torch_compat says where it does).
        for group in reversed(group_by_block(model, fp32, grouped=grouped_fsdp_casts_every_output())):
            shard(group, mp_policy=plan.fsdp_policy(low_precision=False), reshard_after_forward=reshard(False))
        # Frozen modules stored in param_dtype: no group mixes them with fp32 trained parameters.
        for group in reversed(group_by_block(model, plan.frozen_low_precision_modules(model))):
            shard(group, mp_policy=plan.fsdp_policy(low_precision=True), reshard_after_forward=reshard(False))
    blocks = list(model.layers.children())
    for i, block in enumerate(blocks):
        # Only the hidden state is cast to param dtype: the rotary tables must stay fp32.
        shard(block, mp_policy=plan.fsdp_policy(low_precision=True, cast_forward_inputs=False),
              reshard_after_forward=reshard(i == len(blocks) - 1))
        plan.cast_block_inputs(block)
    # The root's forward ends the step, so keeping its params gathered saves one all-gather
    # (rules.reshard_after_forward's is_last).
    # Only the stage that produces logits casts to output_dtype: earlier pipeline stages send
    # hidden states to the next stage in param dtype, not at twice the bytes in fp32.
    output_dtype = plan.output_dtype if model.output is not None else None
    shard(model, mp_policy=plan.fsdp_policy(low_precision=True, output_dtype=output_dtype),
          reshard_after_forward=reshard(True))
    logger.info("applied FSDP2 fully_shard over mesh %s", mesh.mesh_dim_names)


def shard_ep_experts(model: nn.Module, mesh: DeviceMesh, dp_size: int, plan: PrecisionPlan,
                     reshard: partial) -> None:
    """FSDP for EP-sharded experts, first, so that no later group takes their parameters.

    Their gradients are sums over every EP rank's tokens (the all-to-all's backward brings them),
    so FSDP's mean over the expert mesh alone would leave them ep times the other parameters';
    dividing by the full data-parallel size gives the mean over every rank's loss.
    On dim 1: dim 0 is already split by EP, and a second split of it would be a strided layout.
    """
    for layer in expert_layers(model):
        experts = layer.experts
        fully_shard(experts, mesh=mesh, mp_policy=plan.fsdp_policy(low_precision=plan.is_safe(experts)),
                    reshard_after_forward=reshard(False), shard_placement_fn=lambda _: Shard(1))
        experts.set_gradient_divide_factor(float(dp_size))
        # Gloo has no pre-multiplied sum: sum, then FSDP divides the shard itself. Not on one
        # efsdp rank, where torch divides its copy already and forcing would divide twice.
        efsdp = mesh.get_group(mesh.ndim - 1)
        experts.set_force_sum_reduction_for_comms(efsdp.size() > 1 and dist.get_backend(efsdp) == "gloo")


def group_by_block(model: nn.Module, modules: list[nn.Module],
                   grouped: bool = True) -> list[nn.Module | list[nn.Module]]:
    """FSDP units for modules that must not share their blocks' groups (fp32 norms, frozen
    modules): one per transformer block for those inside it, one for all those outside blocks
    (embeddings, final norm), in first-appearance order. Each unit gathers and reduces once where
    a group per module would pay a collective's latency each; every parameter is padded and
    sharded on its own either way, so bytes and numerics do not change. grouped=False: one unit
    per module, except that modules sharing a weight are always one unit (FSDP holds a parameter
    in one group)."""
    if not grouped:  # but modules sharing a weight (a tied embedding and output) stay one unit
        tie = {id(m): id(group[0][1]) for group in tied_modules(model) for _, m in group}
        by_key: dict[int, list[nn.Module]] = {}
        for m in modules:
            by_key.setdefault(tie.get(id(m), id(m)), []).append(m)
        return [unit[0] if len(unit) == 1 else unit for unit in by_key.values()]
    block_of = {id(m): name for name, block in model.layers.named_children() for m in block.modules()}
    units: dict[str | None, list[nn.Module]] = {}
    for m in modules:
        units.setdefault(block_of.get(id(m)), []).append(m)
    return [unit[0] if len(unit) == 1 else unit for unit in units.values()]


def apply_ddp(model: nn.Module, mesh: DeviceMesh, plan: PrecisionPlan, bucket_cap_mb: float = 25.0) -> None:
    replicate(model, device_mesh=mesh, bucket_cap_mb=bucket_cap_mb)
    install_comm_hook(model, plan.comm_hook_state(model, mesh.get_group()))
    logger.info("applied DDP (replicate) over mesh %s, comm hook %s", mesh.mesh_dim_names, plan.comm_hook)
