"""The dry run's report: the JSON document `train/dry_run.py` writes from what it measured on the
meta model (`Measured`), the formulas it names, and the table `train.py --job.dry_run` prints.
Pure data in, data out: nothing here builds a model or joins a process group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchtitan_amp import memory
from torchtitan_amp.memory import ByDtype, FsdpGroup, Stage

if TYPE_CHECKING:
    from torchtitan_amp.config import JobConfig
    from torchtitan_amp.train.job import Job


@dataclass
class Measured:
    """What the dry run read off this rank's meta model, or derived from it, for the report."""

    state: memory.StateBytes
    analytic_state_matches: bool
    stage_groups: list[tuple[Stage, list[FsdpGroup]]]
    comm: dict[str, ByDtype]
    calls: dict[str, int]
    transient: ByDtype
    activations: memory.ActivationEstimate
    diloco: dict[str, Any] | None
    total_params: int
    flops_per_token: float


def assemble(
    config: JobConfig, res: Job, rank: int, coords: dict[str, int], stages: list[Stage], m: Measured
) -> dict[str, Any]:
    """The dry-run report of one rank, as `dry_run.json` holds it.

    Args:
        config: the job's configuration (the model flavor is read from it).
        res: the resolved job (`job.resolve`): degrees, layout, precision plan, model shape.
        rank: this rank's global rank in the dry run's world.
        coords: this rank's coordinate along each mesh dimension ("pp", "dp_shard", "cp", "tp", ...).
        stages: the pipeline stages this rank holds (one without pipeline parallelism).
        m: what was measured on this rank's meta model.
    """
    dims, plan, layout = res.dims, res.plan, res.layout
    return {
        "world_size": res.world_size,
        "rank": rank,
        "coordinates": coords,
        "replica_groups": layout.replica_groups,
        "diloco": m.diloco,
        "degrees": _degrees(res),
        "model": _model(config, res, m),
        "training": _training(res),
        "precision": _precision(res),
        "pipeline": _pipeline(res, stages),
        "memory": _memory(res, m),
        "fsdp_groups": _groups_report(m.stage_groups, dims.fsdp_shard, plan.fp8_all_gather),
        "communication": m.comm,
        "communication_total": memory.merge(*m.comm.values()),
        "fsdp_collective_calls": m.calls,
        "formulas": FORMULAS,
    }


def _degrees(res: Job) -> dict[str, int]:
    dims = res.dims
    return {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "fsdp_shard": dims.fsdp_shard,
        "ep": dims.ep,
        "efsdp": res.layout.efsdp,
    }


def _model(config: JobConfig, res: Job, m: Measured) -> dict[str, Any]:
    args, model_dims = res.model_args, res.model_dims
    return {
        "flavor": config.model.flavor,
        "total_params": m.total_params,
        "active_params": model_dims.active_params(),
        "flops_per_token": m.flops_per_token,
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn_hidden": model_dims.ffn_hidden,
        "vocab_size": args.vocab_size,
    }


def _training(res: Job) -> dict[str, Any]:
    layout = res.layout
    return {
        "seq_len": layout.seq_len,
        "local_seq_len": layout.local_seq_len,
        "attn_mask_type": layout.attn_mask_type,
        "local_batch_size": layout.local_batch_size,
        "grad_accum_steps": res.accum,
        "microbatches": layout.microbatches,
        "tokens_per_microbatch": layout.microbatch_tokens,
        "activation_checkpoint": layout.ac_label,
    }


def _precision(res: Job) -> dict[str, Any]:
    plan, prec = res.plan, res.precision
    return {
        "path": plan.path,
        "storage_dtype": prec.storage,
        "param_dtype": prec.param,
        "reduce_dtype": prec.reduce,
        "output_dtype": prec.output,
        "comm_hook": plan.comm_hook,
        "residual_dtype": prec.residual,
        "matmul_dtype": prec.compute,
        "cp_reduce_dtype": prec.cp_reduce if res.dims.cp_enabled else None,
        "fp8": plan.fp8,
        "fp8_all_gather": plan.fp8_all_gather,
        "target": res.device_type,
    }


def _pipeline(res: Job, stages: list[Stage]) -> dict[str, Any]:
    dims, layout, num_stages = res.dims, res.layout, res.num_stages
    all_stages = memory.stage_layer_ranges(res.model_args.n_layers, num_stages, layout.split_points)
    return {
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
    }


def _memory(res: Job, m: Measured) -> dict[str, Any]:
    state = m.state
    # Measured state and FSDP groups, analytic activations.
    estimate = memory.MemoryEstimate(state, m.transient, m.activations)
    return {
        "params": state.params,
        "params_padded": state.params_padded,
        "grads": state.grads,
        "optimizer": state.optimizer,
        "num_params_local": state.num_params,
        "num_param_tensors": state.num_tensors,
        "analytic_state_matches": m.analytic_state_matches,
        "transient": m.transient,
        "activations": m.activations.to_dict(),
        "peak_estimate": _with_outer_state(estimate.to_dict()["peak"], m.diloco, estimate.state_total),
        # What this rank writes in a full checkpoint (DCP shards; the per-rank data/RNG file is
        # kilobytes): the pre-emption save's size, see docs/checkpointing.md (Pre-emption).
        # Under LoRA the model part holds the adapters only: each trains, in its storage dtype and
        # shard, so its bytes are its gradient's.
        "checkpoint": memory.sum_bytes(state.grads if res.plan.lora is not None else state.params)
        + memory.sum_bytes(state.optimizer),
        "bytes_per_param": res.precision.bytes_per_param(),
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
    "checkpoint": "params + optimizer of this rank (under LoRA the adapters' only: the frozen base is not "
    "saved), unsharded-padding excluded (DCP writes the shards); "
    "a tensor replicated across ranks (DDP, TP-replicated norms) is written by one rank only, "
    "so there it is an upper bound",
    "transient": "FSDP: unsharded groups kept after forward (root, last block) + 2 x the largest block "
    "unsharded in gather dtype (in use, prefetched; 1 byte per fp8 Linear weight under fp8_all_gather; "
    "under LoRA its frozen Linears' and adapters' groups) + the grad (gather dtype) and reduce-scatter "
    "input of its trained params (under LoRA the adapters'); "
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
    "fsdp_reduce_scatter": "unsharded padded grads in reduce dtype per backward, of trained params only (a "
    "group of frozen ones, such as LoRA's base, reduces nothing; under PP: per schedule step, "
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
    """The report `r` (`assemble`'s, as written to dry_run.json) as the table `train.py --job.dry_run`
    prints: the layout and precision, the pipeline stages, memory per rank by dtype, communication per
    step."""
    return "\n".join(_layout_lines(r) + _memory_lines(r) + _communication_lines(r))


def _layout_lines(r: dict[str, Any]) -> list[str]:
    pr, deg = r["precision"], r["degrees"]
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
    return lines


def _memory_lines(r: dict[str, Any]) -> list[str]:
    fb, fd = memory.fmt_bytes, memory.fmt_by_dtype
    m = r["memory"]
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
    lines = ["", f"  {'memory per rank':34s} {'total':>12s}  by dtype"]
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
    return lines


def _communication_lines(r: dict[str, Any]) -> list[str]:
    fb, fd = memory.fmt_bytes, memory.fmt_by_dtype
    lines = ["", f"  {'communication per step':34s} {'total':>12s}  by dtype"]
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
    return lines
