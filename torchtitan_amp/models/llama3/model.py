"""Llama 3 family's model: args, flavors, modules, init, parameter and FLOP counts.

Precision contract: every module returns activations in the dtype it was given,
so the same code serves FSDP mixed precision (bf16 params and residual stream),
torch.autocast (fp32 params, bf16 matmuls) and plain fp32. The numerically
sensitive parts (RMSNorm, rotary embeddings) upcast to fp32 internally because
neither path does it for us: FSDP casts parameters, not ops, and CPU autocast
has no entry for rms_norm.
"""

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_amp.core.rules import ffn_hidden_dim, takes_grouped_kv
from torchtitan_amp.distributed.context_parallel import ContextParallel, attention_mask
from torchtitan_amp.models.attention import (
    FlexMasks,
    ShardedQueries,
    block_causal_mask,
    cuda_capability,
    flex_attend,
    pinned_kernels,
)
from torchtitan_amp.models.kv_cache import KVCache
from torchtitan_amp.models.spec import count_params  # noqa: F401  (the family's count, re-exported)

# Llama 3.1 rope frequency scaling (torchtitan's RoPEScalingArgs defaults); the model args
# carry their own copy because Llama 3.2 checkpoints use factor 32 (checkpoint/hf.py maps them).
ROPE_SCALING_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_MAX_POSITION = 8192


@dataclass
class LlamaModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    # Per-layer init std 0.02 / sqrt(2 * (layer_id + 1)) instead of one shared
    # 0.02 / sqrt(2 * n_layers).
    depth_init: bool = True
    use_scaled_rope: bool = True
    rope_scaling_factor: float = ROPE_SCALING_FACTOR
    rope_low_freq_factor: float = ROPE_LOW_FREQ_FACTOR
    rope_high_freq_factor: float = ROPE_HIGH_FREQ_FACTOR
    rope_original_max_position: int = ROPE_ORIGINAL_MAX_POSITION
    # The output projection's weight IS the embedding table (one Parameter; Hugging Face's
    # tie_word_embeddings, Llama 3.2 1B/3B): counted, initialised, saved and reduced once.
    enable_weight_tying: bool = False

    def __post_init__(self) -> None:
        # Fail at config time: these would otherwise surface as view() errors
        # deep inside the first forward.
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for rope")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


_DEBUG_MODEL = LlamaModelArgs(
    dim=256,
    n_layers=6,
    n_heads=16,
    rope_theta=500000.0,
    vocab_size=258,  # byte tokenizer: 256 bytes + BOS + EOS
    max_seq_len=2048,
    use_scaled_rope=False,
)

_LLAMA3_8B = LlamaModelArgs(
    dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0
)
_LLAMA3_70B = LlamaModelArgs(
    dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0
)

# The flavor registry: with model.name = "llama3", model.flavor accepts its names (rules.FAMILIES
# lists the built-in ones without importing torch; register_flavor adds more at run time).
LLAMA3_FLAVORS: dict[str, LlamaModelArgs] = {
    "debugmodel": _DEBUG_MODEL,
    # Head dim 64 instead of 16: CPU bf16 attention backward is ~3.5x slower
    # than fp32 at head dim 16 and on par at 64.
    "debugmodel_h64": dataclasses.replace(_DEBUG_MODEL, n_heads=4),
    # For smoke tests and CI: ~0.3M parameters (debugmodel: 5M), 2 heads so TP 2 still splits
    # them, 4 blocks so PP 2 x Interleaved1F1B still has a block per stage. A bf16 step on a
    # CPU without native bf16 (AVX2) costs ~14x less than debugmodel's (measured 0.05 vs 0.75 s).
    "debugmodel_tiny": dataclasses.replace(_DEBUG_MODEL, dim=64, n_layers=4, n_heads=2),
    # Llama 3.1 (rope scaling factor 8, untied output).
    "llama3_8b": _LLAMA3_8B,
    "llama3_70b": _LLAMA3_70B,
    "llama3_405b": LlamaModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
    # The other sizes people download; their published config.json files import under these
    # names (tests/test_llama_flavors.py holds them). Llama 3.2 1B / 3B: 3.1's rope scaling with
    # factor 32 and the output tied to the embeddings; torchtitan's FFN settings give the
    # published intermediate_size 8192 for both.
    "llama3_2_1b": LlamaModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        enable_weight_tying=True,
    ),
    "llama3_2_3b": LlamaModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        enable_weight_tying=True,
    ),
    # Llama 3 (3.0) 8B / 70B: 3.1's shapes without rope scaling (an 8192-token context).
    "llama3_0_8b": dataclasses.replace(_LLAMA3_8B, use_scaled_rope=False),
    "llama3_0_70b": dataclasses.replace(_LLAMA3_70B, use_scaled_rope=False),
}


