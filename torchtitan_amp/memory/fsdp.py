"""FSDP2 as parallelize.apply_fsdp sets it up: the fully_shard groups of a stage, how often each
gathers and reduces in a step (fsdp_comm, fsdp_calls), and its unsharded buffers alive at the peak
(fsdp_transient). The dry run feeds fsdp_comm and fsdp_transient the groups of a real (meta) model."""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_amp.core.rules import DTYPE_BYTES, reshard_after_forward
from torchtitan_amp.core.torch_compat import grouped_fsdp_casts_every_output
from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.shards import fsdp_padded_numel, fsdp_split, tp_local_shape
from torchtitan_amp.memory.sizes import ByDtype, add_bytes, merge
from torchtitan_amp.memory.specs import Layout, ParamSpec, PrecisionSpec, Stage
from torchtitan_amp.memory.stages import stage_ops

FP8_GATHER = "float8_e4m3fn"  # torchao's Float8Linear weights, all-gathered under fp8_all_gather


@dataclass(frozen=True)
class FsdpGroup:
    """One fully_shard unit: what it gathers and reduces per pass."""

    name: str
    padded_shard_numel: int  # all-gather input per rank; x shards = unsharded (padded) size
    gather_dtype: str
    reduce_dtype: str
    reshard_after_forward: bool
    kind: str  # "block" | "fp32" | "root" | "experts"
    # Its own shard degree where it is not FSDP's (EP-split experts: efsdp); 0: the layout's.
    shards: int = 0
    # Of padded_shard_numel, the fp8 Linears' weights under mixed_precision.fp8_all_gather: torchao
    # all-gathers them in float8_e4m3fn (1 byte on the wire and unsharded); their unsharded
    # gradients stay in gather_dtype (the fp8 weight computes in the policy's param dtype).
    fp8_shard_numel: int = 0
    # Of padded_shard_numel, the frozen parameters' (LoRA's base, training.freeze): gathered as
    # any other, but FSDP2 reduces no gradient of them and holds none (a group of only frozen
    # ones issues no reduce-scatter).
    frozen_shard_numel: int = 0

    def degree(self, layout_shards: int) -> int:
        return self.shards or layout_shards

    def unsharded_numel(self, shards: int) -> int:
        return self.padded_shard_numel * self.degree(shards)

    def trained_numel(self, shards: int) -> int:
        """The unsharded (padded) elements that get a gradient: what the reduce-scatter takes."""
        return (self.padded_shard_numel - self.frozen_shard_numel) * self.degree(shards)

    @property
    def trained(self) -> bool:
        return self.padded_shard_numel > self.frozen_shard_numel

    def gathered(self, shards: int) -> ByDtype:
        """The unsharded (padded) params as the all-gather delivers them, bytes by dtype."""
        out: ByDtype = {}
        n, fp8 = self.degree(shards), self.fp8_shard_numel
        add_bytes(out, FP8_GATHER, fp8 * n * DTYPE_BYTES[FP8_GATHER])
        add_bytes(out, self.gather_dtype, (self.padded_shard_numel - fp8) * n * DTYPE_BYTES[self.gather_dtype])
        return out

    @property
    def category(self) -> str:
        """Traffic category prefix: EP-split experts' collectives run over the efsdp group."""
        return "expert_fsdp" if self.kind == "experts" else "fsdp"


