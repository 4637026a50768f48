"""DeepSeek-V3's model: args, flavors, blocks and FLOP count.

A block is Llama's pre-norm block (attention_norm, attention, ffn_norm, feed_forward) with
multi-head latent attention (mla.py) and, after the first `n_dense_layers` blocks
(first_k_dense_replace), the MoE family's layer (models/moe/moe.py) routing DeepSeek-V3's way:
sigmoid scores, the auxiliary-loss-free expert bias (e_score_correction_bias) moving the choice
only, group-limited choice (n_group, topk_group), top-k renormalised (norm_topk_prob) and scaled
by routed_scaling_factor, plus shared experts. Balancing, expert parallel and the load metrics
are the MoE family's (balance.py, expert_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_amp.models.deepseek_v3.mla import MLAttention, yarn_tables
from torchtitan_amp.models.llama3.model import FeedForward, RMSNorm, Transformer, TransformerBlock
from torchtitan_amp.models.moe.model import LOAD_BALANCE, SCORE_FUNCS, MoEModelArgs
from torchtitan_amp.models.moe.moe import MoE


@dataclass
class DeepSeekV3Args(MoEModelArgs):
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    use_scaled_rope: bool = False  # Llama 3.1's scaling: never here (YaRN below instead)
    score_func: str = "sigmoid"
    route_norm: bool = True
    q_lora_rank: int = 0  # 0: queries projected directly (wq), as DeepSeek-V2-Lite
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_group: int = 1  # expert groups for group-limited routing (1: none)
    topk_group: int = 1  # groups a token may choose from
    # YaRN (rope_scaling type "yarn"); rope_factor 1 is plain rotary embedding.
    rope_factor: float = 1.0
    rope_original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        # Not MoEModelArgs': MLA has no dim / n_heads head size and one latent for all heads.
        checks = (
            (self.n_kv_heads in (None, self.n_heads), f"n_kv_heads {self.n_kv_heads}: MLA has one key/value per head"),
            (self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rope"),
            (1 <= self.top_k <= self.n_routed_experts, f"top_k {self.top_k} not in [1, {self.n_routed_experts}]"),
            (self.score_func in SCORE_FUNCS, f"score_func {self.score_func!r} not one of {', '.join(SCORE_FUNCS)}"),
            (
                self.load_balance in LOAD_BALANCE,
                f"load_balance {self.load_balance!r} not one of {', '.join(LOAD_BALANCE)}",
            ),
            (
                self.n_group >= 1 and self.n_routed_experts % self.n_group == 0,
                f"n_group {self.n_group} must divide n_routed_experts {self.n_routed_experts}",
            ),
            (
                1 <= self.topk_group <= self.n_group,
                f"topk_group {self.topk_group} not in [1, n_group = {self.n_group}]",
            ),
            (
                self.top_k <= self.topk_group * self.n_routed_experts // self.n_group,
                f"top_k {self.top_k} exceeds the experts of topk_group {self.topk_group} groups",
            ),
            (not self.use_scaled_rope, "use_scaled_rope (Llama 3.1 scaling) does not apply; DeepSeek-V3 uses YaRN"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def head_dim(self) -> int:
        """A query's / key's head size (no-position part + rotated part)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class DeepSeekV3Block(TransformerBlock):
    """Llama's block (its init_weights and forward) with MLA and a dense or routed MLP."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        nn.Module.__init__(self)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLAttention(args)  # type: ignore[assignment]  # Llama's slot, MLA's module
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward: nn.Module
        if args.is_moe_layer(layer_id):
            self.feed_forward = MoE(
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
                n_groups=args.n_group,
                topk_groups=args.topk_group,
            )
        else:
            self.feed_forward = FeedForward(args.dim, args.dense_hidden)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5


class DeepSeekV3Transformer(Transformer):
    block_cls = DeepSeekV3Block

    def _precompute_rope(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        return yarn_tables(self.model_args, device)


_DEBUG = DeepSeekV3Args(
    dim=64,
    n_layers=4,
    n_heads=4,
    vocab_size=258,
    max_seq_len=2048,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    top_k=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_inter_dim=32,
    n_dense_layers=1,
    dense_inter_dim=128,
    route_scale=2.5,
)

DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    # 0.29M parameters: 4 heads of MLA (latent ranks 32, 16 + 8 qk, 16 v), the first block dense,
    # 8 experts in 4 groups, top 3 from the best 2 groups, one shared expert, scale 2.5.
    "debugmodel": _DEBUG,
    # 16B class (DeepSeek-V2-Lite's shapes, torchtitan's deepseek_v3 "16B"): no query LoRA, latent
    # 512, 27 layers with the first dense, 64 experts top 6 plus 2 shared, V3's sigmoid routing.
    "deepseek_v3_16b": DeepSeekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        max_seq_len=4096,
        q_lora_rank=0,
        kv_lora_rank=512,
        n_routed_experts=64,
        top_k=6,
        n_shared_experts=2,
        moe_inter_dim=1408,
        n_dense_layers=1,
        dense_inter_dim=10944,
    ),
    # DeepSeek-V3 / R1 671B (its published config.json): 61 layers, the first 3 dense, 256 experts
    # in 8 groups, top 8 from 4 groups, one shared, scale 2.5; YaRN x40 over a 4096 context.
    "deepseek_v3_671b": DeepSeekV3Args(
        dim=7168,
        n_layers=61,
        n_heads=128,
        vocab_size=129280,
        max_seq_len=163840,
        q_lora_rank=1536,
        kv_lora_rank=512,
        n_routed_experts=256,
        top_k=8,
        n_group=8,
        topk_group=4,
        n_shared_experts=1,
        moe_inter_dim=2048,
        n_dense_layers=3,
        dense_inter_dim=18432,
        route_scale=2.5,
        rope_factor=40.0,
        rope_original_seq_len=4096,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
}


def active_params(args: DeepSeekV3Args, total_excl_embedding: int) -> int:
    """Parameters a token's forward uses (embeddings excluded): top_k of the routed experts."""
    per_expert = 3 * args.dim * args.moe_inter_dim
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    return total_excl_embedding - moe_layers * (args.n_routed_experts - args.top_k) * per_expert


def flops_per_token(args: DeepSeekV3Args, num_params_excl_embedding: int, seq_len: int) -> int:
    """6N with N the active parameters, plus attention's two matmuls per layer and head (scores
    over the qk head size, values over v_head_dim), x 3 for forward and backward, 2 FLOPs each.

    Args:
        args: the model's arguments (layers, heads, head sizes, experts).
        num_params_excl_embedding: the parameters without the embedding table (N).
        seq_len: the training sequence length (the attention term grows with it).
    """
    attention = 6 * args.n_layers * args.n_heads * (args.head_dim + args.v_head_dim) * seq_len
    return 6 * active_params(args, num_params_excl_embedding) + attention
