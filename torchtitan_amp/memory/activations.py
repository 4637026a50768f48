"""Peak activation bytes on one rank: the family's bytes per token (ActivationTerms) times the
tokens of a microbatch, over the layers of each stage under each AC mode, times the microbatches
in flight at the pipeline's peak."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.memory.llama import ModelDims
from torchtitan_amp.memory.specs import Layout, PrecisionSpec, Stage
from torchtitan_amp.memory.stages import in_flight_microbatches, rank_stages


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
                     pp_rank: int = 0, device: str = "cuda") -> ActivationEstimate:
    """stage bytes = in-flight microbatches x tokens x (layers x per-layer + ends), where a
    recomputing mode adds one block's full activations (the one being recomputed). `device`
    "cpu" adds what only CPU's attention saves (ActivationTerms.layer_cpu), to compare with a
    measurement on this machine; GPUs are sized without it."""
    terms = model.activation_terms(prec, layout)
    if device == "cpu":
        terms = dataclasses.replace(terms, layer=terms.layer + terms.layer_cpu, layer_by_index=tuple(
            (i, v + terms.layer_cpu) for i, v in terms.layer_by_index))
    tokens = layout.microbatch_tokens
    stages = rank_stages(model, layout, pp_rank)

    def stage_total(stage: Stage, mode: str) -> float:
        n = len(stage.layers)
        ends = (terms.head if stage.last else 0.0) + (terms.embedding if stage.first else 0.0) + terms.stage
        full = [terms.layer_at(i) for i in stage.layers]
        if mode == "none":
            per = sum(full)
        elif mode == "full":
            per = n * terms.layer_checkpointed + max(full, default=0)
        elif layout.ac_option == "op":
            per = sum(terms.op_sac_at(i) for i in stage.layers) + max(full, default=0)
        else:
            ac = set(range(0, n, int(layout.ac_option)))
            kept = [f for j, f in enumerate(full) if j not in ac]
            per = len(ac) * terms.layer_checkpointed + sum(kept) + max((full[j] for j in ac), default=0)
        return per + ends

    in_flight = {s.index: in_flight_microbatches(layout, s.index, pp_rank) for s in stages}

    biggest = max((terms.layer_at(i) for s in stages for i in s.layers), default=terms.layer)

    def total(mode: str) -> int:
        return int(sum(in_flight[s.index] * tokens * stage_total(s, mode) for s in stages))

    return ActivationEstimate(total("none"), total("full"), total(layout.ac_mode), layout.ac_mode,
                              int(tokens * biggest), int(tokens * terms.layer_checkpointed),
                              in_flight, tokens)
