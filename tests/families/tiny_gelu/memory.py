"""tiny_gelu's memory terms: Llama's, with a two-matrix MLP (w_in column-wise, w_out row-wise)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory import ActivationTerms, Layout, ModelDims, ParamSpec, PrecisionSpec, Stage


@dataclasses.dataclass(frozen=True)
class GeluDims(ModelDims):
    @classmethod
    def from_args(cls, args: Any) -> GeluDims:
        return cls(args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden, args.vocab_size)

    def layer_params(self) -> int:
        d, kv, f = self.dim, self.kv_dim, self.ffn_hidden
        return 2 * d * d + 2 * d * kv + 2 * d * f + 2 * d

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        d, f = self.dim, self.ffn_hidden
        out = []
        for spec in super().param_specs(stage):
            if ".feed_forward.w1." in spec.name:
                p = spec.name.split("feed_forward.")[0]
                out += [
                    ParamSpec(p + "feed_forward.w_in.weight", (f, d), "linear", 0, spec.block),
                    ParamSpec(p + "feed_forward.w_out.weight", (d, f), "linear", 1, spec.block),
                ]
            elif ".feed_forward." not in spec.name:
                out.append(spec)
        return out

    def activation_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        """Llama's, less what SwiGLU saves beyond a GELU MLP (w3's input and output: the MLP saves
        w_in's output and w_out's input, 2 x c x f / t, against SwiGLU's 4 x c x f / t + w3's input)."""
        terms = super().activation_terms(prec, layout)
        c = DTYPE_BYTES[prec.compute]
        return dataclasses.replace(terms, layer=terms.layer - 2 * c * self.ffn_hidden / layout.tp)
