"""The gpt-oss family's model (transformers' GptOssForCausalLM): Llama 3's decoder shape with

- attention with sinks: a learned logit per head joins each query's softmax denominator as an
  extra column that no value belongs to (SinkAttention). SDPA and flash kernels take no such
  column, so the attention is written out: q k^T, the masks, the sink column, a max-subtracted
  softmax and the product with v, each an eager matmul / softmax in fp32 (the module declares
  `computes_in_fp32`, so the precision plan keeps it an fp32 island and the audit checks it);
- sliding-window (`sliding_window` keys, the query's own included) and full causal layers
  alternating, the first sliding, as transformers' `layer_types` default;
- biases on q, k, v and o;
- YaRN rotary tables (`yarn_rope`, transformers' `_compute_yarn_parameters`), the attention
  factor folded into cos and sin;
- every block's MLP the MoE layer of models/moe/ with a biased router (softmax over the top-k
  logits: the renormalised top-k of a softmax), per-expert biases and the clamped SwiGLU
  (moe.ClampedSwiGLU: alpha 1.702, limit 7.0, (up + 1) * gate * sigmoid(alpha * gate)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_amp.distributed.context_parallel import attention_mask
from torchtitan_amp.models.attention import FlexMasks, flex_attend
from torchtitan_amp.models.llama3.model import Attention, Transformer, TransformerBlock, apply_rotary_emb, repeat_kv
from torchtitan_amp.models.moe.model import MoEModelArgs, moe_layer
from torchtitan_amp.models.moe.model import flops_per_token as moe_flops_per_token
from torchtitan_amp.models.moe.moe import ClampedSwiGLU, local


@dataclass
class GptOssModelArgs(MoEModelArgs):
    sliding_window: int = 128  # keys a sliding layer's query sees, its own included
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # YaRN (transformers' rope_parameters of gpt-oss): factor, beta_fast / beta_slow, the
    # pre-training context and whether the correction range is truncated to whole dims.
    yarn_factor: float = 32.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_original_max_position: int = 4096
    yarn_truncate: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be at least 1")
        if self.yarn_factor < 1:
            raise ValueError(f"yarn_factor {self.yarn_factor} must be at least 1")

    def is_sliding(self, layer_id: int) -> bool:
        """Sliding-window layers: the even ones (transformers' default layer_types)."""
        return layer_id % 2 == 0


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def yarn_inv_freq(args: GptOssModelArgs, device: torch.device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] fp32, attention factor), as transformers'
    _compute_yarn_parameters computes them: interpolated (/ factor) below the correction range,
    extrapolated above, linearly ramped in between."""
    dim, base, factor = args.head_dim, args.rope_theta, args.yarn_factor
    orig = args.yarn_original_max_position

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(args.yarn_beta_fast), correction_dim(args.yarn_beta_slow)
    if args.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention_factor


def yarn_rope(args: GptOssModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_len, head_dim // 2] fp32 with YaRN's frequencies, each times the
    attention factor (transformers scales cos and sin so: q and k both carry it)."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    with _no_autocast(device):
        inv_freq, scale = yarn_inv_freq(args, device)
        angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inv_freq)
        return angles.cos() * scale, angles.sin() * scale


@dataclass(frozen=True)
class PositionMasks:
    """Under context parallel (sdpa backend): which of the gathered keys each of this rank's
    queries may attend to, decided by window positions (the head-tail order makes a rank's queries
    two separate chunks, so local indices would be wrong): `full` is causal and documents,
    `sliding` also keeps keys within the window. [B, 1, S/cp, S] bool each, built once per forward."""

    full: torch.Tensor
    sliding: torch.Tensor

    @classmethod
    def build(
        cls,
        window: int,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        q_doc: torch.Tensor | None,
        k_doc: torch.Tensor | None,
    ) -> PositionMasks:
        """The two masks of one forward.

        Args:
            window: the sliding layers' window (keys q - k < window).
            q_pos: [B, Sq] this rank's queries' window positions.
            k_pos: [B, Sk] the gathered keys' window positions, in their gathered order.
            q_doc: [B, Sq] the queries' documents (None: one document).
            k_doc: [B, Sk] the keys' documents; needed whenever q_doc is given.
        """
        full = attention_mask(q_pos, k_pos, q_doc, k_doc)
        return cls(full, full & (q_pos[:, :, None] - k_pos[:, None, :] < window)[:, None])


class SinkAttention(nn.Module):
    """softmax([q k^T * scale, sink]) without its sink column, times v, in fp32: the sinks and
    the softmax that adds them stay fp32 under every precision plan (`computes_in_fp32`). Eager
    matmuls and softmax, no SDPA (which has no sink column); the result in v's dtype.

    Masks: causal, plus `window` (keys q - k < window) on sliding layers, and the caller's
    boolean mask (documents) where given."""

    computes_in_fp32 = True

    def __init__(self, n_heads: int, head_dim: int, window: int | None) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.scale, self.window = head_dim**-0.5, window

    def reset_parameters(self) -> None:
        nn.init.normal_(self.sinks, mean=0.0, std=0.02)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | FlexMasks | PositionMasks | None
    ) -> torch.Tensor:
        """The attention's output [B, H, S, D] in v's dtype.

        Args:
            q: the rotated queries [B, H, S, D].
            k: the rotated keys [B, H, Sk, D], one per query head (repeated under GQA); the last S
                of the Sk positions are the queries' (but under context parallel).
            v: the values, shaped as `k`.
            mask: None (causal) or [B, 1, S, Sk] bool, True where a query may attend a key;
                FlexMasks on the flex backend (the same fp32 island, on FlexAttention);
                PositionMasks under context parallel (the keys gathered, masks by window position).
        """
        if isinstance(mask, FlexMasks):  # flex: the window a mask_mod, the sinks the fp32 lse merge
            return flex_attend(q.float(), k.float(), v.float(), mask, self.window, local(self.sinks)).to(v.dtype)
        if isinstance(mask, PositionMasks):
            allowed = mask.sliding if self.window is not None else mask.full
        else:
            allowed = self._allowed(q.shape[2], k.shape[2], mask, q.device)
        # Autocast would run the two matmuls in bf16: off here, as the fp32 island promises.
        with _no_autocast(q.device):
            return self._attend(q.float(), k.float(), v.float(), allowed).to(v.dtype)

    def _allowed(self, seq: int, keys: int, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """Causal and window by position (the queries the last `seq` of `keys`), and `mask`."""
        q_pos = torch.arange(keys - seq, keys, device=device)[:, None]
        k_pos = torch.arange(keys, device=device)[None, :]
        allowed = k_pos <= q_pos
        if self.window is not None:
            allowed = allowed & (q_pos - k_pos < self.window)
        return allowed & mask if mask is not None else allowed

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        seq = q.shape[2]
        logits = torch.matmul(q, k.transpose(2, 3)) * self.scale
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = local(self.sinks).float().reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, 1)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.matmul(probs, v)


class GptOssAttention(Attention):
    """Grouped-query attention with biases on q, k, v, o, sinks, and a sliding window on the
    sliding layers. Under context parallel the keys and values (GQA's fewer heads) are all-gathered
    and the masks come by window position (PositionMasks, or FlexMasks on flex). With a generation KV cache
    (Attention.kv_cache) the step's keys and values join the cached ones and SinkAttention takes
    them all: its queries sit at the last positions, so the causal mask and the window apply by
    position (a sliding layer's cache keeps every key; the window hides the old ones)."""

    def __init__(self, args: GptOssModelArgs, layer_id: int) -> None:
        super().__init__(args)
        hd = self.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=True)
        self.wk = nn.Linear(args.dim, args.kv_heads * hd, bias=True)
        self.wv = nn.Linear(args.dim, args.kv_heads * hd, bias=True)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=True)
        self.core = SinkAttention(args.n_heads, hd, args.sliding_window if args.is_sliding(layer_id) else None)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(linear.bias)
        self.core.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | FlexMasks | PositionMasks | None = None,
    ) -> torch.Tensor:
        """Attention's output [B, S, dim].

        Args:
            x: the block's normalised input [B, S, dim].
            cos: the rotary cosine table [max_seq_len, head_dim // 2].
            sin: the rotary sine table, shaped as `cos`.
            mask: None (causal) or [B, 1, S, S] bool, True where a query may attend a key;
                FlexMasks on the flex backend (generation hands none); PositionMasks under
                context parallel.
        """
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        cache = self.kv_cache
        if cache is not None:
            cos, sin = cache.rotary_rows(cos, sin)
        xq, xk = apply_rotary_emb(xq, xk, cos, sin)
        if cache is not None:  # this rank's kv heads, before GQA's repeat
            xk, xv = cache.update(xk, xv)
        if self.context_parallel is not None:  # the whole window's keys, in the gathered order
            xk, xv = self.context_parallel.gather_kv(xk), self.context_parallel.gather_kv(xv)
        xk, xv = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = self.core(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class GptOssBlock(TransformerBlock):
    def __init__(self, layer_id: int, args: GptOssModelArgs) -> None:
        super().__init__(layer_id, args)
        self.attention = GptOssAttention(args, layer_id)

    @staticmethod
    def build_feed_forward(args: GptOssModelArgs) -> nn.Module:  # type: ignore[override]
        return moe_layer(args, biases=True, activation=ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit))


