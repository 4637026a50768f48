"""DeepSeek-V3's multi-head latent attention (MLA) and its YaRN rotary tables.

Queries come from a low-rank projection (wq_a, its RMSNorm q_norm, wq_b; or one wq when
q_lora_rank is 0); keys and values from one shared latent (wkv_a -> kv_lora_rank, RMSNorm
kv_norm, wkv_b -> per head qk_nope_head_dim key and v_head_dim value), plus a decoupled rotary
key of qk_rope_head_dim that every head shares. Each head's query and key are their no-position
part followed by the rotated part; the softmax scale is 1/sqrt(qk_nope + qk_rope), times YaRN's
mscale(factor, mscale_all_dim)^2 when the tables are YaRN-scaled (DeepSeek's and transformers'
correction). Rotary rotates interleaved pairs (x[2i], x[2i+1]): transformers' `rope_interleave`
layout, in which the published weights are stored, so no rows are permuted on import.

Precision: the latent norms are the framework's RMSNorm (fp32 inside, `computes_in_fp32`), the
rotary tables are fp32 buffers and the rotation computes in fp32 (llama3.model._rotate).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_amp.distributed.context_parallel import ContextParallel
from torchtitan_amp.models.attention import FlexMasks, flex_attend
from torchtitan_amp.models.kv_cache import KVCache
from torchtitan_amp.models.llama3.model import RMSNorm, apply_rotary_emb

# transformers' DeepseekV3RMSNorm default: the latent norms do not take rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale 0.1 * mscale * ln(factor) + 1 (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(
    dim: int, theta: float, factor: float, original_len: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN's inverse frequencies [dim // 2] (transformers' _compute_yarn_parameters, truncated
    correction range): interpolated by `factor` below the slow boundary, kept above the fast one,
    a linear ramp between.

    Args:
        dim: the rotated head size (qk_rope_head_dim).
        theta: the rotary base.
        factor: the context-extension factor (1: the plain rotary frequencies).
        original_len: the context the model was pretrained on (original_max_position_embeddings).
        beta_fast: rotations per original context above which a frequency is kept.
        beta_slow: rotations below which it is interpolated.
    """
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if factor <= 1:
        return freqs

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


def yarn_tables(args: Any, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, qk_rope_head_dim // 2] in fp32, times YaRN's attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for DeepSeek-V3's config)."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    # As Llama's precompute_rope: an enclosing autocast must not round the angles (meta has none).
    if torch.amp.is_autocast_available(device.type):
        with torch.autocast(device.type, enabled=False):
            return _yarn_tables(args, device)
    return _yarn_tables(args, device)


def _yarn_tables(args: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = yarn_inv_freq(
        args.qk_rope_head_dim,
        args.rope_theta,
        args.rope_factor,
        args.rope_original_seq_len,
        args.beta_fast,
        args.beta_slow,
    ).to(device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float32), freqs)
    if args.mscale and args.mscale_all_dim:
        factor = yarn_mscale(args.rope_factor, args.mscale) / yarn_mscale(args.rope_factor, args.mscale_all_dim)
    else:
        factor = yarn_mscale(args.rope_factor)
    cos, sin = angles.cos(), angles.sin()
    return (cos * factor, sin * factor) if factor != 1.0 else (cos, sin)


def softmax_scale(args: Any) -> float:
    """1/sqrt(qk head dim), with YaRN's mscale_all_dim correction squared (transformers'
    yarn_apply_mscale)."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    if args.rope_factor > 1 and args.mscale_all_dim:
        scale *= yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2
    return scale


class MLAttention(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2/V3), training form (keys and values
    expanded from the latent, not absorbed into the queries)."""

    # Set by parallelize.apply_cp and generation.kv_caches, as on Llama's Attention.
    context_parallel: ContextParallel | None = None
    kv_cache: KVCache | None = None

    def __init__(self, args: Any) -> None:
        super().__init__()
        self.nope, self.rope, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        qk_dim = self.nope + self.rope
        if args.q_lora_rank:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(args.kv_lora_rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # The kernels' default scale is 1/sqrt(qk_dim); the queries carry the rest (1.0: none).
        self.q_scale = softmax_scale(args) * qk_dim**0.5

    def init_weights(self, init_std: float) -> None:
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            if hasattr(self, name):
                nn.init.trunc_normal_(getattr(self, name).weight, mean=0.0, std=0.02)
        for norm in ("q_norm", "kv_norm"):
            if hasattr(self, norm):
                getattr(self, norm).reset_parameters()
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | FlexMasks | None = None
    ) -> torch.Tensor:
        """Attention's output [B, S, dim], as Llama's Attention.forward (same arguments).

        Args:
            x: the block's normalised input [B, S, dim].
            cos: the rotary cosine table [max_seq_len, qk_rope_head_dim // 2], or picked per token
                [B, S, qk_rope_head_dim // 2] under context parallel.
            sin: the rotary sine table, shaped as `cos`.
            mask: None (causal) or [B, 1, S, Sk] bool, True where a query may attend a key;
                FlexMasks on the flex backend (values narrower than queries and keys: flex takes them).
        """
        bs, seqlen, _ = x.shape
        q = self._queries(x).view(bs, seqlen, -1, self.nope + self.rope)
        heads = q.shape[2]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        cache = self.kv_cache
        if cache is not None:
            cos, sin = cache.rotary_rows(cos, sin)
        q_pe, k_pe = apply_rotary_emb(q_pe, k_pe.unsqueeze(2), cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat([k_nope, k_pe.expand(-1, -1, heads, -1)], dim=-1)
        if cache is not None:
            k, v = cache.update(k, v)
        cp = self.context_parallel
        if cp is not None:
            k, v = cp.gather_kv(k), cp.gather_kv(v)
            if mask is None:
                k, v = cp.to_window_order(k), cp.to_window_order(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if isinstance(mask, FlexMasks):
            out = flex_attend(q, k, v, mask)
        elif cache is not None:
            out = cache.attend(q, k, v)
        elif cp is not None and mask is None:
            out = cp.causal_attention(q, k, v, enable_gqa=False)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
