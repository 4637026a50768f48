"""Context parallel: every sequence split over the `cp` mesh dim, attention across its ranks.

Layout (load-balanced "head-tail", as torchtitan): a window of S tokens is cut into 2 x cp chunks and
cp rank r keeps chunks r and 2cp-1-r, so that every rank holds as much causal attention work as the
others. Inputs, labels, document ids and rotary positions are all cut the same way (`BatchSharder`).

Attention: each rank's queries attend to the whole window's keys and values, all-gathered over the
cp group once per layer (torchtitan's current design). Causal: the keys are put back in window
order and each of the rank's two query chunks attends to the keys up to its own end in one SDPA
call with a lower-right causal bias (no mask tensor: CUDA's kernels take the bias as it is, CPU's
builds one chunk x prefix mask shared by the batch and heads). block_causal: one SDPA call with an
explicit [B, 1, S/cp, S] mask built from positions and documents. Either way a query's softmax
runs over all its keys inside one kernel, with no partial outputs or log-sum-exps to merge across
ranks, so the merge precision hazard of ring attention (pytorch#156012) does not arise. What is left to
decide is the dtype in which the key/value gradients of the cp ranks are summed in backward (the
reduce-scatter of the all-gather): the precision plan's `cp_reduce_dtype` (fp32 by default).

This runs on CPU/gloo and CUDA/nccl alike; torch's experimental CP is not used: its SDPA handlers
cover the CUDA flash / efficient / cuDNN ops only (no CPU, no masks, so no block_causal).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from torchtitan_amp.core.rules import materialises_causal_mask
from torchtitan_amp.core.torch_compat import sequence_collectives

logger = logging.getLogger("torchtitan_amp")

# The seam for tools that label or record the cp collectives (the audit through
# `wrapped_collectives`, tests by patching): None means torch's functional collectives, looked up
# per call so that a traffic recorder wrapping torch's module sees them too.
_ALL_GATHER: Any = None
_REDUCE_SCATTER: Any = None


def collectives() -> tuple[Any, Any]:
    """(all_gather, reduce_scatter) the cp group uses now."""
    gather, scatter = sequence_collectives()
    return _ALL_GATHER or gather, _REDUCE_SCATTER or scatter


@contextlib.contextmanager
def wrapped_collectives(wrap: Callable[[Any], Any]) -> Iterator[None]:
    """Inside the block the cp group's all-gather and reduce-scatter are `wrap(collective)`, of
    the ones in use on entry; on exit those are restored."""
    global _ALL_GATHER, _REDUCE_SCATTER
    saved = _ALL_GATHER, _REDUCE_SCATTER
    _ALL_GATHER, _REDUCE_SCATTER = map(wrap, collectives())
    try:
        yield
    finally:
        _ALL_GATHER, _REDUCE_SCATTER = saved


def head_tail_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions (in the window) rank `cp_rank` of `cp` holds, in the order it holds them:
    chunk r then chunk 2cp-1-r of 2cp equal chunks. [seq_len // cp] int64.

    Args:
        seq_len: tokens in the whole window; a multiple of 2 x cp (check_seq_len).
        cp: the context-parallel degree.
        cp_rank: this rank's index in the cp group, 0 to cp - 1.
        device: where the tensor is made (None: the default device).
    """
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def check_seq_len(seq_len: int, cp: int, field: str = "training.seq_len") -> None:
    """Refuse a sequence length the head-tail split cannot cut into 2 x cp equal chunks
    (ConfigError naming `field`).

    Args:
        seq_len: tokens per window.
        cp: the context-parallel degree; 1 accepts any length.
        field: the config field the length came from, for the message.
    """
    from torchtitan_amp.config import ConfigError

    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(
            f"'{field}' = {seq_len} must be divisible by 2 x context_parallel_degree = "
            f"{2 * cp} (each cp rank holds two of 2 x cp equal chunks of a sequence)"
        )


def check_causal_kernel(device_type: str, compute: str, head_dim: int, cp: int, where: str) -> None:
    """Causal attention under CP runs each query chunk with a lower-right causal bias: refuse a
    CUDA setting where neither kernel that takes the bias as a flag qualifies, on which torch
    would silently build the chunk's mask and the whole score matrix in the math kernel (a whole
    window's fp32 scores at 131072 tokens are 64 GiB per head and sequence). CPU builds one
    [n, end] mask per chunk by design: allowed.

    Args:
        device_type: the device attention runs on ("cuda", "cpu", ...); only "cuda" is checked.
        compute: the attention's compute dtype name ("bfloat16", "float32", ...).
        head_dim: the attention heads' dimension.
        cp: the context-parallel degree; 1 is never refused.
        where: the config fields that set the dtype and head_dim, named in the message.
    """
    from torchtitan_amp.config import ConfigError

    if cp > 1 and device_type == "cuda" and materialises_causal_mask(device_type, compute, head_dim):
        raise ConfigError(
            f"'parallelism.context_parallel_degree' = {cp} with causal attention on cuda in {compute} at head_dim "
            f"{head_dim} ({where}): no SDPA kernel takes the lower-right causal bias there (flash: bfloat16/float16, "
            "head_dim <= 256; efficient: head_dim a multiple of 8 in 16 bits, of 4 in float32), so torch would "
            "build each chunk's mask and all its scores; use such a dtype or head_dim, or context_parallel_degree 1"
        )


