"""Traffic of one rank per optimizer step, by category and dtype: data parallel (FSDP's groups, or
DDP's all-reduce), tensor parallel (the TP plan's activation collectives, sequence parallel's
Partial norm gradients), context parallel (keys and values gathered, their gradients
reduce-scattered), pipeline send / recv, and the gradient collectives alone (grad_comm).
tp_comm counts TP regions per block as the family's dims say (ModelDims.tp_regions: Llama's a
colwise entry and a rowwise exit each, an MoE layer a replicated region), plus the decoder's two
ends (embedding and output head)."""

from __future__ import annotations

import math

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory.fsdp import fsdp_comm, fsdp_groups
from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.shards import tp_local_shape
from torchtitan_amp.memory.sizes import ByDtype, add_bytes
from torchtitan_amp.memory.specs import Layout, PrecisionSpec
from torchtitan_amp.memory.stages import rank_stages


def ddp_comm(params: list[tuple[int, bool]], prec: PrecisionSpec) -> dict[str, ByDtype]:
    """DDP all-reduce per optimizer step (no_sync while accumulating): (numel, safe) per param;
    safe modules' grads in reduce dtype when the compress hook is on, the rest in storage dtype."""
    ar: ByDtype = {}
    for numel, safe in params:
        dtype = prec.reduce if prec.comm_hook and safe else prec.storage
        add_bytes(ar, dtype, numel * DTYPE_BYTES[dtype])
    return {"ddp_all_reduce": ar}


def dp_comm(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, tp_rank: int = 0
) -> dict[str, ByDtype]:
    """Data-parallel traffic of one rank per step (fsdp_comm, or ddp_comm for replicate-only).

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
        tp_rank: the tensor-parallel rank whose shards are counted (uneven shards: rank 0's are the
            largest).
    """
    stages = rank_stages(model, layout, pp_rank)
    if layout.fsdp_shard > 1:
        return fsdp_comm([(s, fsdp_groups(model, prec, layout, s, tp_rank)) for s in stages], layout)
    if layout.dp_replicate > 1:
        return ddp_comm(
            [
                (math.prod(tp_local_shape(p, layout.tp, tp_rank)), prec.low(p.kind))
                for s in stages
                for p in model.param_specs(s)
                if not prec.is_frozen(p.name)
            ],
            prec,
        )
    if layout.cross_group_every_step:
        # One-rank replica groups: torchft all-reduces every trained gradient once per step, in
        # the dtype backward left it (storage: no compress hook on this path).
        numel = sum(
            math.prod(tp_local_shape(p, layout.tp, tp_rank))
            for s in stages
            for p in model.param_specs(s)
            if not prec.is_frozen(p.name)
        )
        return {"ft_cross_group_all_reduce": {prec.storage: numel * DTYPE_BYTES[prec.storage]}} if numel else {}
    return {}


def tp_partial_grad_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> ByDtype:
    """Under sequence parallel without FSDP, the trained norm weights' Partial gradients, summed
    over TP once per optimizer step in one flat all-reduce (precision.PartialGradReducer): reduce
    dtype if norms are lower-precision-safe, else their own.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
    """
    if layout.tp == 1 or not layout.sp or layout.fsdp_shard > 1:
        return {}
    wire = prec.reduce if prec.low("norm") else prec.storage
    norms = sum(
        1
        for s in rank_stages(model, layout, pp_rank)
        for p in model.param_specs(s)
        if p.kind == "norm" and not prec.is_frozen(p.name)
    )
    return {wire: norms * model.dim * DTYPE_BYTES[wire]} if norms else {}


def grad_comm(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, tp_rank: int = 0
) -> dict[str, ByDtype]:
    """Every gradient collective of one rank per optimizer step, by dtype: FSDP's reduce-scatters
    (and HSDP's all-reduce), DDP's all-reduce, TP's partial-gradient all-reduce (under FSDP x TP
    FSDP sums those itself: in tp_comm's tp_all_reduce). Pipeline stages exchange no gradients.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
        tp_rank: the tensor-parallel rank whose shards are counted (uneven shards: rank 0's are the
            largest).
    """
    out = {k: v for k, v in dp_comm(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank).items() if "reduce" in k}
    tp = tp_partial_grad_comm(model, prec, layout, pp_rank=pp_rank)
    if tp:
        out["tp_partial_grad_all_reduce"] = tp
    return out


