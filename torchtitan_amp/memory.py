"""Analytic per-rank memory and communication of a Llama training layout: pure functions, no torch.

Used by the fake-backend dry run (`torchtitan_amp/dry_run.py`, for the terms a meta model cannot
show: activations, TP and PP traffic), by the layout planner (`torchtitan_amp/tools/plan_layout.py`, for
everything) and by the memory estimate script. Every number is bytes on one rank for one
optimizer step, computed from shapes alone; the formulas are stated next to the code and in
docs/scaling.md. tests/test_dry_run.py checks the parameter, gradient and optimizer terms and
every traffic term here against real multi-process runs (exact, per rank, by dtype) and the
per-layer activation term against the tensors autograd saves (exact).

Conventions
- A collective's volume is the size of the full tensor it produces or consumes: an all-gather's
  output, a reduce-scatter's input, an all-reduce's buffer, a send's tensor. (A ring moves
  (n-1)/n of that per rank, twice for an all-reduce: the planner's cost model applies that.)
- Sizes are split the way torch splits them: `torch.chunk` rows (ceil(n/k) per rank, the last
  ranks short or empty) for TP and FSDP, and FSDP2 pads each parameter's dim 0 to a multiple of
  the shard degree for its collectives.
- dtypes are names: "float32", "bfloat16", "float16".
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any

# DTYPE_BYTES, SHORT, STAGES_PER_RANK and stage_layer_ranges are also used as memory.X by callers.
from torchtitan_amp.rules import (DTYPE_BYTES, SHORT, STAGES_PER_RANK, reshard_after_forward,  # noqa: F401
                                  stage_ids, stage_layer_ranges)
from torchtitan_amp.torch_compat import grouped_fsdp_casts_every_output

# Bytes of AdamW's `step` counter per parameter tensor (a 0-d fp32 tensor per param).
ADAMW_STEP_BYTES = 4

ByDtype = dict[str, int]


def add_bytes(into: dict[str, int], dtype: str, nbytes: int) -> None:
    if nbytes:
        into[dtype] = into.get(dtype, 0) + int(nbytes)


def sum_bytes(d: ByDtype) -> int:
    return sum(d.values())


def merge(*parts: ByDtype) -> ByDtype:
    out: ByDtype = {}
    for part in parts:
        for k, v in part.items():
            add_bytes(out, k, v)
    return out


# ---------------------------------------------------------------------------------------------
# Model, precision and layout descriptions


@dataclass(frozen=True)
class ModelDims:
    """The shapes that matter: a Llama 3 decoder without biases, untied embeddings."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_args(cls, args: Any) -> "ModelDims":
        """From a `LlamaModelArgs` (the caller has imported the model, and torch, already)."""
        from torchtitan_amp.models.llama import ffn_hidden_dim

        return cls(args.dim, args.n_layers, args.n_heads, args.kv_heads,
                   ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier), args.vocab_size)

    def layer_params(self) -> int:
        d, kv, f = self.dim, self.kv_dim, self.ffn_hidden
        return 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d

    def total_params(self) -> int:
        return self.n_layers * self.layer_params() + 2 * self.vocab_size * self.dim + self.dim


