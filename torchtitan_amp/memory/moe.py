"""The mixture-of-experts family's terms in the memory model (models/moe/, model.name = "moe"):
Llama's decoder whose blocks after the first `n_dense_layers` carry a router, E routed SwiGLU
experts and an optional shared expert instead of the dense MLP, optionally with Qwen3's per-head
q/k RMSNorm and a head_dim of its own. Torch-free like the rest of memory/: the family's
`memory_dims` builds MoEDims from its args.

What differs from a dense model, and why it matters for sizing:
- parameters: every expert is held (total), but a token runs through top_k of them (active: the
  FLOPs, models/moe/model.py flops_per_token). The router is not a Linear: outside
  lower_precision_safe_modules, an fp32 FSDP group beside the block's norms. Under expert
  parallel (Layout.ep) each rank keeps E / ep experts of every layer, FSDP-sharded on dim 1 over
  the efsdp = dp_shard x cp / ep ranks in a group of their own (ParamSpec.expert, fsdp_split).
- activations: each token's hidden state goes to top_k experts, so the expert activations scale
  with T x top_k rows, and the combine is summed in fp32 (MoEDims.activation_terms).
- traffic: under EP, per MoE layer, the sorted rows are sent to the experts' ranks and the
  outputs come back by all-to-all, each way in forward and backward (MoEDims.ep_comm); under TP
  an MoE layer gathers the whole sequence and hands back its slice (MoEDims.tp_regions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES
from torchtitan_amp.memory.llama import (
    ModelDims,
    activation_terms,
    attention_mm,
    attention_sdpa_op_sac,
    param_specs,
    saved_mm,
)
from torchtitan_amp.memory.sizes import ByDtype, add_bytes
from torchtitan_amp.memory.specs import ActivationTerms, Layout, ParamSpec, PrecisionSpec, Stage

EXPERT_WEIGHTS = ("w1", "w2", "w3")  # [E, dim, hidden], [E, hidden, dim], [E, dim, hidden]


@dataclass(frozen=True)
class MoEDims(ModelDims):
    """ModelDims plus the MoE shapes; ffn_hidden is the dense blocks' MLP width."""

    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    moe_inter_dim: int = 256
    n_dense_layers: int = 0
    qk_norm: bool = False
    explicit_head_dim: int = 0
    aux_loss: bool = False  # the sequence-wise balance loss is computed in forward
    route_norm: bool = False  # the top-k scores renormalised (their sum divides them)

    @classmethod
    def from_args(cls, args: Any) -> MoEDims:
        """From MoEModelArgs (the caller has imported the model already)."""
        base = ModelDims.from_args(args)
        hidden = args.dense_inter_dim or base.ffn_hidden
        return cls(
            args.dim,
            args.n_layers,
            args.n_heads,
            args.kv_heads,
            hidden,
            args.vocab_size,
            args.n_routed_experts,
            args.top_k,
            args.n_shared_experts,
            args.moe_inter_dim,
            args.n_dense_layers,
            args.qk_norm,
            args.explicit_head_dim or 0,
            args.load_balance in ("aux_loss", "bias_and_aux_loss") and args.aux_loss_alpha > 0,
            bool(getattr(args, "route_norm", False)),
        )

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        """Llama's, with q/k norms after wo and, in MoE blocks, the router (kind "router": never
        lower-precision safe), the routed experts (Linears in another form: kind "linear",
        replicated over TP, split by EP) and the shared expert (split by TP like Llama's MLP)
        in place of the dense MLP."""
        d, hd, h, e = self.dim, self.head_dim, self.moe_inter_dim, self.n_routed_experts
        hs = self.n_shared_experts * h
        out: list[ParamSpec] = []
        for spec in param_specs(self, stage):
            i = spec.block
            if i is not None and self.is_moe(i) and ".feed_forward." in spec.name:
                continue
            out.append(spec)
            p = f"layers.{i}."
            if spec.name.endswith("attention.wo.weight") and self.qk_norm:
                out += [ParamSpec(p + f"attention.{n}_norm.weight", (hd,), "norm", None, i) for n in "qk"]
            if i is not None and spec.name.endswith("ffn_norm.weight") and self.is_moe(i):
                f = p + "feed_forward."
                out.append(ParamSpec(f + "router.weight", (e, d), "router", None, i))
                shapes = {"w1": (e, d, h), "w2": (e, h, d), "w3": (e, d, h)}
                out += [
                    ParamSpec(f + "experts." + w, shapes[w], "linear", None, i, expert=True) for w in EXPERT_WEIGHTS
                ]
                if hs:
                    out += [
                        ParamSpec(f + "shared_expert.w1.weight", (hs, d), "linear", 0, i),
                        ParamSpec(f + "shared_expert.w2.weight", (d, hs), "linear", 1, i),
                        ParamSpec(f + "shared_expert.w3.weight", (hs, d), "linear", 0, i),
                    ]
        return out

    def total_params(self) -> int:
        return sum(_numel(s.shape) for s in self.param_specs(Stage(0, range(self.n_layers), True, True)))

    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    def active_params(self) -> int:
        """Every parameter but the routed experts a token does not go to: top_k of E per MoE layer
        (embeddings included; models.moe.model.active_params counts the same without them)."""
        unused = self.n_routed_experts - self.top_k
        return self.total_params() - self.moe_layers() * unused * 3 * self.dim * self.moe_inter_dim

    def activation_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        return moe_activation_terms(self, prec, layout)

    def tp_regions(self, layer: int) -> tuple[str, ...]:
        """Attention split as Llama's; an MoE layer is one replicated region (models/moe/parallelize.py:
        ReplicatedMoE), with the TP-split shared expert's all-reduce inside when there is one."""
        if not self.is_moe(layer):
            return super().tp_regions(layer)
        return ("split", "replicated_split" if self.n_shared_experts else "replicated")

    def ep_comm(self, prec: PrecisionSpec, layout: Layout, stages: list[Stage]) -> dict[str, ByDtype]:
        """Expert-parallel traffic of these stages: this module's ep_comm (the routed experts' all-
        to-alls).

        Args:
            prec: the precision settings: the path, the storage, param, reduce and matmul dtypes,
                and which parameter kinds compute in lower precision.
            layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the
                batch and sequence, the pipeline schedule and activation checkpointing.
            stages: the pipeline stages this rank holds (rank_stages), whose MoE layers exchange
                tokens.
        """
        return ep_comm(self, prec, layout, stages)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def moe_activation_terms(model: MoEDims, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
    """Llama's terms (memory.activation_terms, with hq = H x head_dim) for attention and the
    dense blocks, plus, per token (T = microbatch tokens, k = top_k, E experts of hidden h,
    c / q = bytes of the matmul / router dtype; equal to what autograd saves on CPU,
    tests/test_memory_moe.py):

        q/k norms     ((8 hq + 4H) + (8 kv + 4 KV)) / t   fp32 upcast like every RMSNorm
        router        q x (d + E)          its input cast to the router dtype, the scores
        routing       24k + 4E / T         top-k ids, each row's token, each slot's row (int64);
                                           the grouped matmul's int32 offsets per microbatch
        routed rows   c x k x d            the sorted copy of the hidden states (experts' input)
        experts       4 x c x k x h        w1 out, silu out, w3 out, w2 in, over T x k rows
        combine       4k + 4 x k x d       the combine weights and the expert outputs in fp32,
                                           in (token, slot) order: their products are summed
                                           slot by slot (nothing saved), then rounded once
        shared expert k_ffn x c x d + 4 x c x n_shared h / t   a Llama MLP (its input is the
                                           router's when both take the hidden states uncast)
        aux loss      4 + 4E / S           the sequence-wise balance loss: the scores' per-token
                                           sum, each sequence's expert fractions [B, E] (fp32)
        route norm    q x (k + 1)          the top-k scores and their sum, which divides them

    in place of the MLP's k_ffn x c x d + 4 c f / t. Under TP the router and routed experts see
    the whole sequence on every rank (not divided by t). Op-level SAC checkpoints an MoE block by
    region and recomputes its feed-forward whole (parallelize.recomputed_whole): moe_op_sac; the
    dense blocks, one region each, keep Llama's.

    Args:
        model: the MoE model's dimensions: Llama's plus the experts, their hidden size, top_k and
            the dense layers.
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    base = activation_terms(model, prec, layout)
    t = layout.tp
    c, q = DTYPE_BYTES[prec.compute], DTYPE_BYTES[prec.router]
    d, k, h, e = model.dim, model.top_k, model.moe_inter_dim, model.n_routed_experts
    k_ffn = 2 if prec.path == "autocast" and prec.compute != prec.residual else 1
    hq, kv = model.n_heads * model.head_dim, model.kv_dim
    qk = ((8 * hq + 4 * model.n_heads) + (8 * kv + 4 * model.kv_heads)) / t if model.qk_norm else 0.0
    dense_mlp = k_ffn * c * d + 4 * c * model.ffn_hidden / t
    routed = (
        q * (d + e)
        + 24 * k
        + 4 * e / layout.microbatch_tokens
        + c * k * d
        + 4 * c * k * h
        + 4 * k
        + 4 * k * d
        + (4 + 4 * e / layout.local_seq_len if model.aux_loss else 0)
        + (q * (k + 1) if model.route_norm else 0)
    )
    shared = k_ffn * c * d + 4 * c * model.n_shared_experts * h / t if model.n_shared_experts else 0.0
    if shared and k_ffn == 1 and prec.residual == prec.router:
        shared -= q * d  # the router's input cast was a no-op: one tensor saved for both
    moe_layer = base.layer + qk - dense_mlp + routed + shared
    dense = tuple((i, base.layer + qk) for i in range(model.n_dense_layers))
    dense_op_sac = tuple((i, base.layer_op_sac) for i in range(model.n_dense_layers))
    return dataclasses.replace(
        base,
        layer=moe_layer,
        layer_by_index=dense,
        layer_op_sac=moe_op_sac(model, prec, layout),
        op_sac_by_index=dense_op_sac,
    )


def moe_op_sac(model: MoEDims, prec: PrecisionSpec, layout: Layout) -> float:
    """An MoE block under op-level SAC, checkpointed by region (parallelize._wrap_block): its
    norms (outside the regions: fp32 input, normalized x, rstd each), both regions' inputs, the
    attention region's kept matmul outputs (its own mm count) and SDPA's; the feed-forward is
    recomputed whole.

    Args:
        model: the MoE model's dimensions: Llama's plus the experts, their hidden size, top_k and
            the dense layers.
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    sp = layout.tp if layout.sp else 1
    c, r = DTYPE_BYTES[prec.compute], DTYPE_BYTES[prec.residual]
    norm = (8 * model.dim + 4) / sp
    return (
        2 * norm
        + 2 * r * model.dim / sp
        + c * saved_mm(attention_mm(model, layout), layout)
        + attention_sdpa_op_sac(model, prec, layout)
    )


def ep_comm(model: MoEDims, prec: PrecisionSpec, layout: Layout, stages: list[Stage]) -> dict[str, ByDtype]:
    """Expert-parallel all-to-all of one rank per optimizer step (expert_parallel.ExpertParallel),
    per MoE layer and forward pass of T tokens (volumes: what the rank sends, its own share
    included):

        token counts  [E] int64, forward only (the split sizes; no gradient; a recompute
                      reuses the forward's)
        dispatch      [T x k, d] in the hidden states' dtype (PrecisionSpec.residual: the block
                      input's), forward; its gradient back in backward
        combine       [T x k, d] in the experts' output dtype (param dtype under mixed
                      precision), forward; its gradient back in backward

    Every row is sent whatever the routing, so the volume is exact; what crosses the network is
    (ep - 1) / ep of it under uniform routing (the planner's assumption: balancing drives the
    loads there, and an unbalanced step sends more to the hot experts' ranks). A recomputed block
    (full or selective AC; op-level SAC too: an all-to-all is not saved) repeats its forward's
    row exchanges, not its count exchange. x microbatches (PP) x gradient-accumulation steps.

    Args:
        model: the MoE model's dimensions: Llama's plus the experts, their hidden size, top_k and
            the dense layers.
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        stages: the pipeline stages this rank holds (rank_stages), whose MoE layers exchange tokens.
    """
    if layout.ep == 1:
        return {}
    rows = layout.microbatch_tokens * model.top_k * model.dim
    dispatch = prec.residual
    combine = prec.param if prec.path == "autocast" else prec.residual
    passes = layout.microbatches * layout.grad_accum
    out: ByDtype = {}
    for stage in stages:
        layers = [i for i in stage.layers if model.is_moe(i)]
        forwards = len(layers) + len([i for i in _recomputed(layout, stage) if model.is_moe(i)])
        add_bytes(out, "int64", passes * len(layers) * model.n_routed_experts * 8)
        for dtype in (dispatch, combine):
            add_bytes(out, dtype, passes * (forwards + len(layers)) * rows * DTYPE_BYTES[dtype])
    return {"ep_all_to_all": out} if out else {}


def _recomputed(layout: Layout, stage: Stage) -> list[int]:
    """Layers of a stage whose forward runs again in backward (memory.recomputed_blocks)."""
    layers = list(stage.layers)
    if layout.ac_mode == "full" or (layout.ac_mode == "selective" and layout.ac_option == "op"):
        return layers
    if layout.ac_mode == "selective":
        return layers[:: int(layout.ac_option)]
    return []
