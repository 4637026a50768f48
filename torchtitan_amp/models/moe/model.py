"""The mixture-of-experts family's model: Llama 3's decoder (attention, rotary tables, RMSNorm,
init, the decoder shape) with MoE layers in place of the MLP after the first `n_dense_layers`
blocks, in the Qwen3-MoE / DeepSeek-V3 style (moe.py has the layer, balance.py the load
balancing that runs between steps).

Qwen3's per-head query/key RMSNorm (`qk_norm`) and an explicit `head_dim` (Qwen3-30B-A3B: 32 heads
of 128 on a 2048-wide stream) are options of the args, so published Qwen3-MoE shapes fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchtitan_amp.models.llama3.model import (
    Attention,
    FeedForward,
    LlamaModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    ffn_hidden_dim,
)
from torchtitan_amp.models.llama3.model import flops_per_token as llama_flops_per_token
from torchtitan_amp.models.moe.moe import MoE

SCORE_FUNCS = ("softmax", "sigmoid")
LOAD_BALANCE = ("bias", "aux_loss", "bias_and_aux_loss", "none")


@dataclass
class MoEModelArgs(LlamaModelArgs):
    n_routed_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0  # a shared SwiGLU of n_shared x moe_inter_dim, seen by every token
    moe_inter_dim: int = 256  # one expert's hidden width
    n_dense_layers: int = 0  # the first blocks keep a dense MLP (DeepSeek's first_k_dense_replace)
    dense_inter_dim: int | None = None  # their width (None: Llama's formula)
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    route_norm: bool = False  # renormalise the top-k scores to sum to 1 (Qwen3's norm_topk_prob)
    route_scale: float = 1.0
    load_balance: str = "bias"  # "bias" (auxiliary-loss-free), "aux_loss", both, or "none"
    bias_update_speed: float = 1e-3  # DeepSeek-V3's gamma
    aux_loss_alpha: float = 1e-3  # the sequence-wise balance loss's weight
    qk_norm: bool = False
    explicit_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.explicit_head_dim is None:
            super().__post_init__()
        elif self.explicit_head_dim % 2:
            raise ValueError(f"head dim {self.explicit_head_dim} must be even for rope")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.kv_heads}")
        if not 1 <= self.top_k <= self.n_routed_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, n_routed_experts = {self.n_routed_experts}]")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func {self.score_func!r} must be one of {', '.join(SCORE_FUNCS)}")
        if self.load_balance not in LOAD_BALANCE:
            raise ValueError(f"load_balance {self.load_balance!r} must be one of {', '.join(LOAD_BALANCE)}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def dense_hidden(self) -> int:
        """The dense blocks' MLP width: dense_inter_dim, else Llama's formula."""
        return self.dense_inter_dim or ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers


class QKNormAttention(Attention):
    """Llama's attention with Qwen3's RMSNorm over each query and key head before rotary (the
    Qwen3-MoE blocks here, the dense Qwen3 family's in models/qwen3/)."""

    def __init__(self, args: LlamaModelArgs) -> None:
        super().__init__(args)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def normalize_qk(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(xq), self.k_norm(xk)


def moe_layer(args: MoEModelArgs, **variant: Any) -> MoE:
    """The MoE layer the args describe; `variant` passes a family's own routing or experts to MoE
    (DeepSeek-V3's expert groups, gpt-oss's biases and activation)."""
    return MoE(
        args.dim,
        args.moe_inter_dim,
        args.n_routed_experts,
        args.top_k,
        args.n_shared_experts,
        args.score_func,
        args.route_norm,
        args.route_scale,
        args.load_balance,
        args.aux_loss_alpha,
        args.bias_update_speed,
        **variant,
    )


class MoEBlock(TransformerBlock):
    def __init__(self, layer_id: int, args: MoEModelArgs) -> None:
        super().__init__(layer_id, args)
        if args.qk_norm:
            self.attention = QKNormAttention(args)
        if args.is_moe_layer(layer_id):
            self.feed_forward = moe_layer(args)

    @staticmethod
    def build_feed_forward(args: MoEModelArgs) -> nn.Module:  # type: ignore[override]
        return FeedForward(args.dim, args.dense_hidden)


class MoETransformer(Transformer):
    block_cls = MoEBlock


_DEBUG = MoEModelArgs(
    dim=64,
    n_layers=4,
    n_heads=2,
    vocab_size=258,
    max_seq_len=2048,
    use_scaled_rope=False,
    n_routed_experts=8,
    top_k=2,
    n_shared_experts=1,
    moe_inter_dim=64,
    n_dense_layers=1,
)

MOE_FLAVORS: dict[str, MoEModelArgs] = {
    # ~0.6M parameters, ~0.3M active: 8 experts of width 64, top 2, one shared expert, the first
    # block dense; TP 2 still splits its 2 heads, PP 2 gets 2 blocks per stage.
    "debugmodel_moe": _DEBUG,
    # The same with DeepSeek-V3's routing: sigmoid scores, renormalised top-k, bias balancing.
    "debugmodel_moe_sigmoid": dataclasses.replace(_DEBUG, score_func="sigmoid", route_norm=True),
    # The same balanced by DeepSeek-V3's sequence-wise auxiliary loss alone (no expert bias), with
    # a weight large enough for its gradient to show next to the language-model loss's.
    "debugmodel_moe_aux": dataclasses.replace(_DEBUG, load_balance="aux_loss", aux_loss_alpha=1e-2),
    # Qwen3's shape in small: QK-norm, GQA (4 heads, 2 kv heads), an explicit head_dim (4 x 24 on a
    # 64-wide stream), no shared expert, renormalised top-k, every block MoE.
    "debugmodel_qwen3": dataclasses.replace(
        _DEBUG,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=24,
        qk_norm=True,
        n_shared_experts=0,
        n_dense_layers=0,
        route_norm=True,
    ),
    # Qwen3-30B-A3B (transformers' Qwen3MoeConfig of the published model): 48 layers, 128 experts
    # top 8, no shared expert, QK-norm, head_dim 128; trained with an aux loss (coef 1e-3).
    "qwen3_30b_a3b": MoEModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        explicit_head_dim=128,
        vocab_size=151936,
        max_seq_len=40960,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        use_scaled_rope=False,
        n_routed_experts=128,
        top_k=8,
        moe_inter_dim=768,
        route_norm=True,
        qk_norm=True,
        load_balance="aux_loss",
        aux_loss_alpha=1e-3,
    ),
    # A DeepSeek-V3-16B-like size on the Llama backbone (GQA instead of MLA): 27 layers, the first
    # dense (10944 wide), 64 routed experts top 6 plus 2 shared, sigmoid scores with bias balancing.
    "moe_16b_gqa": MoEModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        max_seq_len=4096,
        rope_theta=10000.0,
        use_scaled_rope=False,
        n_routed_experts=64,
        top_k=6,
        n_shared_experts=2,
        moe_inter_dim=1408,
        n_dense_layers=1,
        dense_inter_dim=10944,
        score_func="sigmoid",
        route_norm=True,
        route_scale=1.0,
    ),
}


def active_params(args: MoEModelArgs, total_excl_embedding: int) -> int:
    """Parameters a token's forward uses (embeddings excluded): the routed experts count top_k of
    n_routed_experts per MoE layer."""
    per_expert = 3 * args.dim * args.moe_inter_dim
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return total_excl_embedding - moe_layers * (args.n_routed_experts - args.top_k) * per_expert


def flops_per_token(args: MoEModelArgs, num_params_excl_embedding: int, seq_len: int) -> int:
    """Llama's count (6N plus attention) with N the active parameters: only the chosen experts' FLOPs.

    Args:
        args: the MoE model's arguments (experts, top_k, their hidden size).
        num_params_excl_embedding: the parameters without the embedding table (N).
        seq_len: the training sequence length (the attention term grows with it).
    """
    return llama_flops_per_token(args, active_params(args, num_params_excl_embedding), seq_len)