def fsdp_groups(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, stage: Stage, tp_rank: int = 0
) -> list[FsdpGroup]:
    """The groups parallelize.apply_fsdp creates on a stage: on the "fsdp" path the modules outside
    the safe list form one fp32 group per block (its norms) and one for those outside blocks; each
    block is a group; the root holds the rest. Which reshard after forward:
    rules.reshard_after_forward. Under EP each layer's routed experts are a group of their own
    over efsdp ranks, sharded first (parallelize.shard_ep_experts).

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        stage: the pipeline stage (its layers, and whether it holds the embedding or the output
            head) whose groups are listed.
        tp_rank: the tensor-parallel rank whose shards are counted (uneven shards: rank 0's are the
            largest).
    """
    specs = model.param_specs(stage)

    def numel(ss: list[ParamSpec]) -> int:
        return sum(fsdp_padded_numel(*fsdp_split(s, tp_local_shape(s, layout.tp, tp_rank), layout)) for s in ss)

    mp = prec.path == "fsdp"
    low_gather = prec.param if mp else prec.storage
    low_reduce = prec.reduce if mp else prec.storage
    policy, pp = layout.reshard_after_forward, layout.pp > 1
    groups: list[FsdpGroup] = []
    experts: dict[object, list[ParamSpec]] = {}
    for s in specs:
        if s.expert and layout.ep > 1:
            experts.setdefault(s.block, []).append(s)
    for unit in experts.values():
        gather, red = (low_gather, low_reduce) if prec.low(unit[0].kind) else (prec.storage, prec.storage)
        groups.append(
            FsdpGroup(
                unit[0].name.rsplit(".", 1)[0],
                numel(unit),
                gather,
                red,
                reshard_after_forward(policy, False, pp),
                "experts",
                layout.efsdp,
            )
        )
    specs = [s for s in specs if not (s.expert and layout.ep > 1)]
    if prec.lora_rank:
        groups += lora_groups(specs, prec, layout, tp_rank)
        if mp:  # the frozen low-precision modules are in groups of their own (data_parallel.apply_fsdp)
            specs = [s for s in specs if not prec.low(s.kind)]

    def frozen(ss: list[ParamSpec]) -> int:  # under LoRA every base parameter (training.freeze: not modelled)
        return numel(ss) if prec.lora_rank else 0

    own = [s for s in specs if mp and not prec.low(s.kind)]
    units: dict[object, list[ParamSpec]] = {}  # by block; None: outside blocks
    grouped = grouped_fsdp_casts_every_output()  # else one group per module (parallelize.apply_fsdp)
    for s in own:  # every module here owns a single weight
        units.setdefault(s.block if grouped else s.name, []).append(s)
    for unit in units.values():
        groups.append(
            FsdpGroup(
                "+".join(s.name.rsplit(".", 1)[0] for s in unit),
                numel(unit),
                "float32",
                "float32",
                reshard_after_forward(policy, False, pp),
                "fp32",
                frozen_shard_numel=frozen(unit),
            )
        )
    rest = [s for s in specs if s not in own]
    layers = list(stage.layers)
    for j, i in enumerate(layers):
        block = [s for s in rest if s.block == i]
        if block or not prec.lora_rank:  # FSDP2 makes no group of a block left without parameters
            groups.append(
                FsdpGroup(
                    f"layers.{i}",
                    numel(block),
                    low_gather,
                    low_reduce,
                    reshard_after_forward(policy, j == len(layers) - 1, pp),
                    "block",
                    frozen_shard_numel=frozen(block),
                )
            )
    root = [s for s in rest if s.block is None]
    last = reshard_after_forward(policy, True, pp)
    if root:
        groups.append(FsdpGroup("root", numel(root), low_gather, low_reduce, last, "root", 0, 0, frozen(root)))
    return groups