# What one TP region of a block sends per forward pass of T tokens, each a full [T, d] tensor:
# kind -> sequence parallel? -> (forward entry collectives, forward exit collective or None,
# backward collectives), as (op, dtype role): "r" the residual stream's dtype, "c" the matmul's.
_Collective = tuple[str, str]
_REGIONS: dict[str, dict[bool, tuple[list[_Collective], _Collective | None, list[_Collective]]]] = {
    # Colwise entry, rowwise exit (Llama's attention and MLP).
    "split": {
        True: ([("all_gather", "r")], ("reduce_scatter", "c"), [("reduce_scatter", "r"), ("all_gather", "c")]),
        False: ([], ("all_reduce", "c"), [("all_reduce", "r")]),
    },
    # The whole sequence in, computed alike on every TP rank, this rank's slice out (MoE layers):
    # the input all-gathered, the output's gradient all-gathered back; nothing without SP.
    "replicated": {True: ([("all_gather", "r")], None, [("all_gather", "r")]), False: ([], None, [])},
    # The same with a split dense MLP inside (MoE's shared expert): its output all-reduced in
    # forward, its input's gradient (w1's and w3's partial sums added first) in backward.
    "replicated_split": {
        True: ([("all_gather", "r")], ("all_reduce", "c"), [("all_gather", "r"), ("all_reduce", "r")]),
        False: ([], ("all_reduce", "c"), [("all_reduce", "r")]),
    },
}