@dataclass(frozen=True)
class BatchSharder:
    """A loader batch -> what this rank's model sees: the mask inputs (document ids) computed on the
    whole window first, then inputs, labels and every keyword input cut to this cp rank's chunks,
    plus `positions` (the tokens' places in the window, for rotary embeddings and the mask) and,
    with document ids, `kv_doc_ids` (the whole window's, in the keys' gathered order).
    With cp = 1 only the mask inputs are added."""

    # models.attention.MaskInputs: tokens -> {"doc_ids": ...} or {}
    mask_inputs: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    cp: int = 1
    cp_rank: int = 0

    def __call__(
        self, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        whole = self.mask_inputs(inputs)
        if self.cp == 1:
            return inputs, labels, whole
        keep = head_tail_positions(inputs.shape[1], self.cp, self.cp_rank, inputs.device)
        extra = {name: value.index_select(1, keep) for name, value in whole.items()}
        if "doc_ids" in whole:
            # The keys' documents are the whole window's, known here: handed to attention in the
            # order gather_kv lays the keys out, instead of all-gathered every forward.
            order = gathered_positions(inputs.shape[1], self.cp, inputs.device)
            extra["kv_doc_ids"] = whole["doc_ids"].index_select(1, order)
        # One row per sample, not one shared row: pipeline parallel splits keyword inputs on dim 0.
        extra["positions"] = keep.expand(inputs.shape[0], -1)
        return inputs.index_select(1, keep), labels.index_select(1, keep), extra


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim; backward sums every rank's gradient of the gathered
    tensor and hands each rank its own slice (a reduce-scatter), in `reduce_dtype`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, reduce_dtype: torch.dtype) -> torch.Tensor:
        """All-gather `x` over `group` along the sequence dim (dim 1), keeping what backward needs.

        Args:
            ctx: autograd's context; the group and dtypes are saved on it for backward.
            x: this rank's [B, S/cp, ...] chunk.
            group: the cp process group.
            reduce_dtype: the dtype backward reduce-scatters the gradient in.
        """
        ctx.group, ctx.reduce_dtype, ctx.dtype = group, reduce_dtype, x.dtype
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Summing the ranks' partial gradients in fp32 rounds once, at the end; in bf16 every
        # partial sum rounds, an error that grows with the cp degree.
        summed = collectives()[1](grad.to(ctx.reduce_dtype).transpose(0, 1).contiguous(), "sum", 0, ctx.group)
        return funcol.wait_tensor(summed).transpose(0, 1).to(ctx.dtype), None, None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, s, ...] on each rank -> [B, cp x s, ...], rank 0's part first."""
    gathered = collectives()[0](x.transpose(0, 1).contiguous(), 0, group)
    return funcol.wait_tensor(gathered).transpose(0, 1)


_CAUSAL_BIAS: dict[tuple[int, int], Any] = {}
_WINDOW_ORDER: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_KEY_POSITIONS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def lower_right_causal(n: int, end: int) -> Any:
    """torch's lower-right causal bias for n queries against `end` keys, made once per shape and
    outside any dispatch mode: torch cannot create the CausalBias tensor subclass while one is
    active (the audit's recorder, op-level activation checkpointing)."""
    if (n, end) not in _CAUSAL_BIAS:
        from torch.nn.attention.bias import causal_lower_right
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            _CAUSAL_BIAS[n, end] = causal_lower_right(n, end)
    return _CAUSAL_BIAS[n, end]