def lora_groups(specs: list[ParamSpec], prec: PrecisionSpec, layout: Layout, tp_rank: int = 0) -> list[FsdpGroup]:
    """LoRA's groups (data_parallel.apply_fsdp): per block, and one for the modules outside blocks,
    the adapters (lora_A [r, in] and lora_B [out, r] of each target, split by TP as their base is and
    sharded on dim 0: gathered and reduced in the low-precision policy's dtypes) and, on the "fsdp"
    path, the frozen low-precision modules (the base's Linears: gathered in param dtype, never
    reduced). Each reshards after forward as a non-last group does; a unit over a block that holds an
    adapted Linear counts as the block's (dry_run's kind "block"), one outside blocks as "fp32".

    Args:
        specs: the stage's parameters (routed experts under EP left out).
        prec: the precision spec: lora_rank and targets, the path and its dtypes.
        layout: the parallel layout (tp, the FSDP shard degree, the reshard policy, pp).
        tp_rank: the tensor-parallel rank whose shards are counted.
    """
    mp = prec.path == "fsdp"
    gather, red = (prec.param, prec.reduce) if mp else (prec.storage, prec.storage)
    reshard = reshard_after_forward(layout.reshard_after_forward, False, layout.pp > 1)
    blocks = sorted({s.block for s in specs}, key=lambda b: (b is None, b or 0))  # outside blocks last
    groups = []
    for block in blocks:
        inside = [s for s in specs if s.block == block]
        targets = [s for s in inside if prec.lora_target(s)]
        kind = "block" if block is not None and targets else "fp32"
        base = [s for s in inside if mp and prec.low(s.kind)]
        if base:
            n = sum(fsdp_padded_numel(*fsdp_split(s, tp_local_shape(s, layout.tp, tp_rank), layout)) for s in base)
            name = "+".join(s.name.rsplit(".", 1)[0] for s in base)
            groups.append(FsdpGroup(name, n, gather, red, reshard, kind, frozen_shard_numel=n))
        if targets:
            n, names = 0, []
            for s in targets:
                rows, cols = tp_local_shape(s, layout.tp, tp_rank)
                module = s.name.removesuffix(".weight")
                n += fsdp_padded_numel((prec.lora_rank, cols), layout.fsdp_shard)
                n += fsdp_padded_numel((rows, prec.lora_rank), layout.fsdp_shard)
                names += [f"{module}.lora_A", f"{module}.lora_B"]
            groups.append(FsdpGroup("+".join(names), n, gather, red, reshard, kind))
    return groups


def fsdp_gathers_per_step(
    group: FsdpGroup, ops: list[str], pp: bool, per_microbatch: bool = False, mistargeted: bool = False
) -> int:
    """All-gathers of one group in a step of forward (F) / backward (B) passes.

    Without PP every pass starts sharded (backward reshards): F gathers, and B gathers again if
    the group was resharded after forward. With PP a pass gathers only when the group is sharded
    at that moment: after a resharding F, after a B under pipeline_fsdp_reduce = "per_microbatch"
    (per_step: the stage runs backward with reshard_after_backward off until its last microbatch),
    or at the start of the step. `mistargeted` (per_microbatch only, fsdp_prefetch_target): a B
    that follows two or more Fs gathers this group once more. FSDP2 prefetches in backward by the
    reverse post-forward order, which then still lists the earlier microbatch's forward, and the
    stage's first group in that order reaches back to its last group, already resharded by this
    backward (measured, torch 2.13).

    Args:
        group: the FSDP group counted.
        ops: the stage's passes in order, "F" (a microbatch's forward) or "B" (its backward):
            schedule_ops.
        pp: whether pipeline parallel is on (a pass then gathers only when the group is sharded).
        per_microbatch: pipeline_fsdp_reduce = "per_microbatch": every B reshards; False:
            "per_step".
        mistargeted: whether FSDP2's backward prefetch reaches the wrong group
            (fsdp_prefetch_target), described above.
    """
    if not pp:
        return sum(1 if op == "F" else int(group.reshard_after_forward) for op in ops)
    sharded, count, forwards = True, 0, 0
    for op in ops:
        count += sharded
        if op == "B":
            count += mistargeted and per_microbatch and forwards >= 2
            forwards = 0
        else:
            forwards += 1
        sharded = group.reshard_after_forward if op == "F" else per_microbatch
    return count


