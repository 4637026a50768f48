"""Training state one rank holds, by dtype: parameters (as held and as FSDP2 allocates them),
gradients and AdamW's state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.shards import efsdp_rank, fsdp_local_numel, fsdp_padded_numel, fsdp_split, tp_local_shape
from torchtitan_amp.memory.sizes import ByDtype, add_bytes
from torchtitan_amp.memory.specs import Layout, PrecisionSpec, nf4_bytes
from torchtitan_amp.memory.stages import rank_stages

# Bytes of AdamW's `step` counter per parameter tensor (a 0-d fp32 tensor per param).
ADAMW_STEP_BYTES = 4


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
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "params_padded": self.params_padded,
            "num_params": self.num_params,
            "num_tensors": self.num_tensors,
        }


def state_bytes(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, tp_rank: int = 0, dp_shard_rank: int = 0
) -> StateBytes:
    """Parameters, gradients and AdamW state held by one rank; `dp_shard_rank` is its index among
    FSDP's shards (dp_shard x cp: Layout.fsdp_rank).

    params    = local elements x bytes(storage)  (TP shard, then FSDP dim-0 shard; an EP-split
                expert weight: E / ep experts, FSDP dim-1 shard over efsdp, memory.fsdp_split)
    grads     = params (same shard, storage dtype: FSDP2 reduce-scatters into fp32 sharded grads),
                except that under TP without FSDP the embedding's gradient is a replicated full
                [vocab, dim] tensor (DTensor's embedding backward for a row-sharded table, torch 2.13)
    optimizer = 2 x params (exp_avg, exp_avg_sq in optimizer.state_dtype) + 4 bytes per tensor (step)
    frozen parameters (training.freeze): their compute dtype (PrecisionSpec.stored), no gradient,
                no optimizer state

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
        dp_shard_rank: this rank's index among FSDP's shards (dp_shard x cp), from 0.
    """
    out = StateBytes()
    mb = DTYPE_BYTES[prec.state]
    trained_tensors = 0
    for stage in rank_stages(model, layout, pp_rank):
        for spec in model.param_specs(stage):
            shape = tp_local_shape(spec, layout.tp, tp_rank)
            if layout.fsdp_shard > 1:
                shape, shards, dim = fsdp_split(spec, shape, layout)
                rank = efsdp_rank(layout, dp_shard_rank) if dim == 1 else dp_shard_rank
                numel = fsdp_local_numel(shape, shards, rank, dim)
                padded = fsdp_padded_numel(shape, shards, dim)
            else:
                numel = padded = math.prod(shape)
            out.num_params += numel
            out.num_tensors += 1
            dtype = prec.stored(spec)
            sb = DTYPE_BYTES[dtype]
            if prec.lora_nf4 and prec.lora_target(spec):
                add_bytes(out.params, "uint8", nf4_bytes(numel, sb))
                add_bytes(out.params_padded, "uint8", nf4_bytes(padded, sb))
            elif prec.lora_fp8 and prec.lora_target(spec) and len(spec.shape) == 2:  # 1-byte codes + row scales
                for held, n in ((out.params, numel), (out.params_padded, padded)):
                    add_bytes(held, "float8_e4m3fn", n)
                    add_bytes(held, "float32", 4 * spec.shape[0])
            else:
                add_bytes(out.params, dtype, numel * sb)
                add_bytes(out.params_padded, dtype, padded * sb)
            if prec.lora_target(spec):
                trained_tensors += 2
                add_adapter_bytes(out, prec, spec.shape, layout.fsdp_shard)
            if prec.is_frozen(spec.name):
                continue
            trained_tensors += 1
            grad = numel
            if spec.kind == "embedding" and layout.tp > 1 and layout.fsdp_shard == 1:
                grad = math.prod(spec.shape)  # see the docstring: replicated embedding gradient
            add_bytes(out.grads, dtype, grad * sb)
            add_bytes(out.optimizer, prec.state, 2 * numel * mb)
    add_bytes(out.optimizer, "float32", ADAMW_STEP_BYTES * trained_tensors)
    return out


def add_adapter_bytes(out: StateBytes, prec: PrecisionSpec, shape: tuple[int, ...], fsdp_shard: int) -> None:
    """LoRA's two adapters on a [out, in] base weight: A [r, in] and B [out, r], each sharded on
    dim 0 by FSDP (rank 0's share, the largest), in storage dtype with their gradient and AdamW
    moments.

    Args:
        out: the rank's state bytes, added to in place.
        prec: the precision spec (lora_rank, storage and optimizer-state dtypes).
        shape: the base weight's [out, in] shape.
        fsdp_shard: the FSDP shard degree the adapters are split over.
    """
    r, sb, mb = prec.lora_rank, DTYPE_BYTES[prec.storage], DTYPE_BYTES[prec.state]
    for rows, cols in ((r, shape[1]), (shape[0], r)):
        numel = -(-rows // fsdp_shard) * cols
        out.num_params += numel
        out.num_tensors += 1
        add_bytes(out.params, prec.storage, numel * sb)
        add_bytes(out.params_padded, prec.storage, numel * sb)
        add_bytes(out.grads, prec.storage, numel * sb)
        add_bytes(out.optimizer, prec.state, 2 * numel * mb)


# DiLoCo (train/diloco.py): the outer optimizer's state beside the model all along, and a sync's
# buffers. A sync runs after the step's optimizer step, when the activations and the gathers are
# gone: the wire buffer (the pseudo-gradient of this rank's shard, all-reduced in place and kept
# until the commit decision) and the per-chunk temporaries (the fp32 difference, the rounded start
# of a low-precision model, the upcast mean, the outer update), at most 3 chunks of the state dtype.
DILOCO_CHUNK_TEMPORARIES = 3


def diloco_bytes(local_numel: int, wire: str, outer: str, chunk_elements: int) -> tuple[ByDtype, ByDtype]:
    """(outer state: global weights + momentum, a sync's buffers: wire + chunk temporaries) of a
    rank holding `local_numel` trained elements, by dtype.

    Args:
        local_numel: the trained elements this rank holds.
        wire: the dtype a sync sends the pseudo-gradients in.
        outer: the outer optimizer's dtype (global weights and momentum).
        chunk_elements: the elements a sync handles at a time (its temporaries are this long at
            most).
    """
    sync: ByDtype = {}
    add_bytes(sync, wire, local_numel * DTYPE_BYTES[wire])
    add_bytes(sync, outer, DILOCO_CHUNK_TEMPORARIES * min(local_numel, chunk_elements) * DTYPE_BYTES[outer])
    return {outer: 2 * local_numel * DTYPE_BYTES[outer]}, sync


def peak_with_diloco(peak: dict[str, int], outer_state: ByDtype, sync: ByDtype, state_total: int) -> dict[str, int]:
    """Each training peak with DiLoCo: plus the outer state, or the sync's peak (state + outer state
    + its buffers) where that is higher.

    Args:
        peak: each training peak's bytes, by name.
        outer_state: the outer state by dtype (diloco_bytes' first).
        sync: a sync's buffers by dtype (diloco_bytes' second).
        state_total: the bytes of parameters, gradients and optimizer state held during a sync.
    """
    outer, at_sync = sum(outer_state.values()), state_total + sum(outer_state.values()) + sum(sync.values())
    return {k: max(v + outer, at_sync) for k, v in peak.items()}
