"""DeepSeek-V3's terms in the memory model: the MoE family's (memory/moe.py) with MLA's
parameters in place of grouped-query attention's. Parameters are exact (tests/test_deepseek_v3.py
compares the count with the model's); activations are the MoE family's with MLA's attention in
place of grouped-query attention's (MLADims.activation_terms: the latents and their norms, the
narrower values; equal to what autograd saves on CPU, tests/test_deepseek_v3.py).
Multi-token prediction's modules (mtp_depth) are parameters of the last stage, exact too (each
depth's block is the model's layer n_layers + k - 1, routed or dense as that layer would be); their
activations (each depth's block, norms, projection input and its own logits and loss) are part of
the last stage's `head` term (MLADims.mtp_bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory.llama import cp_causal_terms, saved_kv_width
from torchtitan_amp.memory.moe import MoEDims
from torchtitan_amp.memory.specs import ActivationTerms, Layout, ParamSpec, PrecisionSpec, Stage

_GQA = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight")


@dataclass(frozen=True)
class MLADims(MoEDims):
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mtp_depth: int = 0
    n_group: int = 1
    topk_group: int = 1

    @classmethod
    def from_args(cls, args: Any) -> MLADims:
        """From DeepSeekV3Args: the MoE family's fields, the qk head size as the head size."""
        base = MoEDims.from_args(args)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(MoEDims)}
        fields["explicit_head_dim"] = args.qk_nope_head_dim + args.qk_rope_head_dim
        return cls(
            **fields,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            mtp_depth=args.mtp_depth,
            n_group=args.n_group,
            topk_group=args.topk_group,
        )

    def moe_layers(self) -> int:
        """The routed blocks, the multi-token prediction modules' included (active_params drops
        their unused experts as the layers')."""
        return sum(self.is_moe(i) for i in range(self.n_layers + self.mtp_depth))

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        """The decoder's (`_decoder_specs`) and, on the last stage, each multi-token prediction
        module's: its block as layer n_layers + k - 1 is, renamed under `mtp.{that}.block.`, with its
        two input norms and its output norm (replicated) and its 2 dim -> dim projection (split by
        its input under TP)."""
        out = self._decoder_specs(stage)
        if not (stage.last and self.mtp_depth):
            return out
        d, ids = self.dim, range(self.n_layers, self.n_layers + self.mtp_depth)
        blocks = self._decoder_specs(Stage(stage.index, ids, False, False))
        for i in ids:
            p = f"mtp.{i}."
            out += [ParamSpec(p + n, (d,), "norm", None, i) for n in ("enorm.weight", "hnorm.weight")]
            out.append(ParamSpec(p + "eh_proj.weight", (d, 2 * d), "linear", 1, i))  # row-wise under TP
            block = [s for s in blocks if s.block == i]
            out += [dataclasses.replace(s, name=s.name.replace(f"layers.{i}.", p + "block.", 1)) for s in block]
            out.append(ParamSpec(p + "norm.weight", (d,), "norm", None, i))
        return out

    def _decoder_specs(self, stage: Stage) -> list[ParamSpec]:
        """The MoE family's, MLA's projections and latent norms in place of wq / wk / wv / wo
        (wq_b, wkv_b split by head and wo by its input under TP's usual rule; the latent
        projections and norms replicated)."""
        d, h, qk = self.dim, self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        out: list[ParamSpec] = []
        for spec in super().param_specs(stage):
            if not spec.name.endswith(_GQA):
                out.append(spec)
                continue
            if not spec.name.endswith("attention.wo.weight"):
                continue
            p, i = spec.name.removesuffix("wo.weight"), spec.block
            if self.q_lora_rank:
                r = self.q_lora_rank
                out += [
                    ParamSpec(p + "wq_a.weight", (r, d), "linear", None, i),
                    ParamSpec(p + "q_norm.weight", (r,), "norm", None, i),
                    ParamSpec(p + "wq_b.weight", (h * qk, r), "linear", 0, i),
                ]
            else:
                out.append(ParamSpec(p + "wq.weight", (h * qk, d), "linear", 0, i))
            kv = self.kv_lora_rank
            out += [
                ParamSpec(p + "wkv_a.weight", (kv + self.qk_rope_head_dim, d), "linear", None, i),
                ParamSpec(p + "kv_norm.weight", (kv,), "norm", None, i),
                ParamSpec(p + "wkv_b.weight", (h * (self.qk_nope_head_dim + self.v_head_dim), kv), "linear", 0, i),
                ParamSpec(p + "wo.weight", (d, h * self.v_head_dim), "linear", 1, i),
            ]
        return out

    def activation_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        """The MoE family's terms, each block's attention MLA's (mla_attention_delta), its MoE
        blocks' routing group-limited; the last stage's `head` with the multi-token prediction
        depths' bytes (mtp_bytes)."""
        terms = self._block_terms(prec, layout)
        return dataclasses.replace(terms, head=terms.head + self.mtp_bytes(prec, layout))

    def mtp_bytes(self, prec: PrecisionSpec, layout: Layout) -> float:
        """Saved-for-backward bytes per token of the microbatch of the multi-token prediction
        depths (0 without): depth k runs on S - k of the S positions, each saving its block's
        bytes (as layer n_layers + k - 1 on a window of S - k, without sequence parallel: under TP
        the depth's positions are replicated; counted whole under AC too, an upper bound) and,
        with d = dim, V = vocab_size, c / r the matmul / residual bytes, t the TP degree:

            enorm, hnorm   2 (4d + 4)      each norm's normalised x and rstd (its input is the
                           + 2 x 4d if r < 4   embedding's / last block's output, saved already;
                                           a bf16 residual adds each norm's fp32 copy)
            eh_proj        2 c d / t       its input, the two norms' outputs concatenated (each
                                           TP rank's slice: row-wise)
            norm, head     8d + 4 + c d    the output norm (Llama's) and the head's input
            loss           4V / t' + 8     cross-entropy's fp32 log-softmax (t' = t under loss
                                           parallel, else 1) and its int64 targets (the bf16
                                           logits' fp32 copy is what it saves)

        Equal to what autograd saves on CPU with a dense depth, fp32 and bf16 autocast
        (tests/test_deepseek_v3_mtp.py; CPU's attention adds `layer_cpu` there, as for a layer)."""
        d, c, r, t = self.dim, DTYPE_BYTES[prec.compute], DTYPE_BYTES[prec.residual], layout.tp
        vocab = self.vocab_size / (t if layout.loss_parallel else 1)
        extra = 2 * (4 * d + 4) + (8 * d if r < 4 else 0) + 2 * c * d / t + 8 * d + 4 + c * d + 4 * vocab + 8
        total, s = 0.0, layout.seq_len
        for k in range(1, self.mtp_depth + 1):
            window = dataclasses.replace(layout, seq_len=s - k, sequence_parallel=False)
            block = self._block_terms(prec, window).layer_at(self.n_layers + k - 1)
            total += (s - k) / s * (block + extra)
        return total

    def _block_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        """activation_terms without the multi-token prediction depths."""
        base = super().activation_terms(prec, layout)
        gpu, cpu = mla_attention_delta(self, prec, layout)
        # Group-limited routing saves each group's two best ids (int64), the chosen groups' ids
        # (int64) and the [T, groups] bool of the groups left out.
        groups = 17 * self.n_group + 8 * self.topk_group if self.n_group > 1 else 0
        return dataclasses.replace(
            base,
            layer=base.layer + gpu + groups,
            layer_by_index=tuple((i, v + gpu) for i, v in base.layer_by_index),
            layer_cpu=cpu,
        )


