"""A test-only family: Llama 3's decoder with a plain GELU MLP, w_out(gelu(w_in x)), instead of
SwiGLU. Everything else (attention, rotary tables, RMSNorm, init, the decoder shape) is Llama's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from torchtitan_amp.models.llama3.model import LlamaModelArgs, Transformer, TransformerBlock


@dataclass
class GeluArgs(LlamaModelArgs):
    """Llama's args; the MLP is ffn_mult x dim wide (its own type, so the family is known by it)."""

    ffn_mult: int = 4

    @property
    def ffn_hidden(self) -> int:
        return self.ffn_mult * self.dim


class GeluFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden_dim, bias=False)
        self.w_out = nn.Linear(hidden_dim, dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w_in.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w_out.weight, mean=0.0, std=init_std)

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.w_out(F.gelu(self.w_in(x)))


class GeluBlock(TransformerBlock):
    @staticmethod
    def build_feed_forward(args: LlamaModelArgs) -> nn.Module:
        return GeluFeedForward(args.dim, args.ffn_hidden)  # type: ignore[attr-defined]


class GeluTransformer(Transformer):
    block_cls = GeluBlock


# Head dim 16 x 4 heads, 2 kv heads: tiny, but GQA and TP-divisible by 2.
FLAVORS: dict[str, GeluArgs] = {
    "tiny": GeluArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, max_seq_len=64, use_scaled_rope=False
    ),
}
FLAVORS["tiny_3l"] = dataclasses.replace(FLAVORS["tiny"], n_layers=3)


def flops_per_token(args: GeluArgs, num_params_excl_embedding: int, seq_len: int) -> int:
    """6N plus attention, as Llama's."""
    return 6 * num_params_excl_embedding + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
