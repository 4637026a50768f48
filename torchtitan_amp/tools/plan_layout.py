#!/usr/bin/env python3
"""Rank parallel layouts for a Llama 3 run before having the hardware.

    python -m torchtitan_amp.tools.plan_layout --flavor llama3_70b --gpus 64 --gpu-mem-gib 80 --seq-len 8192

Tries every valid (dp_replicate, dp_shard, tp, pp, cp) factorization of --gpus (for an MoE model
(--model moe) x every expert-parallel split of dp_shard x cp that divides its routed experts) x precision setting
(bf16 compute with fp32 or bf16 gradient reduce, or fp32) x activation checkpointing (none, full),
checks each with the trainer's own validation (the config overrides printed are what `train.py`
accepts), estimates each rank's peak memory with torchtitan_amp.memory (analytic: no model, no
process group; the same formulas the fake-backend dry run is tested on), drops layouts that do not
fit, and ranks the rest by the estimated step time of the cost model below. Context parallel
(cp > 1: every sequence split over cp ranks) is proposed only when the sequence needs it: when no
layout without it fits (one sequence's activations are too large for any other split).

Cost model (per optimizer step, all terms per GPU; docs/scaling.md has the derivation):
  tokens   = global batch x seq_len; every layout processes the same tokens per step
  compute  = tokens x FLOPs/token / gpus / (MFU x peak), FLOPs/token = 6N + 12 L H d_head s
             (N: active parameters for MoE)
             (train.py's MFU formula, N without the embedding table), + 2N + 4 L H d_head s under
             full AC (the forward recomputed); fp32 layouts run at --fp32-speed x that rate
  bubble   = compute x (pp - 1) / microbatches  (1F1B: idle fraction (pp-1)/(m+pp-1) of the step)
  collective time = volume x (n - 1) / n / bandwidth for all-gather / reduce-scatter (x 2 for
             all-reduce), volume / bandwidth for pipeline sends; volumes per category from
             torchtitan_amp.memory.comm; bandwidth: --intra-node-gbps when the group's ranks
             share a node (tp innermost, then cp, dp_shard, dp_replicate, pp), else --inter-node-gbps
  exposed  = tp + pp time (on the critical path, x --tp-exposed) + cp time (the K/V all-gathers
             and their gradients' reduce-scatters: attention waits for them) + ep time (the MoE
             all-to-alls: the experts wait for their rows; (ep-1)/ep of the rows leave a rank,
             uniform routing assumed)
             + max(--dp-exposed x dp time, dp time - compute)  (FSDP/DDP traffic overlaps
               compute, but never more than there is compute to hide it)
  step     = compute + bubble + exposed
Memory per GPU (max over pipeline stages) must be <= --gpu-mem-gib x --mem-fraction. Layouts are
ranked by step time; times within ~1% are a tie, broken by lower memory.

Fault tolerance (--replica-groups N, the job's fault_tolerance.group_size): --gpus is the whole job,
N torchft replica groups of --gpus / N GPUs each. The layouts are those of one group (FSDP, or one
rank, as the trainer allows under fault tolerance), and every rank also all-reduces its gradient
shard across the groups each step (ft_cross_group_all_reduce, in the plan's reduce dtype: the bytes
are printed), priced as a dp all-reduce over N ranks between nodes (inside one when the whole job
fits in a node). --global-batch-size is the job's; each group's config gets its 1/N share.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchtitan_amp import memory
from torchtitan_amp.config import ConfigError, load_config

GIB = 2**30
PRECISIONS = {
    # name: config overrides
    "bf16/fp32-reduce": [],
    "bf16/bf16-reduce": ["--mixed_precision.reduce_dtype", "bfloat16"],
    "fp32": ["--mixed_precision.enabled", "false"],
}
AC_MODES = ("none", "full")
DP_CATEGORIES = (
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "hsdp_all_reduce",
    "ddp_all_reduce",
    "expert_fsdp_all_gather",
    "expert_fsdp_reduce_scatter",
    "ft_cross_group_all_reduce",
)


@dataclass
class Candidate:
    """One layout x precision x AC: the memory model's Layout that the dry run resolved from
    `overrides` (degrees, EP split, replica groups, AC mode, microbatches), and its estimates."""

    layout: memory.Layout
    precision: str  # a name of PRECISIONS
    overrides: list[str]
    memory_gib: float = 0.0
    memory_by_stage_gib: list[float] = field(default_factory=list)
    compute_s: float = 0.0
    bubble_s: float = 0.0
    dp_comm_s: float = 0.0
    dp_exposed_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    cp_comm_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    fits: bool = False
    ep_comm_s: float = 0.0
    ft_allreduce_bytes: dict[str, int] = field(default_factory=dict)  # per rank per step, by dtype

    @property
    def degrees(self) -> tuple[int, int, int, int, int]:
        lay = self.layout
        return lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.cp

    def describe(self) -> str:
        lay = self.layout
        parts = [f"CP {lay.cp}"] if lay.cp > 1 else []
        parts += [f"EP {lay.ep}"] if lay.ep > 1 else []
        if lay.dp_replicate > 1:
            ddp = lay.dp_shard * lay.cp == 1  # CP always shards (over dp_shard x cp)
            parts.append(f"DDP {lay.dp_replicate}" if ddp else f"HSDP {lay.dp_replicate}x{lay.dp_shard}")
        if lay.dp_shard > 1 and lay.dp_replicate == 1:
            parts.append(f"FSDP {lay.dp_shard}")
        if lay.tp > 1:
            parts.append(f"TP {lay.tp}")
        if lay.pp > 1:
            parts.append(f"PP {lay.pp}")
        group = " x ".join(parts) or "single"
        return f"FT {lay.replica_groups} x {group}" if lay.replica_groups > 1 else group


Degrees = tuple[int, int, int, int, int]  # (dp_replicate, dp_shard, tp, pp, cp)


def factorizations(gpus: int) -> list[Degrees]:
    """Every (dp_replicate, dp_shard, tp, pp, cp) whose product is `gpus`."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    out = []
    for cp in divisors:
        for tp in divisors:
            for pp in divisors:
                if gpus % (cp * tp * pp):
                    continue
                rest = gpus // (cp * tp * pp)
                for r in divisors:
                    if rest % r == 0:
                        out.append((r, rest // r, tp, pp, cp))
    return out


def structurally_valid(degrees: Degrees, args: Any, n_layers: int) -> bool:
    """The planner's own rules on top of the trainer's validation: TP stays within a node; CP
    splits sequences of at least --min-cp-tokens tokens per rank (shorter chunks leave attention
    too little work to hide the K/V all-gathers behind).

    Args:
        degrees: the candidate's parallel degrees.
        args: the command line (--gpus-per-node, --min-cp-tokens, --seq-len).
        n_layers: the model's layers (no more pipeline stages than layers).
    """
    _r, _s, tp, pp, cp = degrees
    return args.gpus_per_node % tp == 0 and pp <= n_layers and (cp == 1 or args.seq_len // cp >= args.min_cp_tokens)


def _group_bandwidth(dim: str, degrees: Degrees, args: Any, ep: int = 1) -> float:
    if dim == "replica_groups":  # groups are torchruns of their own: between nodes unless the job fits in one
        return (args.intra_node_gbps if args.gpus <= args.gpus_per_node else args.inter_node_gbps) * 1e9
    """Bytes/s for a collective over `dim`: intra-node when the group's span fits in a node. The
    mesh is (pp, dp_replicate, dp_shard, cp, tp), tp innermost, so a group's ranks are
    `stride` apart with stride = product of the inner degrees. FSDP ("dp_shard") shards over
    dp_shard x cp: its group spans both. EP takes the innermost ranks of dp_shard x cp ("ep"), the
    experts' FSDP the rest ("efsdp")."""
    r, s, t, p, c = degrees
    stride = {
        "tp": 1,
        "cp": t,
        "dp_shard": t,
        "dp_replicate": t * s * c,
        "pp": t * c * s * r,
        "ep": t,
        "efsdp": t * ep,
    }[dim]
    size = {"tp": t, "cp": c, "dp_shard": s * c, "dp_replicate": r, "pp": p, "ep": ep, "efsdp": s * c // ep}[dim]
    gbps = args.intra_node_gbps if stride * size <= args.gpus_per_node else args.inter_node_gbps
    return gbps * 1e9


def _collective_seconds(category: str, nbytes: float, degrees: Degrees, args: Any, ep: int = 1) -> float:
    """An all-to-all's volume is what a rank sends; (n - 1) / n of it leaves the rank under
    uniform routing (memory.moe.ep_comm), like a ring collective's."""
    dim = {
        "fsdp_all_gather": "dp_shard",
        "fsdp_reduce_scatter": "dp_shard",
        "hsdp_all_reduce": "dp_replicate",
        "ddp_all_reduce": "dp_replicate",
        "pp_send": "pp",
        "pp_recv": "pp",
        "cp_all_gather": "cp",
        "cp_reduce_scatter": "cp",
        "ep_all_to_all": "ep",
        "expert_fsdp_all_gather": "efsdp",
        "expert_fsdp_reduce_scatter": "efsdp",
        "ft_cross_group_all_reduce": "replica_groups",
    }.get(category, "tp")
    r, s, t, p, c = degrees
    n = {
        "dp_shard": s * c,
        "dp_replicate": r,
        "tp": t,
        "pp": p,
        "cp": c,
        "ep": ep,
        "efsdp": s * c // ep,
        "replica_groups": args.replica_groups,
    }[dim]
    if n == 1 or category == "pp_recv":  # a receive is the other end of a send
        return 0.0
    bw = _group_bandwidth(dim, degrees, args, ep)
    if category.startswith("pp_"):
        return nbytes / bw
    factor = 2 if category.endswith("all_reduce") else 1
    return factor * nbytes * (n - 1) / n / bw


def evaluate(cand: Candidate, res: Any, args: Any) -> Candidate:
    """Fill in memory and time estimates for a candidate validated by dry_run.resolve (whether
    it fits is plan's to decide, for the --gpu-mem-gib at hand).

    Args:
        cand: the candidate, filled in place.
        res: its dry_run.resolve result (the job's model, layout and precision).
        args: the command line (the machine's rates and bandwidths).
    """
    model, prec, layout = res.model_dims, res.precision, res.layout
    # Pipeline rank 0 holds the most in-flight microbatches, the last one the output head.
    pp_ranks = sorted({0, layout.pp - 1})
    cand.memory_by_stage_gib = [memory.estimate(model, prec, layout, pp_rank=r).peak() / GIB for r in pp_ranks]
    cand.memory_gib = max(cand.memory_by_stage_gib)

    tokens = args.global_batch_size * args.seq_len
    # The MFU numerator of train.py: 6N (N without an untied embedding table: matmul_params; the
    # family's: MoE counts the active experts only) + attention.
    model_flops = res.family.flops_per_token(res.model_args, model.matmul_params(), args.seq_len)
    # Full AC runs each block's forward again in backward: a third more.
    flops_tok = model_flops * (4 / 3 if layout.ac_mode == "full" else 1)
    rate = args.mfu * args.peak_tflops * 1e12 * (args.fp32_speed if cand.precision == "fp32" else 1.0)
    cand.compute_s = tokens * flops_tok / args.gpus / rate
    cand.bubble_s = cand.compute_s * (layout.pp - 1) / layout.microbatches if layout.pp > 1 else 0.0

    comm: dict[str, float] = {}
    for r in pp_ranks:  # the slowest stage sets the pace
        for category, by_dtype in memory.comm(model, prec, layout, pp_rank=r).items():
            t = _collective_seconds(category, memory.sum_bytes(by_dtype), cand.degrees, args, layout.ep)
            comm[category] = max(comm.get(category, 0.0), t)
            if category == "ft_cross_group_all_reduce":
                cand.ft_allreduce_bytes = {str(k): int(v) for k, v in by_dtype.items()}
    cand.dp_comm_s = sum(v for k, v in comm.items() if k in DP_CATEGORIES)
    cand.tp_comm_s = sum(v for k, v in comm.items() if k.startswith("tp_")) * args.tp_exposed
    cand.pp_comm_s = sum(v for k, v in comm.items() if k.startswith("pp_"))
    cand.cp_comm_s = sum(v for k, v in comm.items() if k.startswith("cp_"))
    cand.ep_comm_s = comm.get("ep_all_to_all", 0.0)  # the experts wait for their rows
    cand.dp_exposed_s = max(args.dp_exposed * cand.dp_comm_s, cand.dp_comm_s - cand.compute_s)
    cand.step_s = (
        cand.compute_s
        + cand.bubble_s
        + cand.dp_exposed_s
        + cand.tp_comm_s
        + cand.pp_comm_s
        + cand.cp_comm_s
        + cand.ep_comm_s
    )
    cand.tokens_per_s_per_gpu = tokens / cand.step_s / args.gpus
    cand.mfu = tokens * model_flops / cand.step_s / args.gpus / (args.peak_tflops * 1e12)
    return cand


def expert_splits(degrees: Degrees, n_experts: int) -> list[int]:
    """EP degrees for a layout of a model with `n_experts` routed experts per MoE layer (0: none):
    1, and every degree that divides both dp_shard x cp (EP splits FSDP's ranks, also under TP,
    whose ranks hold the experts replicated) and the experts."""
    _r, s, _t, _p, c = degrees
    if not n_experts:
        return [1]
    return [e for e in range(1, s * c + 1) if (s * c) % e == 0 and n_experts % e == 0]


def _layout_args(degrees: Degrees, ep: int, args: Any) -> list[str]:
    r, s, t, p, c = degrees
    groups = args.replica_groups
    per_dp = args.global_batch_size // (groups * r * s)  # sequences per data-parallel rank per step
    out = [
        "--model.flavor",
        args.flavor,
        "--training.seq_len",
        str(args.seq_len),
        "--parallelism.data_parallel_replicate_degree",
        str(r),
        "--parallelism.data_parallel_shard_degree",
        str(s),
        "--parallelism.tensor_parallel_degree",
        str(t),
        "--parallelism.pipeline_parallel_degree",
        str(p),
    ] + (["--parallelism.context_parallel_degree", str(c)] if c > 1 else [])
    out += ["--parallelism.expert_parallel_degree", str(ep)] if ep > 1 else []
    if args.model != "llama3":  # the default family goes unsaid in the printed overrides
        out += ["--model.name", args.model]
    if groups > 1:  # replica_id is each group's own
        out += ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", str(groups)]
    if p > 1:
        # One schedule step per optimizer step; microbatches of --local-batch-size sequences.
        return out + [
            "--training.local_batch_size",
            str(per_dp),
            "--parallelism.pipeline_parallel_microbatch_size",
            str(args.local_batch_size),
        ]
    # Gradient accumulation over --local-batch-size sequences.
    # A group's training.global_batch_size is its own share (its data-parallel ranks').
    return out + [
        "--training.local_batch_size",
        str(args.local_batch_size),
        "--training.global_batch_size",
        str(args.global_batch_size // groups),
    ]


def candidates(args: Any) -> tuple[list[Candidate], int]:
    """Every valid, evaluated candidate (fitting or not) and the number of rejected ones."""
    from torchtitan_amp.models import get_family
    from torchtitan_amp.train import dry_run

    flavor = get_family(args.model).flavors[args.flavor]
    if args.vocab_size is None:
        args.vocab_size = flavor.vocab_size
    n_layers, n_experts = flavor.n_layers, getattr(flavor, "n_routed_experts", 0)
    out: list[Candidate] = []
    rejected = 0
    group_gpus = args.gpus // args.replica_groups  # the world of one torchrun
    for degrees in factorizations(group_gpus):
        r, s, t, p, c = degrees
        if not structurally_valid(degrees, args, n_layers) or args.global_batch_size % (
            args.replica_groups * r * s * args.local_batch_size
        ):
            rejected += 1
            continue
        for ep in expert_splits(degrees, n_experts):
            for prec_name, prec_args in PRECISIONS.items():
                for ac in AC_MODES:
                    overrides = _layout_args(degrees, ep, args) + prec_args + ["--activation_checkpoint.mode", ac]
                    try:
                        res = dry_run.resolve(
                            load_config(overrides + ["--dry_run.vocab_size", str(args.vocab_size)]), group_gpus
                        )
                    except ConfigError:
                        rejected += 1
                        continue
                    cand = Candidate(res.layout, prec_name, overrides)
                    out.append(evaluate(cand, res, args))
    return out, rejected


def rank_key(c: Candidate) -> tuple[int, float]:
    """Step time, with times within ~1% of each other counted as a tie (the model cannot tell
    them apart) broken by lower memory: headroom is worth more than a rounding error."""
    return math.floor(math.log(c.step_s) / math.log(1.01)), c.memory_gib


def plan(args: Any, evaluated: tuple[list[Candidate], int] | None = None) -> dict[str, Any]:
    """Rank the candidates that fit. `evaluated`: candidates() of the same job with another
    --gpu-mem-gib (memory and time estimates do not depend on it), re-filtered here."""
    cands, rejected = evaluated if evaluated is not None else candidates(args)
    for c in cands:
        c.fits = c.memory_gib <= args.gpu_mem_gib * args.mem_fraction
    # CP only where the sequence needs it: it buys memory with K/V traffic (and, under block_causal,
    # attention over an explicit mask that computes every query-key block).
    needs_cp = not any(c.fits and c.layout.cp == 1 for c in cands)
    fitting = sorted((c for c in cands if c.fits and (needs_cp or c.layout.cp == 1)), key=rank_key)
    return {
        "args": vars(args),
        "evaluated": len(cands),
        "rejected_invalid": rejected,
        "needs_cp": needs_cp,
        "fitting": fitting,
        "not_fitting": sorted((c for c in cands if not c.fits), key=lambda c: c.memory_gib),
    }


def format_plan(result: dict[str, Any], top: int) -> str:
    a = result["args"]
    lines = [
        f"{a['flavor']} on {a['gpus']} GPUs ({a['gpu_mem_gib']:g} GiB, {a['mem_fraction']:.0%} usable), "
        f"seq {a['seq_len']}, global batch {a['global_batch_size']} x {a['seq_len']} tokens, "
        f"microbatch {a['local_batch_size']} sequence(s); MFU {a['mfu']:.0%} of {a['peak_tflops']:g} TFLOP/s; "
        f"{a['intra_node_gbps']:g} GB/s in a node of {a['gpus_per_node']}, {a['inter_node_gbps']:g} GB/s between"
        + (
            f"; {a['replica_groups']} torchft replica groups of {a['gpus'] // a['replica_groups']} GPUs"
            if a["replica_groups"] > 1
            else ""
        ),
        f"{result['evaluated']} valid candidates ({result['rejected_invalid']} invalid combinations skipped), "
        f"{len(result['fitting'])} fit in memory"
        + (
            "; context parallel needed: nothing fits without it" if result.get("needs_cp") and result["fitting"] else ""
        ),
        "",
        f"{'#':>3} {'layout':22s} {'precision':17s} {'AC':4s} {'mb':>4s} {'mem GiB':>8s} {'step s':>8s} "
        f"{'compute':>8s} {'bubble':>7s} {'dp exp':>7s} {'tp':>7s} {'pp':>6s} {'tok/s/GPU':>10s} {'MFU':>6s}",
    ]
    for i, c in enumerate(result["fitting"][:top], 1):
        mb = c.layout.microbatches if c.layout.pp > 1 else c.layout.grad_accum
        lines.append(
            f"{i:3d} {c.describe():22s} {c.precision:17s} {c.layout.ac_mode:4s} {mb:4d} {c.memory_gib:8.1f} "
            f"{c.step_s:8.2f} {c.compute_s:8.2f} {c.bubble_s:7.2f} {c.dp_exposed_s:7.2f} "
            f"{c.tp_comm_s + c.cp_comm_s + c.ep_comm_s:7.2f} {c.pp_comm_s:6.2f} "
            f"{c.tokens_per_s_per_gpu:10,.0f} {c.mfu:6.1%}"
        )
    if not result["fitting"]:
        lines.append("  (nothing fits; smallest footprints:)")
        for c in result["not_fitting"][:5]:
            lines.append(f"      {c.describe():22s} {c.precision:17s} AC {c.layout.ac_mode:4s} {c.memory_gib:8.1f} GiB")
    lines += [
        "",
        "mb: pipeline microbatches (PP) or gradient-accumulation steps; dp exp: exposed "
        "FSDP/DDP traffic; tp/pp: TP (+ CP, + EP all-to-all) and PP traffic time",
        "",
    ]
    if a["replica_groups"] > 1:
        lines.append(
            "cross-group all-reduce (torchft), per rank per step: "
            + "; ".join(
                f"#{i} {memory.fmt_by_dtype(c.ft_allreduce_bytes)}" for i, c in enumerate(result["fitting"][:top], 1)
            )
        )
    for i, c in enumerate(result["fitting"][:top], 1):
        lines.append(f"#{i}: " + " ".join(c.overrides))
    return "\n".join(lines)


def _add_job_options(ap: argparse.ArgumentParser) -> None:
    """The options saying what is trained: model, GPUs and their memory, sequence and batch."""
    ap.add_argument("--model", default="llama3", help="Model family (model.name).")
    ap.add_argument("--flavor", required=True, help="Model flavor (llama3_8b, llama3_70b, llama3_405b, ...).")
    ap.add_argument("--gpus", type=int, required=True, help="Number of GPUs (the world size).")
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0, help="Memory per GPU, GiB (default 80).")
    ap.add_argument(
        "--mem-fraction",
        type=float,
        default=0.9,
        help="Usable fraction of it (allocator fragmentation, CUDA context, NCCL buffers; default 0.9).",
    )
    ap.add_argument("--seq-len", type=int, default=8192, help="Tokens per sequence (default 8192).")
    ap.add_argument(
        "--local-batch-size",
        type=int,
        default=1,
        help="Sequences per forward pass: the microbatch (PP) or accumulation step (default 1).",
    )
    ap.add_argument(
        "--global-batch-size",
        type=int,
        default=0,
        help="Sequences per optimizer step (default: gpus x local batch size).",
    )
    ap.add_argument("--vocab-size", type=int, default=None, help="Vocabulary (default: the flavor's own).")


def _add_machine_options(ap: argparse.ArgumentParser) -> None:
    """The options of the time model: compute rate, bandwidths, and how much traffic is exposed."""
    ap.add_argument("--mfu", type=float, default=0.4, help="Model FLOPs utilisation of the compute (default 0.4).")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak per GPU (default 989: H100 SXM).")
    ap.add_argument(
        "--fp32-speed",
        type=float,
        default=0.5,
        help="fp32 compute rate relative to bf16 (default 0.5: TF32 tensor cores; ~0.07 without TF32).",
    )
    ap.add_argument(
        "--intra-node-gbps",
        type=float,
        default=450.0,
        help="Per-GPU bandwidth inside a node, GB/s (bytes; default 450: NVLink 4 one way).",
    )
    ap.add_argument(
        "--inter-node-gbps",
        type=float,
        default=50.0,
        help="Per-GPU bandwidth between nodes, GB/s (bytes; default 50: 400 Gb/s InfiniBand).",
    )
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8); TP stays inside a node.")
    ap.add_argument(
        "--dp-exposed",
        type=float,
        default=0.2,
        help="Fraction of FSDP/DDP traffic never hidden behind compute (default 0.2).",
    )
    ap.add_argument(
        "--tp-exposed",
        type=float,
        default=1.0,
        help="Fraction of TP traffic on the critical path (default 1.0: no async TP).",
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_job_options(ap)
    _add_machine_options(ap)
    ap.add_argument(
        "--min-cp-tokens",
        type=int,
        default=4096,
        help="Context parallel only down to this many tokens of a sequence per rank (default 4096).",
    )
    ap.add_argument(
        "--replica-groups",
        type=int,
        default=1,
        help="torchft replica groups (fault_tolerance.group_size; default 1: no fault tolerance); "
        "--gpus is the whole job, each group --gpus / N of them.",
    )
    ap.add_argument("--top", type=int, default=10, help="Layouts to print (default 10).")
    ap.add_argument("--json", default="", help="Also write every evaluated candidate to this JSON file.")
    args = ap.parse_args(argv)
    if args.replica_groups < 1 or args.gpus % args.replica_groups:
        ap.error(f"--replica-groups {args.replica_groups} must divide --gpus {args.gpus}")
    if args.global_batch_size <= 0:
        args.global_batch_size = args.gpus * args.local_batch_size
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from torchtitan_amp.models import FAMILIES

    if args.model not in FAMILIES:
        print(f"error: unknown model family {args.model!r}; choose one of {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    flavors = FAMILIES[args.model].flavors
    if args.flavor not in flavors:
        print(f"error: unknown flavor {args.flavor!r}; choose one of {', '.join(flavors)}", file=sys.stderr)
        return 2
    result = plan(args)
    print(format_plan(result, args.top))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    **{k: v for k, v in result.items() if k not in ("fitting", "not_fitting")},
                    "fitting": [asdict(c) for c in result["fitting"]],
                    "not_fitting": [asdict(c) for c in result["not_fitting"]],
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if result["fitting"] else 1


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