@dataclass(frozen=True)
class PrecisionSpec:
    """What the precision plan decided, as names (see torchtitan_amp.precision.PrecisionPlan)."""

    path: str = "fsdp"  # "fsdp" | "autocast" | "full"
    storage: str = "float32"  # parameters, gradients and AdamW state
    param: str = "bfloat16"  # compute / all-gather dtype of lower-precision-safe modules
    reduce: str = "float32"  # gradient-reduce dtype of safe modules
    output: str = "float32"  # logits
    comm_hook: bool = False  # DDP compress hook (autocast path, reduce != fp32)
    # Module kinds in lower_precision_safe_modules: "linear" (incl. the output head), "embedding",
    # "norm". Everything else computes, gathers and reduces in fp32.
    safe_kinds: frozenset[str] = frozenset({"linear"})
    optimizer_state: str = ""  # AdamW's moments ("": the storage dtype)
    frozen: tuple[str, ...] = ()  # training.freeze patterns (module names)

    @classmethod
    def from_plan(cls, plan: Any) -> "PrecisionSpec":
        from torch import nn

        from torchtitan_amp.models.llama import RMSNorm
        from torchtitan_amp.precision import dtype_name as name

        kinds = set()
        for cls_, kind in ((nn.Linear, "linear"), (nn.Embedding, "embedding"), (RMSNorm, "norm")):
            if any(issubclass(cls_, safe) for safe in plan.safe_modules):
                kinds.add(kind)
        return cls(plan.path, name(plan.storage_dtype), name(plan.param_dtype), name(plan.reduce_dtype),
                   name(plan.output_dtype), plan.comm_hook != "none", frozenset(kinds),
                   name(plan.optimizer_state_dtype), tuple(plan.frozen_names))

    @classmethod
    def simple(cls, path: str, param: str = "bfloat16", reduce: str = "float32",
               storage: str = "float32", comm_hook: bool = False) -> "PrecisionSpec":
        return cls(path, storage, param if path != "full" else storage,
                   reduce if path != "full" else storage, "float32" if path != "full" else storage,
                   comm_hook)

    def low(self, kind: str) -> bool:
        """Whether modules of this kind run (and communicate) in param/reduce dtype."""
        return self.path != "full" and kind in self.safe_kinds

    @property
    def state(self) -> str:
        return self.optimizer_state or self.storage

    def is_frozen(self, param_name: str) -> bool:
        """training.freeze matches a module; everything inside it is frozen."""
        parts = param_name.split(".")[:-1]
        modules = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        return any(fnmatch.fnmatchcase(m, pat) for m in modules for pat in self.frozen)

    def stored(self, spec: "ParamSpec") -> str:
        """A parameter's storage dtype: frozen ones keep their compute dtype (PrecisionPlan.frozen_dtype)."""
        if self.is_frozen(spec.name) and self.low(spec.kind):
            return self.param
        return self.storage

    def bytes_per_param(self) -> dict[str, int]:
        """Bytes per trained parameter held in parameters, gradients and AdamW moments (summed
        over data-parallel shards: divide by dp_shard for one FSDP rank), and per frozen one."""
        s, m = DTYPE_BYTES[self.storage], DTYPE_BYTES[self.state]
        return {"param": s, "grad": s, "optimizer": 2 * m, "trained_total": 2 * s + 2 * m,
                "frozen_linear": DTYPE_BYTES[self.param if self.low("linear") else self.storage]}

    @property
    def residual(self) -> str:
        """dtype of the residual stream between blocks (what PP sends and TP gathers)."""
        if self.path == "fsdp":
            return self.param  # each block's input is cast to param dtype (cast_block_inputs)
        return self.storage  # autocast: fp32 residual (bf16 matmul outputs promote on add)

    @property
    def compute(self) -> str:
        """dtype of the matmul outputs inside a block."""
        return self.param if self.low("linear") else self.storage


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    seq_len: int = 2048
    local_batch_size: int = 1
    grad_accum: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatch_size: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True
    ac_mode: str = "none"  # "none" | "full" | "selective"
    ac_option: str = "2"  # selective: every N-th block, or "op"
    reshard_after_forward: str = "default"  # "default" | "always" | "never"
    split_points: tuple[int, ...] = ()  # first layer of each stage after the first

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def sp(self) -> bool:
        return self.tp > 1 and self.sequence_parallel

    @property
    def ac_label(self) -> str:
        """The AC mode as reports print it: "none", "full" or "selective(<option>)"."""
        return f"selective({self.ac_option})" if self.ac_mode == "selective" else self.ac_mode

    @property
    def num_stages(self) -> int:
        return self.pp * STAGES_PER_RANK[self.pp_schedule] if self.pp > 1 else 1

    @property
    def microbatches(self) -> int:
        """Pipeline microbatches per schedule step (1 without PP)."""
        return self.local_batch_size // self.pp_microbatch_size if self.pp > 1 else 1

    @property
    def microbatch_tokens(self) -> int:
        """Tokens in one forward pass of this rank's model."""
        return (self.pp_microbatch_size if self.pp > 1 else self.local_batch_size) * self.seq_len

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Stages held by a pipeline rank: rank r holds r, r + pp, ... (looped placement)."""
        return stage_ids(pp_rank, self.pp, self.pp_schedule) if self.pp > 1 else [0]


# ---------------------------------------------------------------------------------------------
# Pipeline stages


@dataclass(frozen=True)
class Stage:
    index: int
    layers: range
    first: bool
    last: bool


def rank_stages(model: ModelDims, layout: Layout, pp_rank: int = 0) -> list[Stage]:
    ranges = stage_layer_ranges(model.n_layers, layout.num_stages, layout.split_points)
    n = layout.num_stages
    return [Stage(s, ranges[s], s == 0, s == n - 1) for s in layout.stage_ids(pp_rank)]


def schedule_ops(schedule: str, n_microbatches: int, num_stages: int, stage: int) -> list[str]:
    """Order of forward (F) and backward (B) microbatch passes of one stage in a step: GPipe runs
    every forward then every backward; 1F1B runs min(M, stages - stage) forwards, then
    alternates B and F, then the remaining Bs (torch.distributed.pipelining.Schedule1F1B)."""
    m = n_microbatches
    if schedule == "GPipe":
        return ["F"] * m + ["B"] * m
    warmup = min(m, num_stages - stage)
    ops = ["F"] * warmup
    for _ in range(m - warmup):
        ops += ["B", "F"]
    return ops + ["B"] * warmup


def in_flight_microbatches(layout: Layout, stage: int, pp_rank: int) -> int:
    """Microbatches whose activations a stage holds at its peak: 1F1B's warm-up depth, every
    microbatch under GPipe; Interleaved1F1B per torch's warm-up count (forward chunks over this
    rank's stages before the first backward), spread evenly over its stages."""
    if layout.pp == 1:
        return 1
    m = layout.microbatches
    if layout.pp_schedule == "GPipe":
        return m
    if layout.pp_schedule == "1F1B":
        return min(m, layout.num_stages - stage)
    v = STAGES_PER_RANK[layout.pp_schedule]
    warmup = min((v - 1) * layout.pp + 2 * (layout.pp - 1 - pp_rank), m * v)
    return max(1, math.ceil((warmup + 1) / v))