def fsdp_prefetch_target(groups: list[FsdpGroup], stage: Stage) -> FsdpGroup | None:
    """The group FSDP2's backward prefetch re-gathers after two or more forwards (see
    fsdp_gathers_per_step): the stage's last group in forward order (the fp32 group of the norm
    and output on the last stage, else its last block), unless the stage's first group runs
    inside it (a single block, no embedding group), when it is still gathered."""
    blocks = [g for g in groups if g.kind == "block"]
    outside = [g for g in groups if g.kind == "fp32" and not g.name.startswith("layers.")]
    if not blocks or (len(blocks) == 1 and not outside):
        return None
    if stage.last and outside:
        return outside[-1]
    return blocks[-1]


def _reductions(layout: Layout, ops: list[str]) -> int:
    """Reduce-scatters of each group per schedule step: one per backward without PP and under
    pipeline_fsdp_reduce = "per_microbatch", else one after the stage's last microbatch."""
    if layout.pp > 1 and layout.pp_fsdp_reduce != "per_microbatch":
        return 1
    return ops.count("B")


def _reductions_per_step(layout: Layout, ops: list[str]) -> int:
    """Reduce-scatters of each group per optimizer step: _reductions per schedule step times the
    accumulation steps; one under per-step fault tolerance without PP, whose gradient sync is off
    for all but the last micro-batch (the replica groups' all-reduce then runs once per step)."""
    if layout.cross_group_every_step and layout.pp == 1:
        return 1
    return layout.grad_accum * _reductions(layout, ops)


def _gathers(g: FsdpGroup, groups: list[FsdpGroup], stage: Stage, ops: list[str], layout: Layout) -> int:
    per_microbatch = layout.pp_fsdp_reduce == "per_microbatch"
    return fsdp_gathers_per_step(
        g, ops, layout.pp > 1, per_microbatch, per_microbatch and g is fsdp_prefetch_target(groups, stage)
    )


