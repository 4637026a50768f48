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
from typing import Any

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


def measure_state(parts: list[nn.Module], state_dtype: torch.dtype | None = None) -> memory.StateBytes:
    """This rank's params, grads and AdamW state (exp_avg and exp_avg_sq in `state_dtype`, None:
    the param's, plus a 0-d fp32 `step` per trained tensor), read off the meta model. Grads have the param's local shape and
    dtype, except a TP-sharded embedding outside FSDP, whose gradient DTensor's embedding backward
    returns replicated (the full table; see memory.state_bytes). A parameter two modules share (a
    tied embedding) counts once, and its gradient is sharded: the output's Shard(0) gradient is
    accumulated first and the embedding's adds into it (measured on TP 2)."""
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
                fp = fsdp.get(id(p))
                padded = fp.padded_sharded_param_size.numel() if fp is not None else local.numel()
                out.num_params += local.numel()
                out.num_tensors += 1
                memory.add_bytes(out.params, dtype, local.numel() * size)
                memory.add_bytes(out.params_padded, dtype, padded * size)
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
    `fp8_params` (fp8_gathered_params): weights whose all-gather sends float8."""
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
            kind = (
                "root" if module is part else "block" if name.count(".") == 1 and name.startswith("layers.") else "fp32"
            )
            shards = g.mesh_info.shard_mesh_size
            if shards != fsdp_shard:
                kind = "experts"
            groups.append(
                FsdpGroup(
                    "+".join(names[id(m)] for m in g.modules) or "root",
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
                )
            )
    return groups


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
    """Dry-run one rank; returns the report (and writes <dump_folder>/dry_run.json)."""
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
    dims, plan, args, layout, num_stages = res.dims, res.plan, res.model_args, res.layout, res.num_stages
    model_dims, prec = res.model_dims, res.precision
    state = measure_state(parts, plan.optimizer_state_dtype)
    analytic = memory.state_bytes(
        model_dims,
        prec,
        layout,
        pp_rank=coords["pp"],
        tp_rank=coords["tp"],
        dp_shard_rank=layout.fsdp_rank(coords["dp_shard"], coords["cp"]),
    )
    fp8_params = fp8_gathered_params(parts, plan)
    stage_groups = (
        [(s, fsdp_groups_of(part, dims.fsdp_shard, fp8_params)) for s, part in zip(stages, parts)]
        if dims.fsdp_enabled
        else []
    )
    comm: dict[str, ByDtype] = {}
    calls: dict[str, int] = {}
    transient: ByDtype = {}
    if dims.fsdp_enabled:
        comm.update(memory.fsdp_comm(stage_groups, layout))
        calls = memory.fsdp_calls(stage_groups, layout)
        transient = memory.fsdp_transient(stage_groups, layout)
    elif dims.ddp_enabled:
        comm.update(memory.ddp_comm(_ddp_params(parts, plan), prec))
        transient = dict(state.grads)  # DDP's gradient buckets
    elif layout.cross_group_every_step:  # one-rank replica groups: torchft's all-reduce of every gradient
        comm.update(memory.dp_comm(model_dims, prec, layout, pp_rank=coords["pp"], tp_rank=coords["tp"]))
    comm.update(memory.tp_comm(model_dims, prec, layout, pp_rank=coords["pp"]))
    comm.update(memory.cp_comm(model_dims, prec, layout, pp_rank=coords["pp"]))
    comm.update(memory.pp_comm(model_dims, prec, layout, pp_rank=coords["pp"]))
    comm.update(model_dims.ep_comm(prec, layout, stages))
    acts = memory.activation_bytes(model_dims, prec, layout, pp_rank=coords["pp"])
    # Measured state and FSDP groups, analytic activations.
    estimate = memory.MemoryEstimate(state, transient, acts)
    all_stages = memory.stage_layer_ranges(args.n_layers, num_stages, layout.split_points)
    return {
        "world_size": res.world_size,
        "rank": rank,
        "coordinates": coords,
        "replica_groups": layout.replica_groups,
        "diloco": (diloco := _diloco(parts, plan)),
        "degrees": {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "cp": dims.cp,
            "tp": dims.tp,
            "fsdp_shard": dims.fsdp_shard,
            "ep": dims.ep,
            "efsdp": layout.efsdp,
        },
        "model": {
            "flavor": config.model.flavor,
            "total_params": total_params,
            "active_params": model_dims.active_params(),
            "flops_per_token": flops_per_token,
            "dim": args.dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "n_kv_heads": args.kv_heads,
            "ffn_hidden": model_dims.ffn_hidden,
            "vocab_size": args.vocab_size,
        },
        "training": {
            "seq_len": layout.seq_len,
            "local_seq_len": layout.local_seq_len,
            "attn_mask_type": layout.attn_mask_type,
            "local_batch_size": layout.local_batch_size,
            "grad_accum_steps": res.accum,
            "microbatches": layout.microbatches,
            "tokens_per_microbatch": layout.microbatch_tokens,
            "activation_checkpoint": layout.ac_label,
        },
        "precision": {
            "path": plan.path,
            "storage_dtype": prec.storage,
            "param_dtype": prec.param,
            "reduce_dtype": prec.reduce,
            "output_dtype": prec.output,
            "comm_hook": plan.comm_hook,
            "residual_dtype": prec.residual,
            "matmul_dtype": prec.compute,
            "cp_reduce_dtype": prec.cp_reduce if dims.cp_enabled else None,
            "fp8": plan.fp8,
            "fp8_all_gather": plan.fp8_all_gather,
            "target": res.device_type,
        },
        "pipeline": {
            "schedule": layout.pp_schedule if dims.pp_enabled else None,
            "num_stages": num_stages,
            "stages": [
                {
                    "stage": s,
                    "pp_rank": s % dims.pp,
                    "layers": [r.start, r.stop],
                    "embeddings": s == 0,
                    "output": s == num_stages - 1,
                }
                for s, r in enumerate(all_stages)
            ],
            "this_rank": [s.index for s in stages],
        },
        "memory": {
            "params": state.params,
            "params_padded": state.params_padded,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "num_params_local": state.num_params,
            "num_param_tensors": state.num_tensors,
            "analytic_state_matches": (analytic.params, analytic.grads, analytic.optimizer, analytic.params_padded)
            == (state.params, state.grads, state.optimizer, state.params_padded),
            "transient": transient,
            "activations": acts.to_dict(),
            "peak_estimate": _with_outer_state(estimate.to_dict()["peak"], diloco, estimate.state_total),
            # What this rank writes in a full checkpoint (DCP shards; the per-rank data/RNG file is
            # kilobytes): the pre-emption save's size, see docs/checkpointing.md (Pre-emption).
            "checkpoint": memory.sum_bytes(state.params) + memory.sum_bytes(state.optimizer),
            "bytes_per_param": prec.bytes_per_param(),
        },
        "fsdp_groups": _groups_report(stage_groups, dims.fsdp_shard, plan.fp8_all_gather),
        "communication": comm,
        "communication_total": memory.merge(*comm.values()),
        "fsdp_collective_calls": calls,
        "formulas": FORMULAS,
    }


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


def _with_outer_state(peak: dict[str, int], diloco: dict[str, Any] | None, state_total: int) -> dict[str, int]:
    """The peaks with DiLoCo's global weights and outer momentum, which live beside the model all
    along, or a sync's peak where that is higher (memory.peak_with_diloco)."""
    if not diloco:
        return peak
    return memory.peak_with_diloco(peak, diloco["outer_state"], diloco["sync_buffers"], state_total)