# ---------------------------------------------------------------------------------------------
# Parameters and their shards


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "embedding" | "linear" | "norm"
    tp_dim: int | None  # dim sharded by TP (None: replicated)
    block: int | None  # layer index, None for the ends


def param_specs(model: ModelDims, stage: Stage) -> list[ParamSpec]:
    """Parameters of one pipeline stage with their TP sharding (parallelize.apply_tp):
    q/k/v, w1/w3 and the output head column-wise (dim 0), wo/w2 row-wise (dim 1), the embedding
    row-wise (vocab rows, dim 0), norms replicated."""
    d, kv, f, v = model.dim, model.kv_dim, model.ffn_hidden, model.vocab_size
    hq = model.n_heads * model.head_dim
    out: list[ParamSpec] = []
    if stage.first:
        out.append(ParamSpec("tok_embeddings.weight", (v, d), "embedding", 0, None))
    for i in stage.layers:
        p = f"layers.{i}."
        out += [
            ParamSpec(p + "attention_norm.weight", (d,), "norm", None, i),
            ParamSpec(p + "attention.wq.weight", (hq, d), "linear", 0, i),
            ParamSpec(p + "attention.wk.weight", (kv, d), "linear", 0, i),
            ParamSpec(p + "attention.wv.weight", (kv, d), "linear", 0, i),
            ParamSpec(p + "attention.wo.weight", (d, hq), "linear", 1, i),
            ParamSpec(p + "ffn_norm.weight", (d,), "norm", None, i),
            ParamSpec(p + "feed_forward.w1.weight", (f, d), "linear", 0, i),
            ParamSpec(p + "feed_forward.w2.weight", (d, f), "linear", 1, i),
            ParamSpec(p + "feed_forward.w3.weight", (f, d), "linear", 0, i),
        ]
    if stage.last:
        out.append(ParamSpec("norm.weight", (d,), "norm", None, None))
        out.append(ParamSpec("output.weight", (v, d), "linear", 0, None))
    return out


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk-style splitting n rows into `parts`."""
    per = -(-n // parts)
    return max(0, min(per, n - index * per))


def tp_local_shape(spec: ParamSpec, tp: int, tp_rank: int = 0) -> tuple[int, ...]:
    if tp == 1 or spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], tp, tp_rank)
    return tuple(shape)


def _rest(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def fsdp_local_numel(shape: tuple[int, ...], shards: int, rank: int) -> int:
    """Elements of this rank's FSDP shard (dim 0, torch.chunk rows, unpadded)."""
    return chunk_size(shape[0], shards, rank) * _rest(shape)


