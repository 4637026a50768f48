"""Peak activation bytes on one rank: the family's bytes per token (ActivationTerms) times the
tokens of a microbatch, over the layers of each stage under each AC mode, times the microbatches
in flight at the pipeline's peak, plus the one block a recomputing mode rebuilds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.specs import Layout, PrecisionSpec, Stage
from torchtitan_amp.memory.stages import in_flight_at_peak, rank_stages


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
        return {
            "none": self.none,
            "full": self.full,
            "configured": self.configured,
            "configured_mode": self.mode,
            "per_layer_none": self.per_layer_none,
            "per_layer_full_ac": self.per_layer_full,
            "in_flight_microbatches": {str(k): v for k, v in self.in_flight.items()},
            "tokens_per_microbatch": self.tokens,
        }


def activation_bytes(
    model: ModelDims, prec: PrecisionSpec, layout: Layout, *, pp_rank: int = 0, device: str = "cuda"
) -> ActivationEstimate:
    """peak = tokens x (sum over stages of in-flight microbatches x (layers x per-layer + ends)
    + one recomputed block's full activations under a recomputing mode). `device`
    "cpu" adds what only CPU's attention saves (ActivationTerms.layer_cpu), to compare with a
    measurement on this machine; GPUs are sized without it.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        pp_rank: the pipeline rank whose stages are counted (0, the default, holds the most
            in-flight microbatches).
        device: "cuda" (the default) sizes a GPU; "cpu" adds what only CPU's attention saves, to
            compare with a measurement on this machine.
    """
    terms = model.activation_terms(prec, layout)
    if device == "cpu":
        terms = dataclasses.replace(
            terms,
            layer=terms.layer + terms.layer_cpu,
            layer_by_index=tuple((i, v + terms.layer_cpu) for i, v in terms.layer_by_index),
        )
    tokens = layout.microbatch_tokens
    stages = rank_stages(model, layout, pp_rank)

    def stage_terms(stage: Stage, mode: str) -> tuple[float, float]:
        """(bytes per token a microbatch keeps saved on this stage between its passes, bytes per
        token of the one block a recomputing mode rebuilds during a backward)."""
        n = len(stage.layers)
        ends = (terms.head if stage.last else 0.0) + (terms.embedding if stage.first else 0.0) + terms.stage
        full = [terms.layer_at(i) for i in stage.layers]
        if mode == "none":
            return sum(full) + ends, 0.0
        if mode == "full":
            return n * terms.layer_checkpointed + ends, max(full, default=0.0)
        if layout.ac_option == "op":
            return sum(terms.op_sac_at(i) for i in stage.layers) + ends, max(full, default=0.0)
        ac = set(range(0, n, int(layout.ac_option)))
        kept = [f for j, f in enumerate(full) if j not in ac]
        return (len(ac) * terms.layer_checkpointed + sum(kept) + ends, max((full[j] for j in ac), default=0.0))

    def peak(mode: str) -> tuple[int, dict[int, int]]:
        """Saved bytes at the step's peak: the microbatches in flight on each stage at the moment
        their kept bytes add up to most, plus one recomputed block (one microbatch's backward
        rebuilds one block at a time, whatever the count in flight)."""
        kept = {s.index: stage_terms(s, mode)[0] for s in stages}
        rebuilt = max((stage_terms(s, mode)[1] for s in stages), default=0.0)
        held = in_flight_at_peak(layout, pp_rank, kept)
        return int(tokens * (sum(held[s] * kept[s] for s in kept) + rebuilt)), held

    biggest = max((terms.layer_at(i) for s in stages for i in s.layers), default=terms.layer)
    configured, in_flight = peak(layout.ac_mode)
    return ActivationEstimate(
        peak("none")[0],
        peak("full")[0],
        configured,
        layout.ac_mode,
        int(tokens * biggest),
        int(tokens * terms.layer_checkpointed),
        in_flight,
        tokens,
    )