def _groups_report(
    stage_groups: list[tuple[Stage, list[FsdpGroup]]], fsdp_shard: int, fp8_all_gather: bool
) -> list[dict[str, Any]]:
    """The report's FSDP groups; fp8_unsharded_numel only where the job gathers in fp8 (the other
    reports' groups keep the keys the real-run comparison reads)."""
    return [
        {
            "stage": s.index,
            "name": g.name,
            "kind": g.kind,
            "unsharded_numel": g.unsharded_numel(fsdp_shard),
            "gather_dtype": g.gather_dtype,
            "reduce_dtype": g.reduce_dtype,
            "reshard_after_forward": g.reshard_after_forward,
            **({"fp8_unsharded_numel": g.fp8_shard_numel * g.degree(fsdp_shard)} if fp8_all_gather else {}),
        }
        for s, gs in stage_groups
        for g in gs
    ]


FORMULAS = {
    "peak": "allocated: params + grads + optimizer + transient + activations alive at once; the CUDA caching "
    "allocator's reserved memory (what torch.cuda.max_memory_reserved and torchtitan's published "
    "numbers report) is at least this, plus its cache and fragmentation, not estimated here",
    "params": "local elements (TP shard, then FSDP dim-0 shard, torch.chunk rows) x bytes(storage)",
    "params_padded": "FSDP2 allocates each shard padded to ceil(dim0 / dp_shard) rows",
    "grads": "same shards as params, storage dtype (FSDP2 reduce-scatters into fp32 sharded grads); a "
    "TP-sharded embedding outside FSDP gets a replicated full-table gradient",
    "optimizer": "AdamW: exp_avg + exp_avg_sq in optimizer.state_dtype (2 x params) + 4-byte fp32 step per "
    "trained tensor; frozen parameters (training.freeze) have no gradient and no state",
    "bytes_per_param": "per trained parameter: param + grad (storage dtype) + 2 moments (state dtype), "
    "per frozen Linear: its compute dtype; divide by dp_shard for one FSDP rank",
    "checkpoint": "params + optimizer of this rank, unsharded-padding excluded (DCP writes the shards); "
    "a tensor replicated across ranks (DDP, TP-replicated norms) is written by one rank only, "
    "so there it is an upper bound",
    "transient": "FSDP: unsharded groups kept after forward (root, last block) + 3 x the largest block "
    "unsharded in gather dtype (in use, prefetched, its grad; the first two 1 byte per fp8 "
    "Linear weight under fp8_all_gather) + its reduce-scatter input; "
    "FSDP under PP: per_step, every group's unsharded params and reduce-dtype grads; "
    "per_microbatch, the params kept after forward; + one backward's unsharded grads "
    "(parallelism.pipeline_fsdp_reduce; see torchtitan_amp.memory.fsdp_transient); "
    "DDP: gradient buckets",
    "activations": "in-flight microbatches (at the schedule's peak) x tokens (this rank's: seq / cp) x "
    "(layers x per-layer + ends), + one recomputed layer under AC; per "
    "layer (bytes/token): 2(8d+4)/sp + k*c*d + c(2d/t+2kv'*cp) + 4H/t + 4c*f/t, + c*seq "
    "(SDPA's additive copy of the mask) under block_causal, + c*d/t + 16cp/B (wo's input "
    "copied from the two query chunks' outputs, the window-order index) under causal cp > 1 "
    "(sized for CUDA: CPU's SDPA also saves each chunk's causal mask); ends: + seq (the bool "
    "mask) under block_causal; full AC keeps r*d/sp per layer "
    "(see torchtitan_amp.memory.activation_terms)",
    "fsdp_all_gather": "unsharded padded params in gather dtype (param_dtype for safe groups, fp32 for the "
    "rest; fp8 Linears' weights 1 byte under fp8_all_gather) per forward, x2 for groups "
    "resharded after forward (backward re-gathers); "
    "under PP only when the group is sharded at that pass",
    "fsdp_reduce_scatter": "unsharded padded grads in reduce dtype per backward (under PP: per schedule step, "
    "or per microbatch with pipeline_fsdp_reduce = per_microbatch)",
    "cp": "per block: all-gather of K and V ([B x seq, kv_heads/tp x head_dim], activations' dtype) in "
    "forward, again when the block is recomputed (AC); reduce-scatter of their gradients in "
    "cp_reduce_dtype in backward; nothing else (the keys' positions follow from the shape, block_causal's "
    "document ids come with the batch)",
    "hsdp_all_reduce": "padded grad shard in reduce dtype after each reduce-scatter",
    "diloco": "semi_sync_method = diloco: no per-step cross-group all-reduce; every sync_steps steps this rank's "
    "shard of every trained parameter once in pseudo_gradient_dtype (bytes_per_sync); fp32 global "
    "weights + fp32 outer momentum (2 x 4 bytes per local trained parameter, in peak_estimate)",
    "ddp_all_reduce": "grads of lower_precision_safe modules in reduce_dtype (compress hook), others in "
    "storage dtype; once per step",
    "tp": "per block: SP fwd 2 all-gather (residual dtype) + 2 reduce-scatter (matmul dtype), bwd the "
    "mirror; no SP: 2 + 2 all-reduce; [tokens, dim] each; recomputed blocks repeat forward but "
    "the last (w2) collective; "
    "+ embedding / head input collectives, loss-parallel statistics (3 fp32 [tokens]), and "
    "under FSDP+SP the Partial norm-weight gradients (norms x dim)",
    "pp": "per microbatch per stage boundary: [mb, seq/sp, dim] each way, in the residual dtype "
    "(param_dtype under FSDP: only the last stage's root casts to output_dtype; fp32 under autocast)",
    "ep_all_to_all": "per MoE layer per forward pass: the token counts ([E] int64), the dispatched rows "
    "[tokens x top_k, dim] (hidden states' dtype) and the combined rows (experts' output "
    "dtype); the rows' gradients back in backward; the rows again for recomputed blocks (AC); "
    "volume = what a rank sends, its own share included ((ep-1)/ep leaves it under "
    "uniform routing)",
    "expert_fsdp": "EP-split experts: all-gather / reduce-scatter over the efsdp ranks (none when efsdp is 1)",
    "volume": "full tensor size: all-gather output, reduce-scatter input, all-reduce buffer, p2p tensor, "
    "all-to-all input",
}