def gathered_positions(seq_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The window positions of the keys all-gathered over cp ranks, in the order they arrive.

    Args:
        seq_len: tokens in the whole window.
        cp: the context-parallel degree.
        device: where the tensor is made (None: the default device); on CUDA, made there, since a
            host-to-device copy would wait for the stream.
    """
    return torch.cat([head_tail_positions(seq_len, cp, r, device) for r in range(cp)])


@dataclass(frozen=True)
class ContextParallel:
    """This rank's cp group, held by the model's attention (set by parallelize.apply_cp)."""

    group: dist.ProcessGroup
    reduce_dtype: torch.dtype = torch.float32

    @property
    def degree(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def prepare_causal(self, local_len: int, device: torch.device) -> None:
        """Make this rank's causal-attention constants (the key order, the two lower-right biases)
        for `local_len` tokens per rank, before the blocks run: a compiled block reads them from
        the caches but could not create them (dynamo does not trace _disable_current_modes)."""
        self._window_order(local_len * self.degree, device)
        for chunk in self._chunks():
            lower_right_causal(local_len // 2, (chunk + 1) * (local_len // 2))

    def _chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.degree - 1 - self.rank

    def _window_order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, self.degree, device)
        if key not in _WINDOW_ORDER:  # built once per shape, not per layer
            _WINDOW_ORDER[key] = gathered_positions(seq_len, self.degree).argsort().to(device)
        return _WINDOW_ORDER[key]

    def to_window_order(self, x: torch.Tensor) -> torch.Tensor:
        """Gathered keys or values [B, S, H, D] -> the same in window order (positions 0..S-1)."""
        return x.index_select(1, self._window_order(x.shape[1], x.device))

    def causal_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool = False
    ) -> torch.Tensor:
        """Causal attention of this rank's query chunks over the window's keys: chunk c of the window
        (positions [c n, (c+1) n)) attends to keys [0, (c+1) n), a causal mask aligned to the lower
        right of that prefix. Returns [B, H, S/cp, D].

        Args:
            q: [B, H, S/cp, D] the queries of this rank's head and tail chunks.
            k: [B, H, S, D] the keys in window order ([B, H_kv, S, D] with `enable_gqa`).
            v: the values, shaped as `k`; k and v are views of one window-ordered tensor either way.
            enable_gqa: True when k and v have fewer (grouped-query) heads than q.
        """
        n = q.shape[2] // 2
        outs = []
        for part, chunk in zip((q[:, :, :n], q[:, :, n:]), self._chunks()):
            end = (chunk + 1) * n
            outs.append(
                F.scaled_dot_product_attention(
                    part, k[:, :, :end], v[:, :, :end], attn_mask=lower_right_causal(n, end), enable_gqa=enable_gqa
                )
            )
        return torch.cat(outs, dim=2)

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [B, s, H, D] -> the whole window's [B, cp x s, H, D] (differentiable)."""
        return _GatherSequence.apply(x, self.group, self.reduce_dtype)

    def key_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The window positions of the gathered keys, [cp x local_len] in the order gather_kv lays
        them out: a function of the shape (gathered_positions), made once per shape, never
        gathered."""
        key = (local_len * self.degree, self.degree, device)
        if key not in _KEY_POSITIONS:
            _KEY_POSITIONS[key] = gathered_positions(local_len * self.degree, self.degree, device)
        return _KEY_POSITIONS[key]

    def gather_ids(self, x: torch.Tensor) -> torch.Tensor:
        """Document ids [B, s] -> [B, cp x s], in the order gather_kv lays keys out: for a caller
        that did not hand the window's (BatchSharder does: `kv_doc_ids`)."""
        return _all_gather(x, self.group)


def attention_mask(
    pos_q: torch.Tensor, pos_k: torch.Tensor, doc_q: torch.Tensor | None = None, doc_k: torch.Tensor | None = None
) -> torch.Tensor:
    """Which keys each query may attend to: a key at or before the query's position, in the query's
    own document when documents are given. Every query sees itself. Returns [B, 1, Sq, Sk] bool.

    Args:
        pos_q: [B, Sq] the queries' positions in the window.
        pos_k: [B, Sk] the keys' positions in the window.
        doc_q: [B, Sq] the queries' document ids (None: one document, causal masking only).
        doc_k: [B, Sk] the keys' document ids; needed whenever doc_q is given.
    """
    mask = pos_k[:, None, :] <= pos_q[:, :, None]
    if doc_q is not None:
        if doc_k is None:
            raise ValueError("attention_mask: the queries' documents (doc_q) need the keys' (doc_k)")
        mask &= doc_k[:, None, :] == doc_q[:, :, None]
    return mask[:, None]


def apply_cp(model: nn.Module, cp: ContextParallel) -> None:
    """Hand the cp group to every module of the model that attends across the sequence (those
    declaring a `context_parallel` attribute: the model, for its mask, and each attention)."""
    for module in model.modules():
        if hasattr(type(module), "context_parallel"):
            cast(Any, module).context_parallel = cp  # the declared slot, not a parameter or submodule
    logger.info(
        "applied context parallel (degree %d): K/V all-gathered per layer, gradients reduce-scattered in %s",
        cp.group.size(),
        str(cp.reduce_dtype).removeprefix("torch."),
    )