def fsdp_padded_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one padded shard: FSDP2 pads dim 0 to a multiple of the shard degree."""
    return -(-shape[0] // shards) * _rest(shape)


@dataclass
class StateBytes:
    params: ByDtype = field(default_factory=dict)
    grads: ByDtype = field(default_factory=dict)
    optimizer: ByDtype = field(default_factory=dict)
    # Params as FSDP2 allocates them (each shard padded to ceil(dim0 / shards) rows).
    params_padded: ByDtype = field(default_factory=dict)
    num_params: int = 0  # elements held by this rank
    num_tensors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "params_padded": self.params_padded, "num_params": self.num_params,
                "num_tensors": self.num_tensors}


def state_bytes(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
                tp_rank: int = 0, dp_shard_rank: int = 0) -> StateBytes:
    """Parameters, gradients and AdamW state held by one rank.

    params    = local elements x bytes(storage)  (TP shard, then FSDP dim-0 shard)
    grads     = params (same shard, storage dtype: FSDP2 reduce-scatters into fp32 sharded grads),
                except that under TP without FSDP the embedding's gradient is a replicated full
                [vocab, dim] tensor (DTensor's embedding backward for a row-sharded table, torch 2.13)
    optimizer = 2 x params (exp_avg, exp_avg_sq in optimizer.state_dtype) + 4 bytes per tensor (step)
    frozen parameters (training.freeze): their compute dtype (PrecisionSpec.stored), no gradient,
                no optimizer state
    """
    out = StateBytes()
    mb = DTYPE_BYTES[prec.state]
    trained_tensors = 0
    for stage in rank_stages(model, layout, pp_rank):
        for spec in param_specs(model, stage):
            shape = tp_local_shape(spec, layout.tp, tp_rank)
            if layout.dp_shard > 1:
                numel = fsdp_local_numel(shape, layout.dp_shard, dp_shard_rank)
                padded = fsdp_padded_numel(shape, layout.dp_shard)
            else:
                numel = padded = math.prod(shape)
            out.num_params += numel
            out.num_tensors += 1
            dtype = prec.stored(spec)
            sb = DTYPE_BYTES[dtype]
            add_bytes(out.params, dtype, numel * sb)
            add_bytes(out.params_padded, dtype, padded * sb)
            if prec.is_frozen(spec.name):
                continue
            trained_tensors += 1
            grad = numel
            if spec.kind == "embedding" and layout.tp > 1 and layout.dp_shard == 1:
                grad = math.prod(spec.shape)  # see the docstring: replicated embedding gradient
            add_bytes(out.grads, dtype, grad * sb)
            add_bytes(out.optimizer, prec.state, 2 * numel * mb)
    add_bytes(out.optimizer, "float32", ADAMW_STEP_BYTES * trained_tensors)
    return out


# ---------------------------------------------------------------------------------------------
# FSDP groups and data-parallel traffic


@dataclass(frozen=True)
class FsdpGroup:
    """One fully_shard unit: what it gathers and reduces per pass."""

    name: str
    padded_shard_numel: int  # all-gather input per rank; x shards = unsharded (padded) size
    gather_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    kind: str  # "block" | "fp32" | "root"

    def unsharded_numel(self, shards: int) -> int:
        return self.padded_shard_numel * shards


def fsdp_groups(model: ModelDims, prec: PrecisionSpec, layout: Layout, stage: Stage,
                tp_rank: int = 0) -> list[FsdpGroup]:
    """The groups parallelize.apply_fsdp creates on a stage: on the "fsdp" path the modules outside
    the safe list form one fp32 group per block (its norms) and one for those outside blocks; each
    block is a group; the root holds the rest. Which reshard after forward:
    rules.reshard_after_forward."""
    n = layout.dp_shard
    specs = param_specs(model, stage)

    def numel(ss: list[ParamSpec]) -> int:
        return sum(fsdp_padded_numel(tp_local_shape(s, layout.tp, tp_rank), n) for s in ss)

    mp = prec.path == "fsdp"
    low_gather = prec.param if mp else prec.storage
    low_reduce = prec.reduce if mp else prec.storage
    policy, pp = layout.reshard_after_forward, layout.pp > 1
    groups: list[FsdpGroup] = []
    own = [s for s in specs if mp and not prec.low(s.kind)]
    units: dict[object, list[ParamSpec]] = {}  # by block; None: outside blocks
    grouped = grouped_fsdp_casts_every_output()  # else one group per module (parallelize.apply_fsdp)
    for s in own:  # every module here owns a single weight
        units.setdefault(s.block if grouped else s.name, []).append(s)
    for unit in units.values():
        groups.append(FsdpGroup("+".join(s.name.rsplit(".", 1)[0] for s in unit), numel(unit), "float32",
                                "float32", reshard_after_forward(policy, False, pp), "fp32"))
    rest = [s for s in specs if s not in own]
    layers = list(stage.layers)
    for j, i in enumerate(layers):
        block = [s for s in rest if s.block == i]
        groups.append(FsdpGroup(f"layers.{i}", numel(block), low_gather, low_reduce,
                                reshard_after_forward(policy, j == len(layers) - 1, pp), "block"))
    root = [s for s in rest if s.block is None]
    if root:
        groups.append(FsdpGroup("root", numel(root), low_gather, low_reduce,
                                reshard_after_forward(policy, True, pp), "root"))
    return groups


def fsdp_gathers_per_step(group: FsdpGroup, ops: list[str], pp: bool) -> int:
    """All-gathers of one group in a step of forward (F) / backward (B) passes.

    Without PP every pass starts sharded (backward reshards): F gathers, and B gathers again if
    the group was resharded after forward. With PP the stage runs backward with
    reshard_after_backward off until its last microbatch, so a pass gathers only when the group
    is sharded at that moment (after a resharding F, or at the start of the step).
    """
    if not pp:
        return sum(1 if op == "F" else int(group.reshard_after_forward) for op in ops)
    sharded, count = True, 0
    for op in ops:
        count += sharded
        sharded = op == "F" and group.reshard_after_forward
    return count


def stage_ops(layout: Layout, stage: Stage) -> list[str]:
    """Forward/backward passes of a stage in one schedule step (["F", "B"] without PP)."""
    if layout.pp == 1:
        return ["F", "B"]
    return schedule_ops(layout.pp_schedule, layout.microbatches, layout.num_stages, stage.index)


def fsdp_comm(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> dict[str, ByDtype]:
    """FSDP traffic of one rank per optimizer step, from its stages' groups:

    all-gather     = unsharded (padded) params in gather dtype, per gather (each forward, plus the
                     backward re-gather of groups resharded after forward; see
                     fsdp_gathers_per_step)
    reduce-scatter = unsharded (padded) grads in reduce dtype, per backward; under PP once per
                     schedule step (the stage syncs gradients after its last microbatch)
    HSDP all-reduce = this rank's padded grad shard in reduce dtype, after each reduce-scatter
    x gradient-accumulation steps.
    """
    n = layout.dp_shard
    ag: ByDtype = {}
    rs: ByDtype = {}
    ar: ByDtype = {}
    for stage, groups in stage_groups:
        ops = stage_ops(layout, stage)
        reduces = 1 if layout.pp > 1 else ops.count("B")
        for g in groups:
            gathers = fsdp_gathers_per_step(g, ops, layout.pp > 1)
            full = g.unsharded_numel(n)
            add_bytes(ag, g.gather_dtype, layout.grad_accum * gathers * full * DTYPE_BYTES[g.gather_dtype])
            add_bytes(rs, g.reduce_dtype, layout.grad_accum * reduces * full * DTYPE_BYTES[g.reduce_dtype])
            if layout.dp_replicate > 1:
                add_bytes(ar, g.reduce_dtype, layout.grad_accum * reduces * g.padded_shard_numel
                          * DTYPE_BYTES[g.reduce_dtype])
    out = {"fsdp_all_gather": ag, "fsdp_reduce_scatter": rs}
    if ar:
        out["hsdp_all_reduce"] = ar
    return out


def fsdp_calls(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> dict[str, int]:
    """FSDP collective calls of one rank per optimizer step: one all-gather per group per gather,
    one reduce-scatter (and HSDP all-reduce) per group per reduction (see fsdp_comm)."""
    out = {"fsdp_all_gather": 0, "fsdp_reduce_scatter": 0}
    for stage, groups in stage_groups:
        ops = stage_ops(layout, stage)
        reduces = 1 if layout.pp > 1 else ops.count("B")
        for g in groups:
            out["fsdp_all_gather"] += layout.grad_accum * fsdp_gathers_per_step(g, ops, layout.pp > 1)
            out["fsdp_reduce_scatter"] += layout.grad_accum * reduces
    if layout.dp_replicate > 1:
        out["hsdp_all_reduce"] = out["fsdp_reduce_scatter"]
    return out


def fsdp_transient(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> ByDtype:
    """FSDP buffers alive at the peak, by dtype (not counted in params/grads):

    without PP: groups not resharded after forward (root, last block) stay unsharded, plus, for
                the largest block, the gathered copy in use, the next one prefetched, its
                unsharded gradient (gather dtype) and its reduce-scatter input (reduce dtype)
    with PP:    a stage keeps its params unsharded and accumulates unsharded grads (reduce dtype)
                until its last microbatch: every group's unsharded params and grads
    """
    n = layout.dp_shard
    out: ByDtype = {}
    for _stage, groups in stage_groups:
        if layout.pp > 1:
            for g in groups:
                add_bytes(out, g.gather_dtype, g.unsharded_numel(n) * DTYPE_BYTES[g.gather_dtype])
                add_bytes(out, g.reduce_dtype, g.unsharded_numel(n) * DTYPE_BYTES[g.reduce_dtype])
            continue
        for g in groups:
            if not g.reshard_after_forward:
                add_bytes(out, g.gather_dtype, g.unsharded_numel(n) * DTYPE_BYTES[g.gather_dtype])
        blocks = [g for g in groups if g.kind == "block" and g.reshard_after_forward]
        if blocks:
            big = max(blocks, key=lambda g: g.padded_shard_numel)
            add_bytes(out, big.gather_dtype, 3 * big.unsharded_numel(n) * DTYPE_BYTES[big.gather_dtype])
            add_bytes(out, big.reduce_dtype, big.unsharded_numel(n) * DTYPE_BYTES[big.reduce_dtype])
    return out


def ddp_comm(params: list[tuple[int, bool]], prec: PrecisionSpec) -> dict[str, ByDtype]:
    """DDP all-reduce per optimizer step (no_sync while accumulating): (numel, safe) per param;
    safe modules' grads in reduce dtype when the compress hook is on, the rest in storage dtype."""
    ar: ByDtype = {}
    for numel, safe in params:
        dtype = prec.reduce if prec.comm_hook and safe else prec.storage
        add_bytes(ar, dtype, numel * DTYPE_BYTES[dtype])
    return {"ddp_all_reduce": ar}


def dp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
            tp_rank: int = 0) -> dict[str, ByDtype]:
    """Data-parallel traffic of one rank per step (fsdp_comm, or ddp_comm for replicate-only)."""
    stages = rank_stages(model, layout, pp_rank)
    if layout.dp_shard > 1:
        return fsdp_comm([(s, fsdp_groups(model, prec, layout, s, tp_rank)) for s in stages], layout)
    if layout.dp_replicate > 1:
        return ddp_comm([(math.prod(tp_local_shape(p, layout.tp, tp_rank)), prec.low(p.kind))
                         for s in stages for p in param_specs(model, s) if not prec.is_frozen(p.name)], prec)
    return {}


