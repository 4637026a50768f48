"""The gpt-oss family's parameter terms in the memory model (models/gpt_oss/, model.name =
"gpt_oss"): the MoE family's (MoEDims) plus what gpt-oss adds to each block: biases on q, k, v
(split by TP with their rows) and o (replicated), the attention sinks (one fp32 logit per head,
kind "sinks": outside the lower-precision-safe kinds, so fp32 like the router; split by TP with
the heads), the router's bias and the experts' biases (b1, b3 [E, hidden], b2 [E, dim]: Linears
in another form, split by EP like the weights). Torch-free: the family's `memory_dims` builds
GptOssDims from its args.

Activations are the MoE family's terms with the sink attention's in place of SDPA's
(GptOssDims.activation_terms: its S x S fp32 scores, the same on sliding and full layers); equal
to what autograd saves on CPU (tests/test_gpt_oss.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory.llama import saved_kv_width
from torchtitan_amp.memory.moe import MoEDims
from torchtitan_amp.memory.specs import ActivationTerms, Layout, ParamSpec, PrecisionSpec, Stage


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

    def activation_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        """The MoE family's terms, each block's attention the sink attention's (sink_attention_delta)."""
        base = super().activation_terms(prec, layout)
        # The clamped SwiGLU saves 7 [T k, h] tensors to SiLU's 4 (both clamps' inputs, the
        # gate clamped, its sigmoid, their product, up + 1, the output: w2's input), and the
        # experts' biases each row's expert (int64).
        c, k = DTYPE_BYTES[prec.compute], self.top_k
        experts = 3 * c * k * self.moe_inter_dim + 8 * k
        delta = sink_attention_delta(self, prec, layout) + experts
        return dataclasses.replace(
            base,
            layer=base.layer + delta,
            layer_by_index=tuple((i, v + delta) for i, v in base.layer_by_index),
            layer_cpu=0.0,
        )


def sink_attention_delta(model: GptOssDims, prec: PrecisionSpec, layout: Layout) -> float:
    """Bytes per token the sink attention (models/gpt_oss/model.py SinkAttention: eager matmuls
    and softmax in fp32, on every device) saves beyond the SDPA terms Llama's formula counts. Per
    token and block, H heads (H / t under TP) of hd, S = the sequence, T = microbatch tokens:

        q, k, v        4 x 3 x H hd       the fp32 copies the two matmuls save (k and v repeated
                                          to the query heads)
        scores         8 H (S + 1)        [logits, sink] (amax's input) and the softmax's output,
                                          fp32: quadratic in S, and as large on a sliding layer
                                          (the window is a mask on the whole S x S)
        row max        4 H                amax's output
        mask           S^2 / T            the [S, S] bool of allowed keys, shared by the batch
                                          (S per token: [B, 1, S, S] under a document mask)
        wo input       c H hd             the output, in v's dtype, copied to [B, S, H hd]

    in place of SDPA's c (2 H hd + 2 kv') + 4 H (q, k, v, the output, logsumexp) and its
    additive mask (c S under a document mask). No logsumexp; nothing differs on CPU.

    Args:
        model: the model's dimensions (GptOssDims: the MoE family's with gpt-oss's biases and sinks).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    t, h, hd = layout.tp, model.n_heads, model.head_dim
    c = DTYPE_BYTES[prec.compute]
    s = layout.seq_len
    sdpa = c * (2 * h * hd / t + 2 * saved_kv_width(model, prec, layout, "cuda")) + 4 * h / t
    sdpa += c * s if layout.masked else 0.0
    mask = s if layout.masked else s * s / layout.microbatch_tokens
    sink = (12 * h * hd + 8 * h * (s + 1) + 4 * h + c * h * hd) / t + mask
    return sink - sdpa
