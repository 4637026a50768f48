"""Llama 3's terms in the memory model: its shapes (ModelDims), its parameters with their TP
sharding (param_specs, as parallelize.apply_tp shards them) and its saved-for-backward bytes per
token (activation_terms). The rest of torchtitan_amp.memory is shared accounting that asks a dims
object for these (`model.param_specs(stage)`, `model.activation_terms(prec, layout)`), so a family
whose blocks differ hands it a ModelDims subclass overriding them (ModelFamily.memory_dims).

It stays in memory/, not models/llama3/: memory/ is torch-free (the planner and config-time
tools use it without torch), and importing anything under models/ imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchtitan_amp.core.rules import DTYPE_BYTES, ffn_hidden_dim, takes_grouped_kv
from torchtitan_amp.memory.specs import ActivationTerms, Layout, ParamSpec, PrecisionSpec, Stage


@dataclass(frozen=True)
class ModelDims:
    """The shapes that matter: a Llama 3 decoder without biases."""

    dim: int
    n_layers: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    vocab_size: int
    # The output projection's weight is the embedding table (enable_weight_tying): one tensor.
    # Keyword-only, so that subclasses' positional fields stay where they are.
    tied: bool = field(default=False, kw_only=True)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_args(cls, args: Any) -> ModelDims:
        """From a `LlamaModelArgs` (or any args with its fields)."""
        return cls(
            args.dim,
            args.n_layers,
            args.n_heads,
            args.kv_heads,
            ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
            args.vocab_size,
            tied=getattr(args, "enable_weight_tying", False),
        )

    def param_specs(self, stage: Stage) -> list[ParamSpec]:
        """This family's parameters of one pipeline stage (a family overrides this)."""
        return param_specs(self, stage)

    def activation_terms(self, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
        """This family's saved-for-backward bytes per token (a family overrides this)."""
        return activation_terms(self, prec, layout)

    def tp_regions(self, layer: int) -> tuple[str, ...]:
        """TP regions of one block, in forward order (a family overrides this; memory.tp_comm
        prices each kind): Llama's are both "split", a colwise-sharded entry and a rowwise-sharded
        exit (attention's wq/wk/wv -> wo, the MLP's w1/w3 -> w2)."""
        return ("split", "split")

    def cp_gathers_per_block(self, tp: int) -> tuple[int, ...]:
        """Elements per token of each tensor one block all-gathers over the cp ranks (a family
        overrides this; memory.cp_comm): Llama's keys and values after rotary, kv_heads / tp heads
        each, gathered before GQA repeats them, so grouped-query attention sends kv_heads, not
        n_heads."""
        return (self.kv_dim // tp,) * 2

    def ep_comm(self, prec: PrecisionSpec, layout: Layout, stages: list[Stage]) -> dict[str, dict[str, int]]:
        """Expert-parallel traffic of these stages (a family with routed experts overrides this).

        Args:
            prec: the precision settings: the path, the storage, param, reduce and matmul dtypes,
                and which parameter kinds compute in lower precision.
            layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the
                batch and sequence, the pipeline schedule and activation checkpointing.
            stages: the pipeline stages this rank holds (rank_stages), whose MoE layers exchange
                tokens.
        """
        return {}

    def active_params(self) -> int:
        """Parameters one token's forward uses (a family with routed experts overrides this)."""
        return self.total_params()

    def layer_params(self) -> int:
        d, kv, f = self.dim, self.kv_dim, self.ffn_hidden
        return 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d

    def total_params(self) -> int:
        tables = 1 if self.tied else 2  # embedding and output projection
        return self.n_layers * self.layer_params() + tables * self.vocab_size * self.dim + self.dim

    def matmul_params(self) -> int:
        """The N of the 6N FLOP rule (models.count_params(exclude_embedding=True)): every parameter
        but an embedding table that only serves lookups; a tied table is the output's matmul."""
        return self.total_params() - (0 if self.tied else self.vocab_size * self.dim)


def param_specs(model: ModelDims, stage: Stage) -> list[ParamSpec]:
    """Parameters of one pipeline stage with their TP sharding (parallelize.apply_tp):
    q/k/v, w1/w3 and the output head column-wise (dim 0), wo/w2 row-wise (dim 1), the embedding
    row-wise (vocab rows, dim 0), norms replicated. A tied table is one "linear" parameter: it takes
    the output projection's precision (precision.by_name.align_tied_modules), on the first stage (PP
    refuses tying)."""
    d, kv, f, v = model.dim, model.kv_dim, model.ffn_hidden, model.vocab_size
    hq = model.n_heads * model.head_dim
    out: list[ParamSpec] = []
    if stage.first:
        out.append(ParamSpec("tok_embeddings.weight", (v, d), "linear" if model.tied else "embedding", 0, None))
    for i in stage.layers:
        p = f"layers.{i}."
        out += [
            ParamSpec(p + "attention_norm.weight", (d,), "norm", None, i),
            ParamSpec(p + "attention.wq.weight", (hq, d), "linear", 0, i),
            ParamSpec(p + "attention.wk.weight", (kv, d), "linear", 0, i),
            ParamSpec(p + "attention.wv.weight", (kv, d), "linear", 0, i),
            ParamSpec(p + "attention.wo.weight", (d, hq), "linear", 1, i),
            ParamSpec(p + "ffn_norm.weight", (d,), "norm", None, i),
            ParamSpec(p + "feed_forward.w1.weight", (f, d), "linear", 0, i),
            ParamSpec(p + "feed_forward.w2.weight", (d, f), "linear", 1, i),
            ParamSpec(p + "feed_forward.w3.weight", (f, d), "linear", 0, i),
        ]
    if stage.last:
        out.append(ParamSpec("norm.weight", (d,), "norm", None, None))
        if not model.tied:
            out.append(ParamSpec("output.weight", (v, d), "linear", 0, None))
    return out


def activation_terms(model: ModelDims, prec: PrecisionSpec, layout: Layout) -> ActivationTerms:
    """Saved-for-backward bytes per token, the Megatron-LM estimate (Korthikanti et al. 2022,
    s*b*h*(34 + 5*a*s/h) in 16-bit) redone for this Llama block; equal to the bytes autograd saves
    in a real forward pass on CPU (tests/test_dry_run.py; the FSDP-path and TP variants follow
    from the same tensors with other dtypes and shards):

        norms      2 x (8d + 4) / sp        RMSNorm upcasts: fp32 input, fp32 normalized x, rstd
        linear in  (k_attn + k_ffn) x c x d   q/k/v and w1/w3 inputs; the whole sequence (DTensor
                                            keeps the all-gathered input under sequence parallel);
                                            k = 3 and 2 separate casts under autocast, else 1
        attention  c x (2hq / t + 2kv') + 4H / t
                                            SDPA's q, k, v (kv' = kv / t where the kernel takes
                                            grouped heads or repeat_kv is a view, else hq / t:
                                            saved_kv_width), its output (also wo's input) and
                                            logsumexp: fused attention, no s^2 term; rotary saves
                                            only its [s, head_dim/2] tables
        MLP        4 x c x f / t            w1 out, silu out, w3 out, w2 in
    with d = dim, hq = H x head_dim (d for Llama), kv = kv_heads x head_dim, f = ffn hidden,
    H = heads, t = TP degree, sp = t under sequence parallel (else 1), c = bytes of the matmul
    dtype (bf16: 2, fp32: 4). `layer` sizes a GPU (CUDA's kernels); `layer_cpu` is what CPU's
    attention saves beyond it: its causal masks (cp_causal_terms) and, where CUDA repeats K/V and
    CPU does not or the other way round (saved_kv_width), the difference. Full AC keeps only each
    block's input (r x d / sp, r = bytes of the residual dtype) and recomputes one block at a time
    in backward. Op-level SAC keeps the block's input, SDPA's output and logsumexp and the kept
    matmul outputs (saved_mm: all, or the 1st, 3rd... of q, k, v, wo, w1, w3, w2), and likewise
    recomputes one block at a time.

    Context parallel (cp ranks, each holding S / cp tokens of a window of S): every term is per
    token of this rank except what does not shrink with cp. SDPA saves the keys and values of the
    whole window, gathered over cp (the k, v term above x cp per local token); causal CP's chunked
    attention adds `cp_causal_terms`. block_causal, with or without CP: SDPA converts the explicit
    bool mask to an additive one in the query's dtype inside every call and saves it, c x S per
    query token per layer, quadratic in S (measured on CPU, torch 2.13; CUDA's efficient kernel
    does the same). Once per stage (`stage`): that bool mask itself, S bytes per query token,
    alive through the forward and kept by activation checkpointing for the recompute, and under
    cp the rotary tables picked per token (cos, sin: 2 x 4 x head_dim / 2).

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    d, f, h = model.dim, model.ffn_hidden, model.n_heads
    t = layout.tp
    sp = t if layout.sp else 1
    c = DTYPE_BYTES[prec.compute]
    r = DTYPE_BYTES[prec.residual]
    autocast_casts = prec.path == "autocast" and prec.compute != prec.residual
    k_attn, k_ffn = (3, 2) if autocast_casts else (1, 1)
    hq = model.n_heads * model.head_dim  # d, unless a family sets head_dim itself
    kv_saved = saved_kv_width(model, prec, layout, "cuda")
    norm = (8 * d + 4) / sp
    cp, window = layout.cp, layout.seq_len
    mask = c * window if layout.masked else 0.0
    chunked, cpu_mask = cp_causal_terms(model, prec, layout)
    layer_cpu = cpu_mask + 2 * c * cp * (saved_kv_width(model, prec, layout, "cpu") - kv_saved)
    layer = (
        2 * norm
        + (k_attn + k_ffn) * c * d
        + c * (2 * hq / t + 2 * kv_saved * cp)
        + 4 * h / t
        + mask
        + 4 * c * f / t
        + chunked
    )
    checkpointed = r * d / sp
    op_sac = (
        checkpointed
        + saved_mm(attention_mm(model, layout) + mlp_mm(model, layout), layout) * c
        + attention_sdpa_op_sac(model, prec, layout)
    )
    lp = t if (t > 1 and layout.loss_parallel) else 1
    out_b = DTYPE_BYTES[prec.output]
    # Final norm, the head's input, then logits in matmul dtype, cast to output dtype, and
    # cross-entropy's fp32 log-softmax (a live-tensor estimate at the loss, not checked).
    head = norm + c * d + (c + out_b + 4) * model.vocab_size / lp
    stage = (window if layout.masked else 0.0) + (4 * model.head_dim if cp > 1 else 0.0)
    return ActivationTerms(layer, checkpointed, op_sac, head, 8.0, stage, layer_cpu)


def saved_kv_width(model: ModelDims, prec: PrecisionSpec, layout: Layout, device: str) -> float:
    """Elements per token of each of the keys and values SDPA saves on `device`: the local kv
    heads where its kernel takes them grouped (rules.takes_grouped_kv), else repeat_kv's copy to
    the local query heads, unless that reshape is a view: no repetition, or a single kv head on
    this rank (e.g. 8 kv heads over TP 8).

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
        device: "cuda" or "cpu": whose SDPA kernel decides whether grouped kv heads are taken as
            they are.
    """
    t = layout.tp
    local_kv_heads = max(model.kv_heads // t, 1)
    mask = "mask" if layout.masked else "causal"
    grouped = takes_grouped_kv(device, prec.compute, model.head_dim, mask)
    if model.n_heads == model.kv_heads or local_kv_heads == 1 or grouped:
        return local_kv_heads * model.head_dim
    return model.n_heads * model.head_dim / t


def saved_mm(widths: list[float], layout: Layout) -> float:
    """Elements per token op-level SAC keeps of one checkpointed region's matmul outputs, given
    their widths in call order (parallelize._op_sac_policy): every one, or ("alternate",
    torchtitan's rule) the 1st, 3rd, 5th..."""
    return sum(widths if layout.op_sac_save_mm == "all" else widths[::2])


def attention_mm(model: ModelDims, layout: Layout) -> list[float]:
    """The attention's matmul output widths in call order: q, k, v (local heads) and wo (the
    whole width: TP's partial sums before the reduction)."""
    t, hq = layout.tp, model.n_heads * model.head_dim
    return [hq / t, model.kv_dim / t, model.kv_dim / t, model.dim]


def mlp_mm(model: ModelDims, layout: Layout) -> list[float]:
    """The dense MLP's: w1, w3, w2."""
    return [model.ffn_hidden / layout.tp, model.ffn_hidden / layout.tp, model.dim]


def attention_sdpa_op_sac(model: ModelDims, prec: PrecisionSpec, layout: Layout) -> float:
    """What op-level SAC keeps of attention beyond matmuls: SDPA's output and logsumexp. A
    llama block is one checkpointed region (parallelize._wrap_block): its input, these and the
    kept matmul outputs are its bytes, equal to what a real forward keeps alive on CPU
    (tests/test_memory_moe.py); its norms, rotary and residual adds are recomputed.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    t, c = layout.tp, DTYPE_BYTES[prec.compute]
    return (c * model.n_heads * model.head_dim + 4 * model.n_heads) / t


def cp_causal_terms(model: ModelDims, prec: PrecisionSpec, layout: Layout) -> tuple[float, float]:
    """(per layer on every device, per layer on CPU only) in bytes per token, of causal attention
    under CP (context_parallel.ContextParallel.causal_attention); zero otherwise.

    Every device: each of the rank's two query chunks (n = S / (2 cp) queries) gets its own SDPA
    call, so the concatenated output that wo reads is a copy beside the chunk outputs SDPA saves
    (c x d / t more). The index that puts the gathered keys and values in window order is built
    once per shape and kept (context_parallel._WINDOW_ORDER): saved by reference, it adds nothing.

    CPU only: the lower-right causal bias costs no tensor on CUDA (flash and efficient kernels
    take it as a flag; not checked on a GPU), but CPU's SDPA builds it as an [n, end] mask in the
    query's dtype per chunk (end = the chunk's last position + 1), shared by the batch and heads:
    c x n x (sum of ends) per microbatch, counted for a rank r > 0 (chunks r and 2cp-1-r: ends sum
    to (2cp + 1) n); rank 0's first chunk is square, plain is_causal with no mask, c x n^2 less.

    Args:
        model: the model's dimensions (the family's ModelDims: Llama's, or MoEDims with the
            experts).
        prec: the precision settings: the path, the storage, param, reduce and matmul dtypes, and
            which parameter kinds compute in lower precision.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    cp = layout.cp
    if cp == 1 or layout.masked:
        return 0.0, 0.0
    c = DTYPE_BYTES[prec.compute]
    n = layout.seq_len // (2 * cp)
    every = c * model.n_heads * model.head_dim / layout.tp
    return every, c * n * (2 * cp + 1) * n / layout.microbatch_tokens