def register_flavor(name: str, args: LlamaModelArgs) -> None:
    """Add (or replace) a flavor for this process. LLAMA3_FLAVORS is the registry model.flavor is
    checked against (rules.flavor_names, through the family), so a config naming `name` is
    accepted from now on."""
    LLAMA3_FLAVORS[name] = args


def build_model_args(flavor: str, vocab_size: int, max_seq_len: int) -> LlamaModelArgs:
    """A copy of the flavor with the tokenizer's vocab and the training seq len.

    Args:
        flavor: the registered flavor's name (model.flavor).
        vocab_size: the tokenizer's vocabulary size.
        max_seq_len: the training sequence length (training.seq_len), the rotary tables' length.
    """
    if flavor not in LLAMA3_FLAVORS:
        allowed = ", ".join(LLAMA3_FLAVORS)
        raise ValueError(f"unknown model flavor {flavor!r}; allowed flavors: {allowed}")
    return dataclasses.replace(LLAMA3_FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)


@dataclass(frozen=True)
class RopeScaling:
    factor: float = ROPE_SCALING_FACTOR
    low_freq_factor: float = ROPE_LOW_FREQ_FACTOR
    high_freq_factor: float = ROPE_HIGH_FREQ_FACTOR
    original_max_position: int = ROPE_ORIGINAL_MAX_POSITION

    @classmethod
    def from_args(cls, args: LlamaModelArgs) -> "RopeScaling":
        return cls(
            args.rope_scaling_factor,
            args.rope_low_freq_factor,
            args.rope_high_freq_factor,
            args.rope_original_max_position,
        )