def tp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> dict[str, ByDtype]:
    """Tensor-parallel activation collectives of one rank per optimizer step (T tokens per
    microbatch, volumes of full [T, d] tensors; r / c = residual / matmul dtype):

    per block, each TP region the family's dims name (model.tp_regions(layer), priced by _REGIONS):
              "split" (Llama's attention and MLP), sequence parallel:
                                  forward  an all-gather (r, the input) + a reduce-scatter (c, the
                                           rowwise output); backward a reduce-scatter (r) + an
                                           all-gather (c)
              "split", no sequence parallel: forward an all-reduce (c), backward one (r)
              "replicated" (an MoE layer): SP: the input all-gathered (r) forward, the output's
                                  gradient all-gathered (r) backward; without SP nothing
              "replicated_split" (an MoE layer with a shared expert): the same, plus the shared
                                  expert's output all-reduce (c) forward and its input gradient's
                                  all-reduce (r) backward
    first stage: embedding output reduce-scatter (all-reduce without SP) forward, all-gather back
    last stage:  output-head input all-gather (r) forward, reduce-scatter back; loss parallel
                 all-reduces 3 fp32 [T] statistics (max, sum-exp, target logit); without it the
                 logits [T, vocab] are all-gathered (c)
    SP:          norm weights' gradients arrive Partial over TP. FSDP all-reduces them (storage
                 dtype) before its reduce-scatter, per microbatch; without FSDP the trainer does,
                 once per step, in one flat all-reduce (precision.PartialGradReducer; reduce_dtype
                 if norms are lower-precision-safe). Frozen norms have no gradient.
    Recomputed blocks (full AC) repeat their forward collectives in backward except the block's
    last if it is a region's exit (Llama's w2 reduce-scatter, the shared expert's all-reduce):
    non-reentrant checkpointing stops recomputing once the last saved tensor is rebuilt.
    x microbatches (PP) x gradient-accumulation steps.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
    """
    if layout.tp == 1:
        return {}
    dtypes = {"r": prec.residual, "c": prec.compute}
    emb = prec.param if prec.low("embedding") else prec.storage
    norm_dtype = prec.param if prec.low("norm") else prec.storage
    full = layout.microbatch_tokens * model.dim
    vocab = layout.microbatch_tokens * model.vocab_size
    by_op: dict[str, ByDtype] = {"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}}
    ag, rs, ar = by_op["all_gather"], by_op["reduce_scatter"], by_op["all_reduce"]
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
        again = recomputed_positions(layout, len(stage.layers))  # op-level SAC: not modelled (approximate)
        for position, layer in enumerate(stage.layers):
            for op, role in _block_collectives(model.tp_regions(layer), layout.sp, position in again):
                add_bytes(by_op[op], dtypes[role], passes * full * DTYPE_BYTES[dtypes[role]])
        if stage.first:
            conjugate_pair(emb)  # embedding output
        if stage.last:
            conjugate_pair(prec.residual)  # output-head input
            if layout.loss_parallel:
                add_bytes(ar, "float32", passes * 3 * layout.microbatch_tokens * 4)
            else:
                add_bytes(ag, prec.compute, passes * vocab * DTYPE_BYTES[prec.compute])
        if layout.sp and layout.fsdp_shard > 1:
            norms = sum(1 for spec in model.param_specs(stage) if spec.kind == "norm" and not prec.is_frozen(spec.name))
            reduces = layout.grad_accum if layout.pp > 1 else passes
            add_bytes(ar, norm_dtype, reduces * norms * model.dim * DTYPE_BYTES[norm_dtype])
    for dtype, nbytes in tp_partial_grad_comm(model, prec, layout, pp_rank=pp_rank).items():
        add_bytes(ar, dtype, nbytes)
    return {f"tp_{op}": v for op, v in by_op.items() if v}


def _block_collectives(regions: tuple[str, ...], sp: bool, recomputed: bool) -> list[_Collective]:
    """(op, dtype role) of every TP collective one block issues per forward + backward pass; a
    recomputed block's forward ones again, but for its last exit (see tp_comm)."""
    out: list[_Collective] = []
    for j, kind in enumerate(regions):
        entries, exit_, backward = _REGIONS[kind][sp]
        forward = [*entries, *([exit_] if exit_ else [])]
        redo = [*entries, *([exit_] if exit_ and j < len(regions) - 1 else [])] if recomputed else []
        out += forward + redo + backward
    return out


def pp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> dict[str, ByDtype]:
    """Pipeline point-to-point traffic of one rank per step: each microbatch sends its stage
    output [mb, seq / sp, dim] forward and receives its gradient back, and the mirror image at the
    stage's input, in the residual stream's dtype (PrecisionSpec.residual: param dtype under FSDP,
    whose non-last stage roots do not cast to output_dtype; fp32 under autocast).
    x microbatches x gradient-accumulation steps.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
    """
    if layout.pp == 1:
        return {}
    r = prec.residual
    sp = layout.tp if layout.sp else 1
    size = layout.pp_microbatch_size * (layout.local_seq_len // sp) * model.dim * DTYPE_BYTES[r]
    passes = layout.microbatches * layout.grad_accum
    send: ByDtype = {}
    recv: ByDtype = {}
    for stage in rank_stages(model, layout, pp_rank):
        boundaries = int(not stage.first) + int(not stage.last)
        add_bytes(send, r, passes * boundaries * size)
        add_bytes(recv, r, passes * boundaries * size)
    return {"pp_send": send, "pp_recv": recv}


def recomputed_positions(layout: Layout, n: int) -> range:
    """Positions, within a stage of n blocks, of the blocks whose forward runs again in backward:
    all under full AC, every N-th under selective(N); op-level SAC recomputes every block's
    unsaved ops, but which collectives those are differs per collective (tp_comm leaves it
    unmodelled; cp_comm counts the all-gathers)."""
    if layout.ac_mode == "full":
        return range(n)
    if layout.ac_mode == "selective" and layout.ac_option != "op":
        return range(0, n, int(layout.ac_option))
    return range(0)


def recomputed_blocks(layout: Layout, n: int) -> int:
    """How many of a stage's n blocks recompute their forward (recomputed_positions)."""
    return len(recomputed_positions(layout, n))


def cp_comm(model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0) -> dict[str, ByDtype]:
    """Context-parallel traffic of one rank per optimizer step (context_parallel.py), with
    W = B x S tokens of a whole window (S / cp of them this rank's):

    per block, forward:  an all-gather of each tensor model.cp_gathers_per_block names (Llama:
                         K and V, kv_heads / tp heads each), [W, width] in the activations' dtype
                         (the matmul dtype: bf16 under mixed precision);
                         again for a recomputed block (full / selective AC; op-level SAC saves
                         no all-gather, so it recomputes them too)
    per block, backward: a reduce-scatter of their gradients, [W, width] in cp_reduce dtype
    x microbatches (PP) x gradient-accumulation steps. Nothing per stage: block_causal's mask
    takes the keys' positions from the shape (ContextParallel.key_positions) and their documents
    from the batch (BatchSharder's kv_doc_ids); causal's chunks need neither.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
    """
    if layout.cp == 1:
        return {}
    window = layout.microbatch_sequences * layout.seq_len
    c, red = prec.compute, prec.cp_reduce
    passes = layout.microbatches * layout.grad_accum
    widths = sum(model.cp_gathers_per_block(layout.tp))
    ag: ByDtype = {}
    rs: ByDtype = {}
    for stage in rank_stages(model, layout, pp_rank):
        n = len(stage.layers)
        op_sac = layout.ac_mode == "selective" and layout.ac_option == "op"
        recompute = n if op_sac else recomputed_blocks(layout, n)
        add_bytes(ag, c, passes * (n + recompute) * window * widths * DTYPE_BYTES[c])
        add_bytes(rs, red, passes * n * window * widths * DTYPE_BYTES[red])
    return {"cp_all_gather": ag, "cp_reduce_scatter": rs}


def comm(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, tp_rank: int = 0
) -> dict[str, ByDtype]:
    """All traffic categories of one rank per step (see dp_comm, tp_comm, cp_comm, pp_comm, and
    the family's expert-parallel exchange, ModelDims.ep_comm).

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
        tp_rank: the tensor-parallel rank whose shards are counted (uneven shards: rank 0's are the
            largest).
    """
    return {
        **dp_comm(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank),
        **tp_comm(model, prec, layout, pp_rank=pp_rank),
        **cp_comm(model, prec, layout, pp_rank=pp_rank),
        **pp_comm(model, prec, layout, pp_rank=pp_rank),
        **model.ep_comm(prec, layout, rank_stages(model, layout, pp_rank)),
    }
