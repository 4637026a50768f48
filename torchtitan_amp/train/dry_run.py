"""Fake-backend dry run: size one rank of a large job on a laptop, without its hardware.

`python train.py --job.dry_run --dry_run.world_size 512 --dry_run.rank 0 ...` (or
`COMM_MODE=fake_backend NGPU=512 ./run_llama_train.sh`) runs one process that

1. joins a fake process group (torch's "fake" backend over a FakeStore) as `rank` of
   `world_size`, so every collective is a no-op but every group and mesh is real;
2. runs the trainer's own set-up on a model built on the meta device: `job.resolve` (every
   config-time check, the precision plan, the pipeline split) for the target device
   (dry_run.device, default cuda: GPU-only options such as fp8 all-gather are sized, not refused)
   and `job.build_model_parts` for this rank's stages (fp8, TP, AC, FSDP2/HSDP or DDP), minus
   weight initialisation; nothing is allocated (meta tensors have shapes only);
3. reads this rank's parameter shards from the result (DTensor local shapes and FSDP2's padded
   shards), its FSDP groups (mixed-precision policy, reshard-after-forward) and DDP's safe set,
   and adds what a meta model cannot show (activations, TP and PP traffic) from the formulas in
   `torchtitan_amp.memory`;
4. prints a table and writes `<dump_folder>/dry_run.json`. Its peak is allocated memory; the CUDA
   caching allocator reserves at least that (no allowance is added: none is measured here).

Parameter, gradient, optimizer and FSDP/DDP traffic numbers are checked against real
multi-process runs in tests/test_dry_run.py.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_amp import memory
from torchtitan_amp.config import ConfigError, JobConfig
from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.core.torch_compat import fsdp_param_groups
from torchtitan_amp.distributed.process_groups import local_tensor as _local
from torchtitan_amp.distributed.process_groups import unwrapped_name
from torchtitan_amp.memory import ByDtype, FsdpGroup, Stage
from torchtitan_amp.models.spec import synced_buffer_elements
from torchtitan_amp.precision import PrecisionPlan, dtype_name
from torchtitan_amp.precision.lowbit import float8
from torchtitan_amp.train.dry_run_report import Measured, assemble, format_table
from torchtitan_amp.train.job import Job, build_model_parts
from torchtitan_amp.train.job import resolve as resolve_job

logger = logging.getLogger("torchtitan_amp")

REPORT_NAME = "dry_run.json"


def resolve_world_size(config: JobConfig) -> int:
    ws = config.dry_run.world_size
    if ws != -1:
        return ws
    p = config.parallelism
    return (
        p.data_parallel_replicate_degree
        * max(p.data_parallel_shard_degree, 1)
        * p.tensor_parallel_degree
        * p.pipeline_parallel_degree
        * p.context_parallel_degree
    )


def init_fake_process_group(world_size: int, rank: int) -> bool:
    """Join a fake process group (collectives do nothing); False when one already exists."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) already exists; "
                f"the dry run needs rank {rank} of {world_size}"
            )
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return True


def _fsdp_params(parts: list[nn.Module]) -> dict[int, Any]:
    """id(sharded parameter) -> its FSDPParam, for padded shard sizes."""
    out = {}
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                for group in fsdp_param_groups(module._get_fsdp_state()):
                    for fp in group.fsdp_params:
                        out[id(fp.sharded_param)] = fp
    return out


def _nf4_inner(t: torch.Tensor) -> list[torch.Tensor]:
    """An NF4Tensor's inner tensors (torch's subclass flattening protocol)."""
    return [getattr(t, n) for n in cast(Any, t).__tensor_flatten__()[0]]


