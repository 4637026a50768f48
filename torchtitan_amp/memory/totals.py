"""The whole estimate for one rank: training state + transient FSDP / DDP buffers + activations,
and the peak under each AC mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_amp.memory.activations import ActivationEstimate, activation_bytes
from torchtitan_amp.memory.fsdp import fsdp_groups, fsdp_transient
from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.sizes import ByDtype, sum_bytes
from torchtitan_amp.memory.specs import Layout, PrecisionSpec
from torchtitan_amp.memory.stages import rank_stages
from torchtitan_amp.memory.state import StateBytes, state_bytes


def transient_bytes(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, tp_rank: int = 0
) -> ByDtype:
    """Short-lived buffers at the peak, by dtype: fsdp_transient under FSDP; under DDP the
    gradient buckets, a copy of the grads in storage dtype.

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
    if layout.fsdp_shard > 1:
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
        act = {"none": self.activations.none, "full": self.activations.full, None: self.activations.configured}.get(
            ac_mode, self.activations.configured
        )
        return self.state_total + sum_bytes(self.transient) + act

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.to_dict(),
            "transient": self.transient,
            "activations": self.activations.to_dict(),
            "peak": {"ac_none": self.peak("none"), "ac_full": self.peak("full"), "configured": self.peak()},
        }


def estimate(
    model: ModelDims,
    prec: PrecisionSpec,
    layout: Layout,
    *,
    pp_rank: int = 0,
    tp_rank: int = 0,
    dp_shard_rank: int = 0,
    device: str = "cuda",
) -> MemoryEstimate:
    """Everything for one rank. Rank 0 of each dimension is the largest (uneven shards put the
    short chunks last), and pipeline rank 0 holds the most in-flight microbatches.

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
        device: "cuda" (the default) sizes a GPU; "cpu" adds what only CPU's attention saves
            (activation_bytes).
    """
    return MemoryEstimate(
        state_bytes(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank, dp_shard_rank=dp_shard_rank),
        transient_bytes(model, prec, layout, pp_rank=pp_rank, tp_rank=tp_rank),
        activation_bytes(model, prec, layout, pp_rank=pp_rank, device=device),
    )