def fsdp_comm(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> dict[str, ByDtype]:
    """FSDP traffic of one rank per optimizer step, from its stages' groups:

    all-gather     = unsharded (padded) params in gather dtype (fp8 weights in float8), per gather
                     (each forward, plus the backward re-gather of groups resharded after
                     forward; see fsdp_gathers_per_step)
    reduce-scatter = unsharded (padded) grads in reduce dtype, per backward; under PP with
                     pipeline_fsdp_reduce = "per_step" once per schedule step (the stage syncs
                     gradients after its last microbatch)
    x gradient-accumulation steps, except under per-step fault tolerance: once per step
    (_reductions_per_step);
    HSDP all-reduce = this rank's padded grad shard in reduce dtype, after each reduce-scatter;
    the same across torchft's replica groups (layout.replica_groups, category
    ft_cross_group_all_reduce; none under DiLoCo). EP-split experts gather and reduce over their efsdp ranks
    (categories expert_fsdp_*; none when efsdp is 1: FSDP2 skips a one-rank collective), and
    still all-reduce over dp_replicate under HSDP. A frozen group (not `trained`) only gathers.
    """
    out: dict[str, ByDtype] = {}
    ar: ByDtype = {}
    for stage, groups in stage_groups:
        ops = stage_ops(layout, stage)
        reduces = _reductions_per_step(layout, ops)
        for g in groups:
            if g.degree(layout.fsdp_shard) > 1:
                gathers = _gathers(g, groups, stage, ops, layout)
                for dtype, nbytes in g.gathered(layout.fsdp_shard).items():
                    add_bytes(
                        out.setdefault(f"{g.category}_all_gather", {}), dtype, layout.grad_accum * gathers * nbytes
                    )
                if g.trained:
                    add_bytes(
                        out.setdefault(f"{g.category}_reduce_scatter", {}),
                        g.reduce_dtype,
                        reduces * g.trained_numel(layout.fsdp_shard) * DTYPE_BYTES[g.reduce_dtype],
                    )
            if g.trained and (layout.dp_replicate > 1 or layout.cross_group_every_step):
                shard = g.padded_shard_numel - g.frozen_shard_numel
                add_bytes(ar, g.reduce_dtype, reduces * shard * DTYPE_BYTES[g.reduce_dtype])
    if ar:
        out[_replicate_key(layout)] = ar
    return out


def _replicate_key(layout: Layout) -> str:
    """The all-reduce over the replicas: HSDP's, or torchft's across replica groups."""
    return "ft_cross_group_all_reduce" if layout.replica_groups > 1 else "hsdp_all_reduce"


def fsdp_calls(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> dict[str, int]:
    """FSDP collective calls of one rank per optimizer step: one all-gather per group per gather,
    one reduce-scatter (and HSDP all-reduce) per trained group per reduction (see fsdp_comm)."""
    out = {"fsdp_all_gather": 0, "fsdp_reduce_scatter": 0}
    for stage, groups in stage_groups:
        ops = stage_ops(layout, stage)
        reduces = _reductions_per_step(layout, ops)
        for g in groups:
            if g.trained and (layout.dp_replicate > 1 or layout.cross_group_every_step):
                key = _replicate_key(layout)
                out[key] = out.get(key, 0) + reduces
            if g.degree(layout.fsdp_shard) == 1:
                continue
            for op, n in (
                ("all_gather", layout.grad_accum * _gathers(g, groups, stage, ops, layout)),
                ("reduce_scatter", reduces if g.trained else 0),
            ):
                key = f"{g.category}_{op}"
                out[key] = out.get(key, 0) + n
    return out


def _add(out: ByDtype, dtype: str, numel: int) -> None:
    add_bytes(out, dtype, numel * DTYPE_BYTES[dtype])


def _pp_transient(groups: list[FsdpGroup], n: int, per_microbatch: bool, out: ByDtype) -> None:
    """One PP stage's FSDP buffers held between its passes. per_step: every group's gathered
    params and its unsharded gradient accumulated in the reduce dtype, across microbatches.
    per_microbatch: the params of the groups kept after forward (all, under the default policy)
    and two of the largest block otherwise (in use, prefetched)."""
    kept = [g for g in groups if not g.reshard_after_forward]
    for g in kept if per_microbatch else groups:
        for dtype, nbytes in g.gathered(n).items():  # fp8 weights gathered in float8
            add_bytes(out, dtype, nbytes)
        if not per_microbatch:
            _add(out, g.reduce_dtype, g.trained_numel(n))
    resharding = [g for g in groups if g.reshard_after_forward]
    if per_microbatch and resharding:
        big = max(resharding, key=lambda g: g.unsharded_numel(n))
        for dtype, nbytes in big.gathered(n).items():  # in use and prefetched
            add_bytes(out, dtype, 2 * nbytes)


def _block_of(group: FsdpGroup) -> int | None:
    """The block a group belongs to (its modules are named layers.N...), None outside blocks."""
    parts = group.name.split(".")
    return int(parts[1]) if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() else None


def _freed_before(group: FsdpGroup, reducing: FsdpGroup, stage: Stage) -> bool:
    """Whether a group's backward has run (and resharded it) by the time `reducing` reduces:
    itself, its own and later blocks' groups, and the norm / output group after the blocks of the
    last stage; never the root, whose post-backward runs last."""
    if group.kind == "root":
        return False
    block, mine = _block_of(group), _block_of(reducing)
    if block is None:
        return stage.last and group.kind == "fp32" and mine is not None
    return mine is not None and block >= mine


def _reducing(group: FsdpGroup, groups: list[FsdpGroup], stage: Stage, n: int, per_microbatch: bool) -> ByDtype:
    """Change to what a stage holds while FSDP takes one group's gradient: autograd's unsharded
    gradient (gather dtype) of it and of the root group (whose post-backward runs last), and
    under per_microbatch its reduce-scatter input (reduce dtype), net of the params already
    resharded by then (its own and those of the groups whose backward ran before it)."""
    here: ByDtype = {}
    for g in {id(g): g for g in (group, *(g for g in groups if g.kind == "root"))}.values():
        _add(here, g.gather_dtype, g.trained_numel(n))
    if per_microbatch:
        _add(here, group.reduce_dtype, group.trained_numel(n))
        for g in groups:
            if not g.reshard_after_forward and _freed_before(g, group, stage):
                _add(here, g.gather_dtype, -g.unsharded_numel(n))
    return here


def _pp_backward_grads(stage_groups: list[tuple[Stage, list[FsdpGroup]]], n: int, per_microbatch: bool) -> ByDtype:
    """The most gradient bytes alive inside one backward (_reducing of the worst group; a rank
    runs one backward at a time, so the worst over its stages)."""
    best: ByDtype = {}
    for stage, groups in stage_groups:
        for g in [g for g in groups if g.kind != "root"] or groups:
            here = _reducing(g, groups, stage, n, per_microbatch)
            if sum(here.values()) > sum(best.values()):
                best = here
    return best


def fsdp_transient(stage_groups: list[tuple[Stage, list[FsdpGroup]]], layout: Layout) -> ByDtype:
    """FSDP buffers alive at the peak, by dtype (not counted in params/grads):

    without PP: groups not resharded after forward (root, last block) stay unsharded; under
                per-step fault tolerance with gradient accumulation every group's unsharded
                gradient in the reduce dtype (accumulated until the last micro-batch); plus, for
                the largest block (and the largest EP experts group: an MoE block has both in
                use), the gathered copy in use, the next one prefetched, its unsharded gradient
                (gather dtype) and its reduce-scatter input (reduce dtype)
    with PP:    per pipeline_fsdp_reduce: what each stage of the rank holds between its passes
                (_pp_transient; under Interleaved1F1B every stage keeps its own) plus the
                gradients of the one backward running (_pp_backward_grads). Measured equal in
                real runs (tests/workers/pp_held.py).
    """
    n = layout.fsdp_shard
    out: ByDtype = {}
    if layout.pp > 1:
        for dtype, b in _pp_backward_grads(stage_groups, n, layout.pp_fsdp_reduce == "per_microbatch").items():
            add_bytes(out, dtype, b)
    for _stage, groups in stage_groups:
        if layout.pp > 1:
            _pp_transient(groups, n, layout.pp_fsdp_reduce == "per_microbatch", out)
            continue
        for g in groups:
            if not g.reshard_after_forward:
                out = merge(out, g.gathered(n))
            if layout.cross_group_every_step and layout.grad_accum > 1:
                # Gradient sync off until the last micro-batch: unsharded, accumulated in the reduce dtype.
                _add(out, g.reduce_dtype, g.trained_numel(n))
        for kind in ("block", "experts"):
            out = merge(out, _largest_block(groups, kind, n))
    return out


def _largest_block(groups: list[FsdpGroup], kind: str, n: int) -> ByDtype:
    """The largest block's buffers at the peak: its groups of `kind` (one, or under LoRA the frozen
    Linears' and the adapters') gathered twice, in use and prefetched (fp8 weights: 1 byte), and
    the unsharded gradient (gather dtype) and reduce-scatter input of its trained parameters."""
    units: dict[object, list[FsdpGroup]] = {}
    for g in groups:
        if g.kind == kind and g.reshard_after_forward:
            units.setdefault(_block_of(g) if kind == "block" else g.name, []).append(g)
    if not units:
        return {}
    big = max(units.values(), key=lambda unit: sum(g.unsharded_numel(n) for g in unit))
    out: ByDtype = {}
    for g in big:
        gathered = g.gathered(n)
        out = merge(out, gathered, gathered)
        _add(out, g.gather_dtype, g.trained_numel(n))
        _add(out, g.reduce_dtype, g.trained_numel(n))
    return out
