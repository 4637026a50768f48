"""The Qwen3 family's model (dense Qwen3, transformers' Qwen3ForCausalLM): Llama 3's decoder
(rotary tables, RMSNorm, SwiGLU MLP, init, the decoder shape) with what Qwen3 changes:

- a per-head RMSNorm over each query and key head before rotary (the MoE family's
  QKNormAttention: one module for both Qwen3 families);
- a head size of its own (128 in every published size, whatever hidden / heads is) and the MLP
  width given as published (`intermediate_size`) rather than Llama's formula;
- rope theta 1e6 without Llama 3.1's frequency scaling, RMSNorm eps 1e-6, no biases;
- the output projection tied to the embeddings on the small sizes (0.6B, 1.7B, 4B).

Precision: the q/k norms are RMSNorms (`computes_in_fp32`, an fp32 island the plan keeps and the
audit checks, as every norm) and the rotary tables and rotation stay fp32 (Llama's code).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from torchtitan_amp.core.rules import ffn_hidden_dim
from torchtitan_amp.models.llama3.model import FeedForward, LlamaModelArgs, Transformer, TransformerBlock
from torchtitan_amp.models.moe.model import QKNormAttention

QWEN3_VOCAB = 151936
QWEN3_ROPE_THETA = 1_000_000.0
QWEN3_MAX_POSITION = 40960  # max_position_embeddings of every published Qwen3 dense config


@dataclass
class Qwen3ModelArgs(LlamaModelArgs):
    """Llama's args with Qwen3's defaults, an explicit head size and an explicit MLP width."""

    norm_eps: float = 1e-6
    rope_theta: float = QWEN3_ROPE_THETA
    use_scaled_rope: bool = False
    vocab_size: int = QWEN3_VOCAB
    max_seq_len: int = QWEN3_MAX_POSITION
    explicit_head_dim: int = 128  # Qwen3's head_dim: not tied to dim / n_heads
    intermediate_dim: int | None = None  # the MLP's width (intermediate_size); None: Llama's formula

    def __post_init__(self) -> None:
        if self.explicit_head_dim <= 0 or self.explicit_head_dim % 2:
            raise ValueError(f"head dim {self.explicit_head_dim} must be positive and even for rope")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim

    @property
    def ffn_hidden(self) -> int:
        """The MLP's hidden width (config.json's intermediate_size)."""
        return self.intermediate_dim or ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


class Qwen3Block(TransformerBlock):
    """Llama's pre-norm block with Qwen3's q/k-normalised attention and its MLP width."""

    def __init__(self, layer_id: int, args: Qwen3ModelArgs) -> None:
        super().__init__(layer_id, args)
        self.attention = QKNormAttention(args)

    @staticmethod
    def build_feed_forward(args: Qwen3ModelArgs) -> nn.Module:  # type: ignore[override]
        return FeedForward(args.dim, args.ffn_hidden)


class Qwen3Transformer(Transformer):
    """Qwen3ForCausalLM's computation in this framework's decoder shape."""

    block_cls = Qwen3Block


def _published(dim: int, n_layers: int, n_heads: int, intermediate: int, tied: bool) -> Qwen3ModelArgs:
    """A published Qwen3 dense size: 8 kv heads of 128, vocab 151936, rope theta 1e6."""
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        intermediate_dim=intermediate,
        enable_weight_tying=tied,
    )


# The flavor registry: with model.name = "qwen3", model.flavor accepts its names (rules.FAMILIES
# lists them without importing torch).
QWEN3_FLAVORS: dict[str, Qwen3ModelArgs] = {
    # Qwen3's shape in small (~0.1M parameters without the embeddings): GQA 4 heads over 2 kv heads,
    # a head size (32) twice dim / n_heads so that the explicit head_dim matters, 4 blocks so that
    # PP 2 x Interleaved1F1B still has a block per stage, 2 kv heads so that TP 2 splits them; the
    # output untied so that every layout (PP included) takes it.
    "debugmodel": Qwen3ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=32,
        intermediate_dim=128,
        vocab_size=258,  # byte tokenizer: 256 bytes + BOS + EOS
        max_seq_len=2048,
    ),
    # Qwen's published config.json files (hidden_size, num_hidden_layers, num_attention_heads,
    # intermediate_size, tie_word_embeddings); tests/test_qwen3.py holds them.
    "qwen3_0_6b": _published(1024, 28, 16, 3072, tied=True),
    "qwen3_1_7b": _published(2048, 28, 16, 6144, tied=True),
    "qwen3_4b": _published(2560, 36, 32, 9728, tied=True),
    "qwen3_8b": _published(4096, 36, 32, 12288, tied=False),
    "qwen3_14b": _published(5120, 40, 40, 17408, tied=False),
    "qwen3_32b": _published(5120, 64, 64, 25600, tied=False),
}


def register_flavor(name: str, args: Qwen3ModelArgs) -> None:
    """Add (or replace) a flavor for this process; model.flavor accepts `name` from now on."""
    QWEN3_FLAVORS[name] = args