def measure_state(parts: list[nn.Module], state_dtype: torch.dtype | None = None) -> memory.StateBytes:
    """This rank's params, grads and AdamW state (exp_avg and exp_avg_sq in `state_dtype`, None: the
    param's, plus a 0-d fp32 `step` per trained tensor), read off the meta model. Grads have the
    param's local shape and dtype, except a TP-sharded embedding outside FSDP, whose gradient
    DTensor's embedding backward returns replicated (the full table; see memory.state_bytes). A
    parameter two modules share (a tied embedding) counts once, and its gradient is sharded: the
    output's Shard(0) gradient is accumulated first and the embedding's adds into it (measured on
    TP 2)."""
    out = memory.StateBytes()
    fsdp = _fsdp_params(parts)
    seen: set[int] = set()
    for part in parts:
        owners = Counter(id(p) for m in part.modules() for p in m.parameters(recurse=False))
        for module in part.modules():
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                local = _local(p)
                dtype, size = dtype_name(local.dtype), local.element_size()
                if type(local).__name__ == "NF4Tensor":  # QLoRA's frozen base: its codes, scales and tables
                    nf4 = sum(t.numel() * t.element_size() for t in _nf4_inner(local))
                    memory.add_bytes(out.params, "uint8", nf4)
                    memory.add_bytes(out.params_padded, "uint8", nf4)
                    out.num_params += local.numel()
                    out.num_tensors += 1
                    continue
                fp = fsdp.get(id(p))
                padded = fp.padded_sharded_param_size.numel() if fp is not None else local.numel()
                out.num_params += local.numel()
                out.num_tensors += 1
                memory.add_bytes(out.params, dtype, local.numel() * size)
                memory.add_bytes(out.params_padded, dtype, padded * size)
                scale = getattr(module, "weight_scale", None)  # an fp8 LoRA base's fp32 row scales
                if scale is not None and p is getattr(module, "weight", None):
                    memory.add_bytes(out.params, "float32", scale.numel() * 4)
                    memory.add_bytes(out.params_padded, "float32", scale.numel() * 4)
                if p.requires_grad:
                    replicated_grad = (
                        isinstance(module, nn.Embedding)
                        and isinstance(p, DTensor)
                        and fp is None
                        and owners[id(p)] == 1
                    )
                    grad = p.numel() if replicated_grad else local.numel()
                    memory.add_bytes(out.grads, dtype, grad * size)
                    state = state_dtype or local.dtype
                    memory.add_bytes(out.optimizer, dtype_name(state), 2 * local.numel() * state.itemsize)
                    memory.add_bytes(out.optimizer, "float32", memory.ADAMW_STEP_BYTES)
    return out


def fp8_gathered_params(parts: list[nn.Module], plan: PrecisionPlan) -> set[int]:
    """ids of the parameters FSDP all-gathers in fp8 (mixed_precision.fp8_all_gather): the weights
    of the Linears the plan runs in fp8, whether torchao converted them on meta or, not installed,
    left them nn.Linear (the same rule picks both, so the sizes agree)."""
    if not plan.fp8_all_gather:
        return set()
    return {
        id(m.weight)
        for part in parts
        for name, m in part.named_modules()
        if float8.is_fp8_linear(unwrapped_name(name), m, plan.fp8, plan.fp8_skip)
    }


def fsdp_groups_of(
    part: nn.Module, fsdp_shard: int, fp8_params: frozenset[int] | set[int] = frozenset()
) -> list[FsdpGroup]:
    """The FSDP2 groups `apply_fsdp` really created on a stage, as memory.FsdpGroup; one sharded
    over other than the `fsdp_shard` ranks is an EP-split experts group (kind "experts").

    Args:
        part: one pipeline stage (or the whole model) after parallelization on meta.
        fsdp_shard: the FSDP shard degree (dp_shard x cp).
        fp8_params: ids of the weights whose all-gather sends float8 (fp8_gathered_params).
    """
    groups, seen = [], set()
    names = {id(m): unwrapped_name(name) for name, m in part.named_modules()}
    for name, module in part.named_modules():
        # A unit over several modules (parallelize.group_by_block) is one state shared by all.
        if not isinstance(module, FSDPModule) or id(state := module._get_fsdp_state()) in seen:
            continue
        seen.add(id(state))
        for g in fsdp_param_groups(state):
            orig = dtype_name(g.fsdp_params[0].sharded_param.dtype)
            gather = dtype_name(g.mp_policy.param_dtype) if g.mp_policy.param_dtype else orig
            reduce = dtype_name(g.mp_policy.reduce_dtype) if g.mp_policy.reduce_dtype else gather
            group = "+".join(names[id(m)] for m in g.modules) or "root"
            kind = "root" if module is part else "block" if _block_group(name, group, list(g.modules)) else "fp32"
            shards = g.mesh_info.shard_mesh_size
            if shards != fsdp_shard:
                kind = "experts"
            groups.append(
                FsdpGroup(
                    group,
                    sum(fp.padded_sharded_param_size.numel() for fp in g.fsdp_params),
                    gather,
                    reduce,
                    g.post_forward_mesh_info is not None,
                    kind,
                    shards if kind == "experts" else 0,
                    sum(
                        fp.padded_sharded_param_size.numel()
                        for fp in g.fsdp_params
                        if id(fp.sharded_param) in fp8_params
                    ),
                    sum(
                        fp.padded_sharded_param_size.numel()
                        for fp in g.fsdp_params
                        if not fp.sharded_param.requires_grad
                    ),
                )
            )
    return groups