def _scale_rope_freqs(freqs: torch.Tensor, s: RopeScaling = RopeScaling()) -> torch.Tensor:
    """Llama 3.1 context extension: slow down low frequencies, keep high ones,
    interpolate smoothly in between."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    interpolated = (1 - smooth) * freqs / s.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_between, interpolated, scaled)


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    use_scaled_rope: bool,
    device: torch.device | None = None,
    scaling: RopeScaling = RopeScaling(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_seq_len, head_dim // 2], float32.

    Real tables rather than complex ones: complex tensors are poorly supported
    by torch.compile and DTensor.

    Args:
        head_dim: the attention head size (the tables are half as wide).
        max_seq_len: the positions the tables cover.
        theta: the rotary base (rope_theta).
        use_scaled_rope: whether Llama 3.1's frequency scaling applies (`scaling` says how).
        device: where the tables are made; None: the default device.
        scaling: the scaling's factors (Llama 3.1's by default).
    """
    device = torch.device(device) if device is not None else torch.get_default_device()
    # An enclosing autocast (e.g. init_weights called inside a forward context)
    # must not turn the angle products into bf16: position * freq needs all of
    # fp32's mantissa at long sequence lengths. Meta has no autocast to disable.
    no_autocast = (
        torch.autocast(device.type, enabled=False)
        if torch.amp.is_autocast_available(device.type)
        else contextlib.nullcontext()
    )
    with no_autocast:
        exponents = torch.arange(0, head_dim, 2, device=device).float() / head_dim
        freqs = 1.0 / (theta**exponents)
        if use_scaled_rope:
            freqs = _scale_rope_freqs(freqs, scaling)
        positions = torch.arange(max_seq_len, device=device).float()
        angles = torch.outer(positions, freqs)
        return angles.cos(), angles.sin()


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ([B, S, H, head_dim]) by position; cos/sin are the tables [max_seq_len,
    head_dim // 2] (positions 0..S-1 used) or already picked per token, [B, S, head_dim // 2]
    (context parallel: a rank's tokens are not the window's first S).

    Rotates interleaved pairs (x[2i], x[2i+1]), the layout of Meta's Llama
    checkpoints and of torchtitan's complex implementation.

    Args:
        xq: the queries [B, S, H, head_dim].
        xk: the keys [B, S, kv_heads, head_dim].
        cos: the rotary cosine table [max_seq_len, head_dim // 2], or picked per token [B, S,
            head_dim // 2] under context parallel.
        sin: the rotary sine table, shaped as `cos`.
    """
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        # Tables may be longer than the sequence: slice here, where q holds the whole sequence even
        # when sequence parallel has split the residual stream outside attention.
        seqlen = xq.shape[1]
        cos, sin = cos[:seqlen, None, :], sin[:seqlen, None, :]
    return _rotate(xq, cos, sin), _rotate(xk, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In bf16 the products and sums would round to 8 significant bits, blurring
    # the position signal that q.k depends on.
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, H_kv, D] -> [B, S, H_kv * n_rep, D], each kv head repeated in place."""
    if n_rep == 1:
        return x
    bs, seqlen, n_kv_heads, head_dim = x.shape
    return (
        x.unsqueeze(3).expand(bs, seqlen, n_kv_heads, n_rep, head_dim).reshape(bs, seqlen, n_kv_heads * n_rep, head_dim)
    )


# torch dtypes by name, looked up rather than printed: a compiled block reads a dict of constants.
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def grouped_kv(
    xq: torch.Tensor, head_dim: int, mask: torch.Tensor | None, capability: tuple[int, int] | None = None
) -> bool:
    """Whether this call's kernel takes the kv_heads keys and values as they are (SDPA's
    enable_gqa; rules.takes_grouped_kv says where: CUDA's flash kernel, CPU's in float32): the
    queries' device and dtype are the call's, whatever path (FSDP, autocast) made them, and
    whether they require gradients says training (flash refuses some head sizes' backward).

    Args:
        xq: this call's queries (their device, dtype and requires_grad decide).
        head_dim: the head size (flash refuses some sizes' backward).
        mask: the call's attention mask; None: causal.
        capability: the CUDA device's (major, minor) compute capability; None: read from the
            queries' device.
    """
    dtype = _DTYPE_NAMES.get(xq.dtype, "other")
    return takes_grouped_kv(
        xq.device.type,
        dtype,
        head_dim,
        "causal" if mask is None else "mask",
        capability if xq.device.type == "cuda" else None,
        xq.requires_grad,
    )


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, returned in the input's dtype.

    Output in the input dtype because under FSDP mixed precision the residual
    stream is bf16 and the next Linear holds bf16 weights. Upcast explicitly
    rather than trust the kernel: CPU autocast has no rule for rms_norm, and
    whether a backend's bf16 kernel accumulates in fp32 is its own choice.
    """

    # Tells the precision plan that no autocast guard is needed around this module.
    computes_in_fp32 = True

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    # Set by parallelize.apply_cp: keys and values are then gathered over the cp ranks.
    context_parallel: ContextParallel | None = None
    # Set while generating (generation.kv_caches): the forward continues the cached sequence.
    kv_cache: KVCache | None = None

    def __init__(self, args: LlamaModelArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        # Which SDPA kernel runs depends on it (rules.attention_kernel); a constant when compiled.
        self.cuda_capability = cuda_capability()
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def normalize_qk(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head query/key normalisation before rotary: none in Llama (Qwen3 overrides it)."""
        return xq, xk

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | FlexMasks | None = None
    ) -> torch.Tensor:
        """Attention's output [B, S, dim]. Under context parallel the keys and values are the whole
        window's; with a KV cache, attention is causal over the cached positions and these
        (generation hands no mask).

        Args:
            x: the block's normalised input [B, S, dim].
            cos: the rotary cosine table [max_seq_len, head_dim // 2], or picked per token [B, S,
                head_dim // 2] under context parallel.
            sin: the rotary sine table, shaped as `cos`.
            mask: None (causal) or [B, 1, S, Sk] bool, True where a query may attend a key (Sk = cp
                x S under context parallel); FlexMasks on the flex backend.
        """
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv are column-sharded and
        # produce only this rank's heads; n_rep is unchanged by that.
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = self.normalize_qk(xq, xk)
        cache = self.kv_cache
        if cache is not None:
            cos, sin = cache.rotary_rows(cos, sin)
        xq, xk = apply_rotary_emb(xq, xk, cos, sin)
        if cache is not None:
            xk, xv = cache.update(xk, xv)
        if isinstance(mask, FlexMasks):  # model.attention_backend "flex": GQA inside the kernel
            if self.context_parallel is not None:  # the window's keys; the mask places them
                xk, xv = self.context_parallel.gather_kv(xk), self.context_parallel.gather_kv(xv)
            out = flex_attend(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), mask)
            return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
        cp = self.context_parallel
        if cp is not None:
            # Before any repeat: GQA's fewer kv heads are what travels.
            xk, xv = cp.gather_kv(xk), cp.gather_kv(xv)
            if mask is None:  # causal: each query chunk against its prefix of the window
                xk, xv = cp.to_window_order(xk), cp.to_window_order(xv)
        grouped = self.n_rep > 1 and grouped_kv(xq, self.head_dim, mask, self.cuda_capability)
        if not grouped:  # the kernel needs one key/value head per query head: a copy, saved
            xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        with pinned_kernels():  # the kernels rules.attention_kernel predicts, in its order
            if cache is not None:
                out = cache.attend(q, k, v, enable_gqa=grouped)
            elif cp is not None and mask is None:
                out = cp.causal_attention(q, k, v, enable_gqa=grouped)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=grouped
                )
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _InitWeights(Protocol):
    """What TransformerBlock.build_feed_forward's module has beside forward."""

    def init_weights(self, init_std: float) -> None: ...


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h))."""

    def __init__(self, layer_id: int, args: LlamaModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = self.build_feed_forward(args)
        # Output projections feed the residual stream; shrinking their std keeps
        # its variance from growing with depth.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * depth) ** 0.5

    @staticmethod
    def build_feed_forward(args: LlamaModelArgs) -> nn.Module:
        """The block's MLP: a family built from Llama's blocks overrides only this (its module must
        have `init_weights(init_std)`)."""
        return FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        cast(_InitWeights, self.feed_forward).init_weights(self.weight_init_std)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | FlexMasks | None = None
    ) -> torch.Tensor:
        # The mask as a keyword: TP's PrepareModuleInput lays out the positional inputs only.
        """x + attention(norm(x)), then h + feed_forward(norm(h)): [B, S, dim] in and out.

        Args:
            x: the residual stream [B, S, dim].
            cos: the rotary cosine table [max_seq_len, head_dim // 2], or picked per token [B, S,
                head_dim // 2] under context parallel.
            sin: the rotary sine table, shaped as `cos`.
            mask: None (causal) or [B, 1, S, Sk] bool, True where a query may attend a key (Sk = cp
                x S under context parallel).
        """
        h = x + self.attention(self.attention_norm(x), cos, sin, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder. Pipeline splitting may set tok_embeddings, norm and
    output to None and delete entries of `layers`; forward then passes hidden
    states through the missing ends."""

    # The block type: a family that reuses Llama's decoder with another block overrides this.
    block_cls: type[TransformerBlock] = TransformerBlock
    # Set by parallelize.apply_cp, like every Attention's.
    context_parallel: ContextParallel | None = None
    # "sdpa" or "flex": the precision plan's attention decision (attention.decide_backend), set
    # when the model is built; "flex" hands every layer FlexMasks instead of a bool mask.
    attention_backend: str = "sdpa"
    # What a family's layers add to the causal / document mask (decide_backend's `masks`).
    attention_masks: tuple[str, ...] = ()
    # Registered as non-persistent buffers in __init__ (declared here for the type checker).
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, args: LlamaModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by layer index, not a list, so that a pipeline stage
        # holding layers 8..15 still has the FQNs "layers.8...." for checkpoints.
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.enable_weight_tying:
            self.tie_weights()
            # One tensor, one key: checkpoints, exports and Hugging Face folders hold the table
            # once, as tok_embeddings.weight (HF's tied checkpoints have no lm_head.weight).
            self.register_state_dict_post_hook(_drop_tied_output)
            self.register_load_state_dict_pre_hook(_fill_tied_output)
        # Non-persistent: derived from args, so checkpoints stay free of them
        # and a meta-built model regenerates them in init_weights.
        rope_cos, rope_sin = self._precompute_rope(device=None)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def _precompute_rope(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.model_args
        return precompute_rope(
            a.head_dim, a.max_seq_len, a.rope_theta, a.use_scaled_rope, device, RopeScaling.from_args(a)
        )

    def tie_weights(self) -> None:
        """Make the output projection's weight the embedding table itself (enable_weight_tying).
        Again after anything that re-creates parameters one module at a time: `to_empty` from
        the meta device gives each module a new tensor of its own."""
        if self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter and the rope buffers; the step after
        `to_empty`, since a meta-built model owns only uninitialised memory. A tied table is
        initialised once, as the output projection (torchtitan's choice: std dim**-0.5 keeps the
        first logits near zero, where the embedding's std 1 would make them ~sqrt(dim))."""
        tied = self.model_args.enable_weight_tying
        if tied:
            self.tie_weights()
        self.rope_cos, self.rope_sin = self._precompute_rope(buffer_device or self.rope_cos.device)
        if self.tok_embeddings is not None and not tied:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            if layer is not None:
                cast(TransformerBlock, layer).init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.model_args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(
        self,
        tokens: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        kv_doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, vocab]; on a pipeline stage without the output head, hidden states
        [B, S, dim].

        Args:
            tokens: the token ids [B, S] int64, or hidden states [B, S, dim] on a pipeline stage
                without the embedding.
            doc_ids: [B, S] each token's document in its window (models/attention.py); attention
                stays inside it. None: causal over the window.
            positions: [B, S] the tokens' places in their window when they are not 0..S-1 (context
                parallel hands each rank two chunks of it: context_parallel.BatchSharder); None:
                0..S-1.
            kv_doc_ids: [B, cp x S] under context parallel with documents, the documents of the
                whole window's keys in their gathered order; None otherwise.
        """
        cos, sin, mask = self._attention_inputs(doc_ids, positions, kv_doc_ids)
        self.prepare_flex(mask, tokens.shape[1])
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def flex_windows(self) -> set[int | None]:
        """The sliding windows of this model's layers (None: a layer without one)."""
        return {None}

    def prepare_flex(self, mask: object, seq: int) -> None:
        """On flex, builds every layer's BlockMask for this forward's `seq` queries before the
        blocks (FlexMasks.prepare), so that a compiled block only looks it up."""
        if isinstance(mask, FlexMasks):
            mask.prepare(self.flex_windows(), seq)

    def _attention_inputs(
        self, doc_ids: torch.Tensor | None, positions: torch.Tensor | None, kv_doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | FlexMasks | None]:
        """Rotary tables (picked per token when positions are given) and the mask, built once per
        forward for every block: None is plain causal attention; FlexMasks on the flex backend."""
        if positions is None and self.attention_backend == "flex":
            batch = doc_ids.shape[0] if doc_ids is not None else 1
            return self.rope_cos, self.rope_sin, FlexMasks(doc_ids, batch, self.rope_cos.device)
        if positions is None:
            mask = block_causal_mask(doc_ids) if doc_ids is not None else None
            return self.rope_cos, self.rope_sin, mask
        cp = self.context_parallel
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        if cp is not None and self.attention_backend == "flex":
            return cos, sin, cp_flex_masks(cp, positions, doc_ids, kv_doc_ids)
        if cp is not None and doc_ids is None:
            cp.prepare_causal(positions.shape[1], positions.device)
            return cos, sin, None  # causal under CP: Attention attends chunk by chunk, no mask
        if cp is None:
            return cos, sin, attention_mask(positions, positions, doc_ids, doc_ids)
        # The gathered keys' positions follow from the shape and their documents from the whole
        # window (BatchSharder): no collective for either.
        kv_pos = cp.key_positions(positions.shape[1], positions.device).expand(positions.shape[0], -1)
        kv_doc = kv_doc_ids if kv_doc_ids is not None or doc_ids is None else cp.gather_ids(doc_ids)
        return cos, sin, attention_mask(positions, kv_pos, doc_ids, kv_doc)


def cp_flex_masks(
    cp: ContextParallel, positions: torch.Tensor, doc_ids: torch.Tensor | None, kv_doc_ids: torch.Tensor | None
) -> FlexMasks:
    """Under context parallel on flex: FlexMasks over this rank's queries and the gathered keys,
    placed by window position (attention.ShardedQueries).

    Args:
        cp: the model's context-parallel group.
        positions: [B, S/cp] this rank's tokens' window positions (the same in every row).
        doc_ids: [B, S/cp] their documents, or None (causal).
        kv_doc_ids: [B, S] the gathered keys' documents (None: gathered here from doc_ids).
    """
    kv_pos = cp.key_positions(positions.shape[1], positions.device)
    kv_doc = kv_doc_ids if kv_doc_ids is not None or doc_ids is None else cp.gather_ids(doc_ids)
    sharded = ShardedQueries(positions[0], kv_pos, kv_doc, (cp.degree, cp.rank))
    return FlexMasks(doc_ids, positions.shape[0], positions.device, sharded=sharded)


def _drop_tied_output(model: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    state_dict.pop(prefix + "output.weight", None)


def _fill_tied_output(model: nn.Module, state_dict: dict, prefix: str, *_: object) -> None:
    if prefix + "tok_embeddings.weight" in state_dict:
        state_dict.setdefault(prefix + "output.weight", state_dict[prefix + "tok_embeddings.weight"])


def flops_per_token(args: LlamaModelArgs, num_params_excl_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token, as torchtitan's get_num_flop_per_token.

    6N: forward + 2x backward, 2 FLOPs per multiply-add. Attention adds
    12 * L * H * head_dim * seq_len: 2 matmuls (scores, values) x 3 (fwd +
    bwd) x 2 FLOPs; the causal mask's skipped half is by convention not
    subtracted, and flash-attention recomputation is not counted.

    Args:
        args: the model's arguments (layers, heads, head size).
        num_params_excl_embedding: the parameters without the embedding table (N).
        seq_len: the training sequence length (the attention term grows with it).
    """
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return 6 * num_params_excl_embedding + attention