def _params(model: dict[str, Any]) -> str:
    """Total parameters, and the active ones where they differ (MoE: top_k of the routed experts)."""
    total, active = model["total_params"], model.get("active_params", model["total_params"])
    return f"{total:,} params" + (f", {active:,} active per token" if active != total else "")


def _fp8_words(precision: dict[str, Any]) -> str:
    if precision["fp8"] == "none":
        return ""
    return f" fp8={precision['fp8']}" + (" with fp8 all-gather" if precision["fp8_all_gather"] else "")


def format_table(r: dict[str, Any]) -> str:
    fb, fd = memory.fmt_bytes, memory.fmt_by_dtype
    m, pr, deg = r["memory"], r["precision"], r["degrees"]
    lines = [
        f"dry run: {r['model']['flavor']} ({_params(r['model'])}, vocab "
        f"{r['model']['vocab_size']:,}), rank {r['rank']} of {r['world_size']}",
        f"  layout   pp {deg['pp']} x dp_replicate {deg['dp_replicate']} x dp_shard {deg['dp_shard']} x "
        f"cp {deg['cp']} x tp {deg['tp']}"
        + (f" in each of {r['replica_groups']} torchft replica groups" if r.get("replica_groups", 1) > 1 else "")
        + "; this rank at "
        + ", ".join(f"{k} {v}" for k, v in r["coordinates"].items()),
        f"  precision path={pr['path']} storage={pr['storage_dtype']} param={pr['param_dtype']} "
        f"reduce={pr['reduce_dtype']} comm_hook={pr['comm_hook']} (residual {pr['residual_dtype']}, "
        f"matmuls {pr['matmul_dtype']})"
        + (f" cp_reduce={pr['cp_reduce_dtype']}" if deg["cp"] > 1 else "")
        + _fp8_words(pr)
        + f"; sized for {pr['target']}",
    ]
    if deg.get("ep", 1) > 1:
        lines.append(
            f"  experts  ep {deg['ep']}: each MoE layer's routed experts split over {deg['ep']} ranks, "
            f"FSDP-sharded over the other {deg['efsdp']}; tokens dispatched and combined by all-to-all"
        )
    if deg["cp"] > 1:
        lines.append(
            f"  context  cp {deg['cp']}: {r['training']['local_seq_len']:,} of each window's "
            f"{r['training']['seq_len']:,} tokens on this rank ({r['training']['attn_mask_type']}); "
            f"FSDP shards over dp_shard x cp = {deg['fsdp_shard']}"
        )
    lines += [
        f"  batch    seq {r['training']['seq_len']} x local batch {r['training']['local_batch_size']}, "
        f"{r['training']['grad_accum_steps']} accumulation step(s), {r['training']['microbatches']} "
        f"microbatch(es) of {r['training']['tokens_per_microbatch']:,} tokens on this rank, AC "
        f"{r['training']['activation_checkpoint']}",
    ]
    pipe = r["pipeline"]
    if pipe["schedule"]:
        lines.append(f"  pipeline {pipe['schedule']}, {pipe['num_stages']} stages; this rank holds {pipe['this_rank']}")
        for s in pipe["stages"]:
            ends = " +embeddings" * s["embeddings"] + " +norm/output" * s["output"]
            mark = "  <- this rank" if s["stage"] in pipe["this_rank"] else ""
            lines.append(
                f"    stage {s['stage']:3d} (pp rank {s['pp_rank']}): layers "
                f"{s['layers'][0]}-{s['layers'][1] - 1}{ends}{mark}"
            )
    acts = m["activations"]
    rows = [
        ("parameters", m["params"]),
        ("  as allocated (padded)", m["params_padded"]),
        ("gradients", m["grads"]),
        ("optimizer state (AdamW)", m["optimizer"]),
        ("transient (gathers, buckets)", m["transient"]),
        ("activations, AC none", {"est": acts["none"]}),
        ("activations, AC full", {"est": acts["full"]}),
    ]
    if acts["configured_mode"] not in ("none", "full"):
        rows.append((f"activations, AC {acts['configured_mode']}", {"est": acts["configured"]}))
    if r.get("diloco"):
        rows.append(("DiLoCo global weights + momentum", r["diloco"]["outer_state"]))
        rows.append(("DiLoCo sync (wire + chunks)", r["diloco"]["sync_buffers"]))
    lines += ["", f"  {'memory per rank':34s} {'total':>12s}  by dtype"]
    for name, d in rows:
        by = "" if "est" in d else fd(d)
        lines.append(f"  {name:34s} {fb(memory.sum_bytes(d)):>12s}  {by}")
    pk = m["peak_estimate"]
    lines.append(
        f"  {'peak allocated (AC none / full)':34s} {fb(pk['ac_none']):>12s}  / {fb(pk['ac_full'])}"
        f"  (configured: {fb(pk['configured'])}; reserved >= allocated)"
    )
    lines.append(f"  {'checkpoint (this rank writes)':34s} {fb(m['checkpoint']):>12s}  params + optimizer state")
    bpp = m["bytes_per_param"]
    lines.append(
        f"  {'bytes per trained parameter':34s} {bpp['trained_total']:>10d} B  param {bpp['param']} + grad "
        f"{bpp['grad']} + AdamW moments {bpp['optimizer']} (frozen Linear: {bpp['frozen_linear']} B)"
    )
    lines += ["", f"  {'communication per step':34s} {'total':>12s}  by dtype"]
    for name, d in r["communication"].items():
        lines.append(f"  {name:34s} {fb(memory.sum_bytes(d)):>12s}  {fd(d)}")
    if not r["communication"]:
        lines.append("  (none: a single rank)")
    lines.append(
        f"  {'total':34s} {fb(memory.sum_bytes(r['communication_total'])):>12s}  {fd(r['communication_total'])}"
    )
    if r.get("diloco"):
        dl = r["diloco"]
        lines.append(
            f"  {'DiLoCo pseudo-gradient all-reduce':34s} {fb(memory.sum_bytes(dl['bytes_per_sync'])):>12s}  "
            f"{fd(dl['bytes_per_sync'])} per sync, every {dl['sync_steps']} steps (not in the per-step total; "
            f"{fb(dl['bytes_per_step'])} per step on average)"
        )
    lines.append(f"  (volumes are full tensor sizes; dry run took {r.get('elapsed_s', 0):.1f} s)")
    return "\n".join(lines)


def main(config: JobConfig) -> int:
    """train.py's entry for job.dry_run / COMM_MODE=fake_backend."""
    report = run(config)
    print(format_table(report), flush=True)
    logger.info("dry run report written to %s", Path(config.job.dump_folder) / REPORT_NAME)
    return 0


def requested(config: JobConfig) -> bool:
    return config.job.dry_run or os.environ.get("COMM_MODE") == "fake_backend"