def _block_group(name: str, group: str, modules: list[nn.Module]) -> bool:
    """A block's own group (module "layers.N"), or under LoRA one of the two that replace it (the
    `group` of modules "a+b+..."): the block's frozen Linears (LoraLinears among them) or its
    adapters (lora_A / lora_B)."""
    if name.count(".") == 1 and name.startswith("layers."):
        return True
    names = group.split("+")
    lora = any(hasattr(m, "lora_A") or n.endswith((".lora_A", ".lora_B")) for n, m in zip(names, modules))
    return lora and names[0].startswith("layers.") and len({".".join(n.split(".")[:2]) for n in names}) == 1


def _ddp_params(parts: list[nn.Module], plan: PrecisionPlan) -> list[tuple[int, bool]]:
    # By parameter: a tied one is reduced once (its modules have one precision: align_tied_modules).
    found = {
        id(p): (_local(p).numel(), plan.is_safe(m))
        for part in parts
        for m in part.modules()
        for p in m.parameters(recurse=False)
        if p.requires_grad
    }
    return list(found.values())


def resolve(config: JobConfig, world_size: int | None = None) -> Job:
    """Validate the layout for `world_size` ranks (default: dry_run.world_size, else the product
    of the degrees) with the trainer's own checks (job.resolve) and derive the analytic inputs;
    raises ConfigError as the trainer would. Cheap: no process group, no model. Precision is
    decided for the target device, dry_run.device (default cuda), whatever machine runs this:
    what only that device could answer (bf16 support, torchao, fp8 matmuls) is not asked."""
    world_size = resolve_world_size(config) if world_size is None else world_size
    return resolve_job(config, world_size, config.dry_run.device, dry_run=True)


