"""The key/value cache of one attention layer during generation (generation.py attaches one to
every Attention, as parallelize.apply_cp attaches the context-parallel group, and takes it away
afterwards: training never sees one).

A forward with a cache attached continues the sequence the cache holds: its S tokens sit at
positions [end, end + S) (rotary rows from there on), their keys and values are written there,
and its queries attend to every cached key up to their own position, a causal mask aligned to
the lower right of the [S, end + S] score matrix. Prefill (an empty cache) is the training
forward's plain causal attention; a one-token decode step needs no mask. Under tensor parallel
the cache holds this rank's kv heads (wk and wv are column-sharded), before GQA's repeat.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Context parallel's per-shape cache of torch's lower-right causal bias (made outside any dispatch mode).
from torchtitan_amp.distributed.context_parallel import lower_right_causal


class KVCache:
    """Keys and values of positions [0, end) of a batch, [B, max_len, kv heads, head_dim] each,
    allocated at the first write in the dtype and device of the keys (the compute dtype)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.end = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def rotary_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables [max_seq_len, head_dim // 2] from this step's first position on."""
        return cos[self.end :], sin[self.end :]

    def update(self, xk: torch.Tensor, xv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values [B, S, H, D] after the cached ones; return all of
        them, [B, end, H, D] with the new end."""
        start, end = self.end, self.end + xk.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions cannot take positions {start}..{end - 1}")
        if self.k is None or self.v is None:
            # Each its own head size: MLA's values are narrower than its keys.
            self.k = torch.empty((xk.shape[0], self.max_len, *xk.shape[2:]), dtype=xk.dtype, device=xk.device)
            self.v = torch.empty((xv.shape[0], self.max_len, *xv.shape[2:]), dtype=xv.dtype, device=xv.device)
        self.k[:, start:end] = xk
        self.v[:, start:end] = xv
        self.end = end
        return self.k[:, :end], self.v[:, :end]

    def rewind(self, n: int) -> None:
        """Forget the last n positions (padding a step needed): the next step overwrites them."""
        self.end -= n

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False) -> torch.Tensor:
        """q [B, H, S, D] at the last S of the key positions, k and v [B, H, end, D] (or their
        kv heads, `enable_gqa`).

        Args:
            q: the queries [B, H, S, D] of the newest S positions.
            k: the cached and new keys [B, H, end, D] (kv heads only under `enable_gqa`).
            v: the values, shaped as `k`.
            enable_gqa: whether k and v hold the kv heads only, SDPA repeating them per query head.
        """
        s, end = q.shape[2], k.shape[2]
        if s == 1:  # the newest token sees every cached one
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
        if s == end:  # prefill: the training forward's causal attention
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right_causal(s, end), enable_gqa=enable_gqa)