class GptOssTransformer(Transformer):
    block_cls = GptOssBlock
    attention_masks = ("sliding window", "sinks")

    def _precompute_rope(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(self.model_args, GptOssModelArgs)
        return yarn_rope(self.model_args, device)

    def flex_windows(self) -> set[int | None]:
        """The windows of the layers this model (or pipeline stage) holds: sliding and full."""
        args = self.model_args
        assert isinstance(args, GptOssModelArgs)
        return {args.sliding_window if args.is_sliding(int(i)) else None for i in self.layers}

    def _attention_inputs(  # type: ignore[override]
        self, doc_ids: torch.Tensor | None, positions: torch.Tensor | None, kv_doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | FlexMasks | PositionMasks | None]:
        """Llama's, but under context parallel on sdpa: PositionMasks (causal attention included,
        since the sinks and the window are not in the chunked causal path)."""
        cp = self.context_parallel
        if cp is None or positions is None or self.attention_backend == "flex":
            return super()._attention_inputs(doc_ids, positions, kv_doc_ids)
        assert isinstance(self.model_args, GptOssModelArgs)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        kv_pos = cp.key_positions(positions.shape[1], positions.device).expand(positions.shape[0], -1)
        kv_doc = kv_doc_ids if kv_doc_ids is not None or doc_ids is None else cp.gather_ids(doc_ids)
        return cos, sin, PositionMasks.build(self.model_args.sliding_window, positions, kv_pos, doc_ids, kv_doc)


_MOE = {
    "score_func": "softmax",
    "route_norm": True,
    "n_shared_experts": 0,
    "n_dense_layers": 0,
    "load_balance": "aux_loss",
    "aux_loss_alpha": 1e-3,
    "use_scaled_rope": False,
}

# gpt-oss-20b's published shape (transformers' GptOssConfig of the released model); 120b has 36
# blocks and 128 experts.
_GPT_OSS_20B = GptOssModelArgs(
    dim=2880,
    n_layers=24,
    n_heads=64,
    n_kv_heads=8,
    explicit_head_dim=64,
    vocab_size=201088,
    max_seq_len=131072,
    norm_eps=1e-5,
    rope_theta=150000.0,
    n_routed_experts=32,
    top_k=4,
    moe_inter_dim=2880,
    sliding_window=128,
    **_MOE,  # type: ignore[arg-type]
)

GPT_OSS_FLAVORS: dict[str, GptOssModelArgs] = {
    # ~0.7M parameters: 4 blocks (2 sliding, 2 full), GQA 4 heads of 16 over 2 kv heads, 8
    # experts top 2, a 16-key window so that the window matters at short sequence lengths; TP 2
    # splits the heads, PP 2 gets a sliding and a full block per stage.
    "debugmodel": GptOssModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=16,
        vocab_size=258,
        max_seq_len=2048,
        rope_theta=150000.0,
        n_routed_experts=8,
        top_k=2,
        moe_inter_dim=64,
        sliding_window=16,
        yarn_original_max_position=256,
        **_MOE,  # type: ignore[arg-type]
    ),
    "gpt_oss_20b": _GPT_OSS_20B,
    "gpt_oss_120b": dataclasses.replace(_GPT_OSS_20B, n_layers=36, n_routed_experts=128),
}


def flops_per_token(args: GptOssModelArgs, num_params_excl_embedding: int, seq_len: int) -> int:
    """The MoE family's count (6 x active parameters plus attention over the whole sequence: the
    sliding layers' shorter reach is not subtracted, as torchtitan's count does not).

    Args:
        args: the model's arguments.
        num_params_excl_embedding: the parameters without the embedding table (N).
        seq_len: the training sequence length.
    """
    return moe_flops_per_token(args, num_params_excl_embedding, seq_len)