def run(
    config: JobConfig, *, world_size: int | None = None, rank: int | None = None, write: bool = True
) -> dict[str, Any]:
    """Dry-run one rank; returns the report (and writes <dump_folder>/dry_run.json).

    Args:
        config: the job config of the job being sized.
        world_size: the ranks of that job (None: dry_run.world_size, else the degrees' product).
        rank: the rank to size (None: dry_run.rank).
        write: False to return the report without writing it.
    """
    start = time.perf_counter()
    res = resolve(config, world_size)
    world_size, dims = res.world_size, res.dims
    rank = config.dry_run.rank if rank is None else rank
    if not 0 <= rank < world_size:
        raise ConfigError(f"'dry_run.rank' = {rank} must be in [0, {world_size}) for world size {world_size}")
    created = init_fake_process_group(world_size, rank) if world_size > 1 else False
    try:
        if world_size > 1:
            dims.build_mesh("cpu")
        coords = dims.coordinates(world_size)
        stages = memory.rank_stages(res.model_dims, res.layout, coords["pp"])
        built = build_model_parts(res, torch.device("meta"), [s.index for s in stages], materialize=False)
        report = _report(config, res, rank, coords, stages, built.parts, built.num_params, built.flops_per_token)
    finally:
        if created:
            dist.destroy_process_group()
    report["elapsed_s"] = round(time.perf_counter() - start, 2)
    if write:
        folder = Path(config.job.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _report(
    config: JobConfig,
    res: Job,
    rank: int,
    coords: dict[str, int],
    stages: list[Stage],
    parts: list[nn.Module],
    total_params: int,
    flops_per_token: float,
) -> dict[str, Any]:
    """Measure this rank's state, FSDP groups and traffic on its meta model `parts`, add the
    analytic activations, and assemble the report (dry_run_report.assemble)."""
    plan, layout, pp_rank = res.plan, res.layout, coords["pp"]
    state = measure_state(parts, plan.optimizer_state_dtype)
    analytic = memory.state_bytes(
        res.model_dims,
        res.precision,
        layout,
        pp_rank=pp_rank,
        tp_rank=coords["tp"],
        dp_shard_rank=layout.fsdp_rank(coords["dp_shard"], coords["cp"]),
    )
    fp8_params = fp8_gathered_params(parts, plan)
    stage_groups = (
        [(s, fsdp_groups_of(part, res.dims.fsdp_shard, fp8_params)) for s, part in zip(stages, parts)]
        if res.dims.fsdp_enabled
        else []
    )
    comm, calls, transient = _traffic(res, coords, stages, parts, state, stage_groups)
    measured = Measured(
        state=state,
        analytic_state_matches=(analytic.params, analytic.grads, analytic.optimizer, analytic.params_padded)
        == (state.params, state.grads, state.optimizer, state.params_padded),
        stage_groups=stage_groups,
        comm=comm,
        calls=calls,
        transient=transient,
        activations=memory.activation_bytes(res.model_dims, res.precision, layout, pp_rank=pp_rank),
        diloco=_diloco(parts, plan),
        total_params=total_params,
        flops_per_token=flops_per_token,
    )
    return assemble(config, res, rank, coords, stages, measured)


def _traffic(
    res: Job,
    coords: dict[str, int],
    stages: list[Stage],
    parts: list[nn.Module],
    state: memory.StateBytes,
    stage_groups: list[tuple[Stage, list[FsdpGroup]]],
) -> tuple[dict[str, ByDtype], dict[str, int], ByDtype]:
    """This rank's bytes per step by collective, FSDP's collective calls, and the transient buffers
    (FSDP's unsharded groups, DDP's gradient buckets)."""
    dims, prec, layout, model_dims, pp_rank = res.dims, res.precision, res.layout, res.model_dims, coords["pp"]
    comm: dict[str, ByDtype] = {}
    calls: dict[str, int] = {}
    transient: ByDtype = {}
    if dims.fsdp_enabled:
        comm.update(memory.fsdp_comm(stage_groups, layout))
        calls = memory.fsdp_calls(stage_groups, layout)
        transient = memory.fsdp_transient(stage_groups, layout)
    elif dims.ddp_enabled:
        comm.update(memory.ddp_comm(_ddp_params(parts, res.plan), prec))
        transient = dict(state.grads)  # DDP's gradient buckets
    elif layout.cross_group_every_step:  # one-rank replica groups: torchft's all-reduce of every gradient
        comm.update(memory.dp_comm(model_dims, prec, layout, pp_rank=pp_rank, tp_rank=coords["tp"]))
    comm.update(memory.tp_comm(model_dims, prec, layout, pp_rank=pp_rank))
    comm.update(memory.cp_comm(model_dims, prec, layout, pp_rank=pp_rank))
    comm.update(memory.pp_comm(model_dims, prec, layout, pp_rank=pp_rank))
    comm.update(model_dims.ep_comm(prec, layout, stages))
    return comm, calls, transient


def _diloco(parts: list[nn.Module], plan: PrecisionPlan) -> dict[str, Any] | None:
    """DiLoCo's cross-group traffic and state on this rank (None unless semi_sync_method is
    "diloco"): every trained shard's pseudo-gradient once per sync, in the plan's wire dtype, the
    global weights and outer momentum in its outer-state dtype, and a sync's buffers (its wire
    buffer and chunk temporaries: train/diloco.py)."""
    if not plan.sync_steps:
        return None
    from torchtitan_amp.train.diloco import CHUNK_ELEMENTS

    # The floating-point persistent buffers (MoE's expert biases) ride along, whole on every rank.
    local = sum(
        _local(p).numel() for part in parts for p in part.parameters() if p.requires_grad
    ) + synced_buffer_elements(parts)
    wire, outer = dtype_name(plan.pseudo_gradient_dtype), dtype_name(plan.outer_state_dtype)
    per_sync = local * DTYPE_BYTES[wire]
    outer_state, sync = memory.diloco_bytes(local, wire, outer, CHUNK_ELEMENTS)
    return {
        "sync_steps": plan.sync_steps,
        "pseudo_gradient_dtype": wire,
        "bytes_per_sync": {wire: per_sync},
        "bytes_per_step": round(per_sync / plan.sync_steps),
        "outer_state": outer_state,
        "sync_buffers": sync,
    }


def main(config: JobConfig) -> int:
    """train.py's entry for job.dry_run / COMM_MODE=fake_backend."""
    report = run(config)
    print(format_table(report), flush=True)
    logger.info("dry run report written to %s", Path(config.job.dump_folder) / REPORT_NAME)
    return 0


def requested(config: JobConfig) -> bool:
    return config.job.dry_run or os.environ.get("COMM_MODE") == "fake_backend"