def tp_partial_grad_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> ByDtype:
    """Under sequence parallel without FSDP, the trained norm weights' Partial gradients, summed
    over TP once per optimizer step in one flat all-reduce (precision.PartialGradReducer): reduce
    dtype if norms are lower-precision-safe, else their own."""
    if layout.tp == 1 or not layout.sp or layout.dp_shard > 1:
        return {}
    wire = prec.reduce if prec.low("norm") else prec.storage
    norms = sum(1 for s in rank_stages(model, layout, pp_rank) for p in param_specs(model, s)
                if p.kind == "norm" and not prec.is_frozen(p.name))
    return {wire: norms * model.dim * DTYPE_BYTES[wire]} if norms else {}


def grad_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
              tp_rank: int = 0) -> dict[str, ByDtype]:
    """Every gradient collective of one rank per optimizer step, by dtype: FSDP's reduce-scatters
    (and HSDP's all-reduce), DDP's all-reduce, TP's partial-gradient all-reduce (under FSDP x TP
    FSDP sums those itself: in tp_comm's tp_all_reduce). Pipeline stages exchange no gradients."""
    out = {k: v for k, v in dp_comm(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank).items()
           if "reduce" in k}
    tp = tp_partial_grad_comm(model, prec, layout, pp_rank=pp_rank)
    if tp:
        out["tp_partial_grad_all_reduce"] = tp
    return out


