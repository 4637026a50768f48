"""The gpt-oss family's parameter terms in the memory model (models/gpt_oss/, model.name =
"gpt_oss"): the MoE family's (MoEDims) plus what gpt-oss adds to each block: biases on q, k, v
(split by TP with their rows) and o (replicated), the attention sinks (one fp32 logit per head,
kind "sinks": outside the lower-precision-safe kinds, so fp32 like the router; split by TP with
the heads), the router's bias and the experts' biases (b1, b3 [E, hidden], b2 [E, dim]: Linears
in another form, split by EP like the weights). Torch-free: the family's `memory_dims` builds
GptOssDims from its args.

Activations are the MoE family's terms: the sink attention's S x S fp32 scores, which SDPA's
kernels do not hold, are not counted yet (docs/models.md says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan_amp.memory.moe import MoEDims
from torchtitan_amp.memory.specs import ParamSpec, Stage


@dataclass(frozen=True)
class GptOssDims(MoEDims):
    """MoEDims with gpt-oss's biases and sinks."""

    @classmethod
    def from_args(cls, args: Any) -> GptOssDims:
        """From GptOssModelArgs (the caller has imported the model already)."""
        base = MoEDims.from_args(args)
        return cls(**{f: getattr(base, f) for f in base.__dataclass_fields__})

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        """MoEDims', each block's biases and sinks after its own tensors of the same module."""
        hd, e, h, d = self.head_dim, self.n_routed_experts, self.moe_inter_dim, self.dim
        out: list[ParamSpec] = []
        for spec in super().param_specs(stage):
            out.append(spec)
            i, p = spec.block, f"layers.{spec.block}."
            for proj, rows in (("wq", self.n_heads * hd), ("wk", self.kv_heads * hd), ("wv", self.kv_heads * hd)):
                if spec.name == p + f"attention.{proj}.weight":
                    out.append(ParamSpec(p + f"attention.{proj}.bias", (rows,), "linear", 0, i))
            if spec.name == p + "attention.wo.weight":
                out.append(ParamSpec(p + "attention.wo.bias", (d,), "linear", None, i))
                out.append(ParamSpec(p + "attention.core.sinks", (self.n_heads,), "sinks", 0, i))
            if spec.name == p + "feed_forward.router.weight":
                out.append(ParamSpec(p + "feed_forward.router.bias", (e,), "router", None, i))
            if spec.name == p + "feed_forward.experts.w3":
                shapes = {"b1": (e, h), "b2": (e, d), "b3": (e, h)}
                out += [
                    ParamSpec(p + f"feed_forward.experts.{b}", shapes[b], "linear", None, i, expert=True)
                    for b in ("b1", "b2", "b3")
                ]
        return out

    def active_params(self) -> int:
        """MoEDims', less the biases of the routed experts a token does not go to."""
        unused = self.n_routed_experts - self.top_k
        return super().active_params() - self.moe_layers() * unused * (2 * self.moe_inter_dim + self.dim)