def mla_attention_delta(model: MLADims, prec: PrecisionSpec, layout: Layout) -> tuple[float, float]:
    """(bytes per token MLA's attention saves beyond the grouped-query attention Llama's terms
    count for H heads of the qk head size, what CPU saves beyond a GPU), per block. With
    qk = qk_nope + qk_rope, v = v_head_dim, rq / rkv = the q / kv latent ranks, H heads (H / t
    under TP), c / r bytes of the matmul / residual dtype:

        latent inputs  k x c x d          wq_a (or wq) and wkv_a read the normalised x: one tensor,
                                          or 2 separate casts under autocast (k = 2, Llama's 3)
        q latent       (8 rq + 4) + c rq  q_norm's fp32 input, normalised x and rstd; wq_b's input
        kv latent      4 rkv' + 4 rkv + 4 + c rkv
                                          kv_norm's likewise: its fp32 input is a slice of wkv_a's
                                          output, whose storage (rkv + qk_rope wide) it keeps
                                          whole when that output is fp32 (rkv' = rkv + qk_rope),
                                          a copy of the slice otherwise (rkv' = rkv)
        SDPA (GPU)     c (2 H qk + H (qk_nope + v) + H v) + 4H
                                          q and k (H heads of qk: the rotary key repeated per
                                          head), v (a slice of wkv_b's output: its storage,
                                          H (qk_nope + v) wide), the output (wo's input) and
                                          logsumexp. Flash needs one head size for q, k and v,
                                          so CUDA runs the efficient kernel: no S^2 term
        SDPA (CPU)     4 (2 H qk + H v + H S) + c H v
                                          CPU's flash kernel likewise refuses, its math path
                                          upcasts to fp32 and saves the scaled q and k, the
                                          probabilities [S x S per head] and v; wo's input is a
                                          copy of the output

    Under CP the gathered k and v are copies (c (H qk + H v) x cp per local token) and causal
    CP's chunking adds Llama's cp_causal_terms. The rotary part computes in fp32 and saves only
    the stage's tables.

    Args:
        model: the model's dimensions (MLADims: the MoE family's plus MLA's head sizes and latent ranks).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    t, cp, h = layout.tp, layout.cp, model.n_heads
    c = DTYPE_BYTES[prec.compute]
    casts = prec.path == "autocast" and prec.compute != prec.residual
    qk, v, nope = model.head_dim, model.v_head_dim, model.qk_nope_head_dim
    rq, rkv = model.q_lora_rank, model.kv_lora_rank
    # What Llama's terms count for this attention (activation_terms: linear in, SDPA, CP).
    kv_saved = saved_kv_width(model, prec, layout, "cuda")
    chunked, cpu_mask = cp_causal_terms(model, prec, layout)
    mask = c * layout.seq_len if layout.masked else 0.0
    llama = (3 if casts else 1) * c * model.dim + c * (2 * h * qk / t + 2 * kv_saved * cp) + 4 * h / t
    llama += mask + chunked
    latents = (2 if casts else 1) * c * model.dim
    if rq:
        latents += 8 * rq + 4 + c * rq
    latents += 4 * (rkv + (model.qk_rope_head_dim if c == 4 else 0)) + 4 * rkv + 4 + c * rkv
    kv = (h * qk + h * v) * cp if cp > 1 else h * qk + h * (nope + v)
    gpu = c * (h * qk + kv + h * v) / t + 4 * h / t + mask + chunked
    cpu = 4 * (2 * h * qk + h * v * cp + h * layout.seq_len) / t + c * h * v / t
    return latents + gpu - llama, cpu + mask + chunked + cpu_mask - gpu