# ---------------------------------------------------------------------------------------------
# Activations


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes per token of one microbatch (multiply by microbatch tokens)."""

    layer: float  # one block, nothing recomputed
    layer_checkpointed: float  # one block under full AC: its input only
    layer_op_sac: float  # one block under op-level selective AC (approximate)
    head: float  # final norm, output head, logits and loss (last stage)
    embedding: float  # token ids (first stage)


def activation_terms(model: ModelDims, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
    """Saved-for-backward bytes per token, the Megatron-LM estimate (Korthikanti et al. 2022,
    s*b*h*(34 + 5*a*s/h) in 16-bit) redone for this Llama block; equal to the bytes autograd saves
    in a real forward pass on CPU (tests/test_dry_run.py; the FSDP-path and TP variants follow
    from the same tensors with other dtypes and shards):

        norms      2 x (8d + 4) / sp        RMSNorm upcasts: fp32 input, fp32 normalized x, rstd
        linear in  (k_attn + k_ffn) x c x d   q/k/v and w1/w3 inputs; the whole sequence (DTensor
                                            keeps the all-gathered input under sequence parallel);
                                            k = 3 and 2 separate casts under autocast, else 1
        attention  c x (2d / t + 2kv') + 4H / t
                                            SDPA's q, k, v (kv' = d / t when repeat_kv copies the
                                            local kv heads to H / t heads, kv / t when it is a view:
                                            no repetition or one local kv head), its output (also
                                            wo's input) and
                                            logsumexp: fused attention, no s^2 term; rotary saves
                                            only its [s, head_dim/2] tables
        MLP        4 x c x f / t            w1 out, silu out, w3 out, w2 in
    with d = dim, kv = kv_heads x head_dim, f = ffn hidden, H = heads, t = TP degree, sp = t
    under sequence parallel (else 1), c = bytes of the matmul dtype (bf16: 2, fp32: 4). Full AC
    keeps only each block's input (r x d / sp, r = bytes of the residual dtype) and recomputes
    one block at a time in backward.
    """
    d, kv, f, h = model.dim, model.kv_dim, model.ffn_hidden, model.n_heads
    t = layout.tp
    sp = t if layout.sp else 1
    c = DTYPE_BYTES[prec.compute]
    r = DTYPE_BYTES[prec.residual]
    autocast_casts = prec.path == "autocast" and prec.compute != prec.residual
    k_attn, k_ffn = (3, 2) if autocast_casts else (1, 1)
    # repeat_kv copies k and v to H heads, except where the reshape is a view: no repetition, or
    # a single kv head on this rank (e.g. 8 kv heads over TP 8).
    local_kv_heads = max(model.kv_heads // t, 1)
    repeated = model.n_heads != model.kv_heads and local_kv_heads > 1
    kv_saved = d / t if repeated else local_kv_heads * model.head_dim
    norm = (8 * d + 4) / sp
    layer = (
        2 * norm
        + (k_attn + k_ffn) * c * d
        + c * (2 * d / t + 2 * kv_saved) + 4 * h / t
        + 4 * c * f / t
    )
    checkpointed = r * d / sp
    # Op-level SAC keeps matmul and attention outputs plus the inputs of its two regions
    # (approximate: not checked against a real run).
    op_sac = (
        checkpointed + 2 * norm + 2 * r * d / sp
        + c * (d + 2 * kv) / t + c * d + 2 * c * f / t + c * d
        + (c * d + 4 * h) / t
    )
    lp = t if (t > 1 and layout.loss_parallel) else 1
    out_b = DTYPE_BYTES[prec.output]
    # Final norm, the head's input, then logits in matmul dtype, cast to output dtype, and
    # cross-entropy's fp32 log-softmax (a live-tensor estimate at the loss, not checked).
    head = norm + c * d + (c + out_b + 4) * model.vocab_size / lp
    return ActivationTerms(layer, checkpointed, op_sac, head, 8.0)


@dataclass
class ActivationEstimate:
    """Peak activation bytes on one rank (all its stages) for each AC mode."""

    none: int
    full: int
    configured: int
    mode: str
    per_layer_none: int  # one block, one microbatch
    per_layer_full: int
    in_flight: dict[int, int]  # stage -> microbatches held at the peak
    tokens: int  # per microbatch

    def to_dict(self) -> dict[str, Any]:
        return {"none": self.none, "full": self.full, "configured": self.configured,
                "configured_mode": self.mode, "per_layer_none": self.per_layer_none,
                "per_layer_full_ac": self.per_layer_full,
                "in_flight_microbatches": {str(k): v for k, v in self.in_flight.items()},
                "tokens_per_microbatch": self.tokens}


def activation_bytes(model: ModelDims, prec: PrecisionSpec, layout: Layout, *,
                     pp_rank: int = 0) -> ActivationEstimate:
    """stage bytes = in-flight microbatches x tokens x (layers x per-layer + ends), where a
    recomputing mode adds one block's full activations (the one being recomputed)."""
    terms = activation_terms(model, prec, layout)
    tokens = layout.microbatch_tokens
    stages = rank_stages(model, layout, pp_rank)

    def stage_total(stage: Stage, mode: str) -> float:
        n = len(stage.layers)
        ends = (terms.head if stage.last else 0.0) + (terms.embedding if stage.first else 0.0)
        if mode == "none":
            per = n * terms.layer
        elif mode == "full":
            per = n * terms.layer_checkpointed + (terms.layer if n else 0)
        elif layout.ac_option == "op":
            per = n * terms.layer_op_sac + (terms.layer if n else 0)
        else:
            every = int(layout.ac_option)
            n_ac = len(range(0, n, every))
            per = n_ac * terms.layer_checkpointed + (n - n_ac) * terms.layer + (terms.layer if n_ac else 0)
        return per + ends

    in_flight = {s.index: in_flight_microbatches(layout, s.index, pp_rank) for s in stages}

    def total(mode: str) -> int:
        return int(sum(in_flight[s.index] * tokens * stage_total(s, mode) for s in stages))

    return ActivationEstimate(total("none"), total("full"), total(layout.ac_mode), layout.ac_mode,
                              int(tokens * terms.layer), int(tokens * terms.layer_checkpointed),
                              in_flight, tokens)


# ---------------------------------------------------------------------------------------------
# TP and PP traffic


def tp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> dict[str, ByDtype]:
    """Tensor-parallel activation collectives of one rank per optimizer step (T tokens per
    microbatch, volumes of full [T, d] tensors; r / c = residual / matmul dtype):

    per block, sequence parallel:  forward  2 all-gathers (r, attention and MLP inputs)
                                            + 2 reduce-scatters (c, wo and w2 outputs)
                                   backward 2 reduce-scatters (r) + 2 all-gathers (c)
    per block, no sequence parallel: forward 2 all-reduces (c), backward 2 all-reduces (r)
    first stage: embedding output reduce-scatter (all-reduce without SP) forward, all-gather back
    last stage:  output-head input all-gather (r) forward, reduce-scatter back; loss parallel
                 all-reduces 3 fp32 [T] statistics (max, sum-exp, target logit); without it the
                 logits [T, vocab] are all-gathered (c)
    SP:          norm weights' gradients arrive Partial over TP. FSDP all-reduces them (storage
                 dtype) before its reduce-scatter, per microbatch; without FSDP the trainer does,
                 once per step, in one flat all-reduce (precision.PartialGradReducer; reduce_dtype
                 if norms are lower-precision-safe). Frozen norms have no gradient.
    Recomputed blocks (full AC) repeat their forward collectives in backward except the last
    (w2's reduce-scatter / all-reduce): non-reentrant checkpointing stops recomputing once the
    last saved tensor is rebuilt.
    x microbatches (PP) x gradient-accumulation steps.
    """
    if layout.tp == 1:
        return {}
    r, c = prec.residual, prec.compute
    emb = prec.param if prec.low("embedding") else prec.storage
    norm_dtype = prec.param if prec.low("norm") else prec.storage
    full = layout.microbatch_tokens * model.dim
    vocab = layout.microbatch_tokens * model.vocab_size
    ag: ByDtype = {}
    rs: ByDtype = {}
    ar: ByDtype = {}
    passes = layout.microbatches * layout.grad_accum

    def conjugate_pair(dtype: str) -> None:
        """A [T, d] collective one way and its mirror the other: a reduce-scatter and an
        all-gather under sequence parallel, a single all-reduce without it."""
        nbytes = passes * full * DTYPE_BYTES[dtype]
        if layout.sp:
            add_bytes(rs, dtype, nbytes)
            add_bytes(ag, dtype, nbytes)
        else:
            add_bytes(ar, dtype, nbytes)

    for stage in rank_stages(model, layout, pp_rank):
        n = len(stage.layers)
        if layout.ac_mode == "full":
            recompute = n
        elif layout.ac_mode == "selective" and layout.ac_option != "op":
            recompute = len(range(0, n, int(layout.ac_option)))
        else:
            recompute = 0  # op-level SAC: not modelled (approximate)
        if layout.sp:
            add_bytes(ag, r, passes * (2 * n + 2 * recompute) * full * DTYPE_BYTES[r])
            add_bytes(rs, c, passes * (2 * n + recompute) * full * DTYPE_BYTES[c])
            add_bytes(rs, r, passes * 2 * n * full * DTYPE_BYTES[r])
            add_bytes(ag, c, passes * 2 * n * full * DTYPE_BYTES[c])
        else:
            add_bytes(ar, c, passes * (2 * n + recompute) * full * DTYPE_BYTES[c])
            add_bytes(ar, r, passes * 2 * n * full * DTYPE_BYTES[r])
        if stage.first:
            conjugate_pair(emb)  # embedding output
        if stage.last:
            conjugate_pair(r)  # output-head input
            if layout.loss_parallel:
                add_bytes(ar, "float32", passes * 3 * layout.microbatch_tokens * 4)
            else:
                add_bytes(ag, c, passes * vocab * DTYPE_BYTES[c])
        if layout.sp and layout.dp_shard > 1:
            norms = sum(1 for spec in param_specs(model, stage) if spec.kind == "norm" and not prec.is_frozen(spec.name))
            reduces = layout.grad_accum if layout.pp > 1 else passes
            add_bytes(ar, norm_dtype, reduces * norms * model.dim * DTYPE_BYTES[norm_dtype])
    for dtype, nbytes in tp_partial_grad_comm(model, prec, layout, pp_rank=pp_rank).items():
        add_bytes(ar, dtype, nbytes)
    return {k: v for k, v in (("tp_all_gather", ag), ("tp_reduce_scatter", rs), ("tp_all_reduce", ar)) if v}


def pp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> dict[str, ByDtype]:
    """Pipeline point-to-point traffic of one rank per step: each microbatch sends its stage
    output [mb, seq / sp, dim] forward and receives its gradient back, and the mirror image at the
    stage's input, in the residual stream's dtype (PrecisionSpec.residual: param dtype under FSDP,
    whose non-last stage roots do not cast to output_dtype; fp32 under autocast).
    x microbatches x gradient-accumulation steps."""
    if layout.pp == 1:
        return {}
    r = prec.residual
    sp = layout.tp if layout.sp else 1
    size = layout.pp_microbatch_size * (layout.seq_len // sp) * model.dim * DTYPE_BYTES[r]
    passes = layout.microbatches * layout.grad_accum
    send: ByDtype = {}
    recv: ByDtype = {}
    for stage in rank_stages(model, layout, pp_rank):
        boundaries = int(not stage.first) + int(not stage.last)
        add_bytes(send, r, passes * boundaries * size)
        add_bytes(recv, r, passes * boundaries * size)
    return {"pp_send": send, "pp_recv": recv}


# ---------------------------------------------------------------------------------------------
# Transient FSDP / DDP buffers and the whole estimate


def transient_bytes(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
                    tp_rank: int = 0) -> ByDtype:
    """Short-lived buffers at the peak, by dtype: fsdp_transient under FSDP; under DDP the
    gradient buckets, a copy of the grads in storage dtype."""
    if layout.dp_shard > 1:
        stages = rank_stages(model, layout, pp_rank)
        return fsdp_transient([(s, fsdp_groups(model, prec, layout, s, tp_rank)) for s in stages], layout)
    if layout.dp_replicate > 1:
        return dict(state_bytes(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank).grads)
    return {}


@dataclass
class MemoryEstimate:
    state: StateBytes
    transient: ByDtype
    activations: ActivationEstimate

    @property
    def state_total(self) -> int:
        return sum_bytes(self.state.params_padded) + sum_bytes(self.state.grads) + sum_bytes(self.state.optimizer)

    def peak(self, ac_mode: str | None = None) -> int:
        """params (padded) + grads + optimizer + transient buffers + activations of `ac_mode`
        (default: the layout's)."""
        act = {"none": self.activations.none, "full": self.activations.full,
               None: self.activations.configured}.get(ac_mode, self.activations.configured)
        return self.state_total + sum_bytes(self.transient) + act

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.to_dict(), "transient": self.transient,
                "activations": self.activations.to_dict(),
                "peak": {"ac_none": self.peak("none"), "ac_full": self.peak("full"),
                         "configured": self.peak()}}


def estimate(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
             tp_rank: int = 0, dp_shard_rank: int = 0) -> MemoryEstimate:
    """Everything for one rank. Rank 0 of each dimension is the largest (uneven shards put the
    short chunks last), and pipeline rank 0 holds the most in-flight microbatches."""
    return MemoryEstimate(
        state_bytes(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank, dp_shard_rank=dp_shard_rank),
        transient_bytes(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank),
        activation_bytes(model, prec, layout, pp_rank=pp_rank),
    )


def comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0,
         tp_rank: int = 0) -> dict[str, ByDtype]:
    """All traffic categories of one rank per step (see dp_comm, tp_comm, pp_comm)."""
    return {**dp_comm(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank),
            **tp_comm(model, prec, layout, pp_rank=pp_rank),
            **pp_comm(model, prec, layout, pp_rank=pp_rank)}


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_by_dtype(d: ByDtype) -> str:
    if not d:
        return "-"
    return " + ".join(f"{fmt_bytes(v)} {SHORT.get(k, k)}" for k, v in sorted(d.items()))

