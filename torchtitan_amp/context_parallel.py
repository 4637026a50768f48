"""Context parallel: every sequence split over the `cp` mesh dim, attention across its ranks.

Layout (load-balanced "head-tail", as torchtitan): a window of S tokens is cut into 2 x cp chunks and
cp rank r keeps chunks r and 2cp-1-r, so that every rank holds as much causal attention work as the
others. Inputs, labels, document ids and rotary positions are all cut the same way (`BatchSharder`).

Attention: each rank's queries attend to the whole window's keys and values, all-gathered over the
cp group once per layer (torchtitan's current design), in ONE SDPA call with an explicit mask built
from the tokens' positions (and documents, for block_causal). One call means no partial outputs or
log-sum-exps to merge across ranks, so the merge precision hazard of ring attention (pytorch#156012)
does not arise; the softmax runs inside one kernel with its own fp32 accumulation. What is left to
decide is the dtype in which the key/value gradients of the cp ranks are summed in backward (the
reduce-scatter of the all-gather): the precision plan's `cp_reduce_dtype` (fp32 by default).

This runs on CPU/gloo and CUDA/nccl alike; torch's experimental CP is not used: its SDPA handlers
cover the CUDA flash / efficient / cuDNN ops only (no CPU, no masks, so no block_causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from torchtitan_amp.torch_compat import sequence_collectives

_ALL_GATHER, _REDUCE_SCATTER = sequence_collectives()


def head_tail_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions (in the window) rank `cp_rank` of `cp` holds, in the order it holds them:
    chunk r then chunk 2cp-1-r of 2cp equal chunks. [seq_len // cp] int64."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def check_seq_len(seq_len: int, cp: int, field: str = "training.seq_len") -> None:
    """The head-tail split needs 2 x cp equal chunks."""
    from torchtitan_amp.config import ConfigError

    if cp > 1 and seq_len % (2 * cp):
        raise ConfigError(f"'{field}' = {seq_len} must be divisible by 2 x context_parallel_degree = "
                          f"{2 * cp} (each cp rank holds two of 2 x cp equal chunks of a sequence)")


@dataclass(frozen=True)
class BatchSharder:
    """A loader batch -> what this rank's model sees: the mask inputs (document ids) computed on the
    whole window first, then inputs, labels and every keyword input cut to this cp rank's chunks,
    plus `positions` (the tokens' places in the window, for rotary embeddings and the mask).
    With cp = 1 only the mask inputs are added."""

    mask_inputs: object  # models.attention.MaskInputs: tokens -> {"doc_ids": ...} or {}
    cp: int = 1
    cp_rank: int = 0

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        extra = self.mask_inputs(inputs)
        if self.cp == 1:
            return inputs, labels, extra
        keep = head_tail_positions(inputs.shape[1], self.cp, self.cp_rank, inputs.device)
        extra = {name: value.index_select(1, keep) for name, value in extra.items()}
        # One row per sample, not one shared row: pipeline parallel splits keyword inputs on dim 0.
        extra["positions"] = keep.expand(inputs.shape[0], -1)
        return inputs.index_select(1, keep), labels.index_select(1, keep), extra


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim; backward sums every rank's gradient of the gathered
    tensor and hands each rank its own slice (a reduce-scatter), in `reduce_dtype`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype, ctx.dtype = group, reduce_dtype, x.dtype
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Summing the ranks' partial gradients in fp32 rounds once, at the end; in bf16 every
        # partial sum rounds, an error that grows with the cp degree.
        summed = _REDUCE_SCATTER(grad.to(ctx.reduce_dtype).transpose(0, 1).contiguous(), "sum", 0, ctx.group)
        return funcol.wait_tensor(summed).transpose(0, 1).to(ctx.dtype), None, None


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, s, ...] on each rank -> [B, cp x s, ...], rank 0's part first."""
    gathered = _ALL_GATHER(x.transpose(0, 1).contiguous(), 0, group)
    return funcol.wait_tensor(gathered).transpose(0, 1)


@dataclass(frozen=True)
class ContextParallel:
    """This rank's cp group, held by the model's attention (set by parallelize.apply_cp)."""

    group: dist.ProcessGroup
    reduce_dtype: torch.dtype = torch.float32

    def gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [B, s, H, D] -> the whole window's [B, cp x s, H, D] (differentiable)."""
        return _GatherSequence.apply(x, self.group, self.reduce_dtype)

    def gather_ids(self, x: torch.Tensor) -> torch.Tensor:
        """Positions or document ids [B, s] -> [B, cp x s], in the order gather_kv lays keys out."""
        return _all_gather(x, self.group)


def attention_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, doc_q: torch.Tensor | None = None,
                   doc_k: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Sq] query and [B, Sk] key positions (and documents) -> [B, 1, Sq, Sk] bool: a query may
    attend to keys at or before its position (in its own document). Every query sees itself."""
    mask = pos_k[:, None, :] <= pos_q[:, :, None]
    if doc_q is not None:
        mask &= doc_k[:, None, :] == doc_q[:, :, None]
    return mask[:, None]
