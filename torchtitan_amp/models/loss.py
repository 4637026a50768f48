"""The training loss and its normalisation: the cross-entropy summed over the valid labels (those
not IGNORE_INDEX) and divided by the step's global count of them, whatever the layout.

One process's loss is the mean over every valid label of the step's global batch. A layout splits
that batch over data-parallel ranks, context-parallel chunks, accumulation micro-batches and
pipeline microbatches, with different counts of valid labels in each part; dividing each part by
its own count (a per-part mean) would weigh a label on a part with few valid labels more. So every
part's loss is its cross-entropy sum times `label_weight(N, G)` = G / N, N the step's count over
all parts (all-reduced on the device before the first backward), G the ranks whose gradients the
data-parallel wrappers average (docs/parallelisms.md, "Loss normalisation").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Labels the loss skips (torch's and torchtitan's value): they count nowhere, not even in the mean.
IGNORE_INDEX = -100


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy on fp32 logits, whatever dtype the model produced them in, over the labels
    that are not IGNORE_INDEX. Training takes the sum and divides by the step's global count
    (`label_weight`); "mean" divides by this batch's own count (NaN when it has none).

    Args:
        logits: [B, S, vocab] in any dtype (upcast to fp32).
        labels: [B, S] target ids, IGNORE_INDEX where nothing is predicted.
        reduction: "mean" (over this batch's counted labels) or "sum".
    """
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def count_valid_labels(labels: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """The labels that are not IGNORE_INDEX in `labels`, summed over `group`: an int64 device
    tensor, never read on the host (the all-reduce is a collective, not a sync)."""
    count = torch.stack([(y != IGNORE_INDEX).sum() for y in labels]).sum()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def label_weight(count: torch.Tensor, grad_mean_size: int) -> torch.Tensor:
    """What each valid label's cross-entropy is multiplied by so that one step's gradients equal
    one process's mean over all `count` valid labels: 1 / count, times `grad_mean_size`, the
    ranks over which FSDP / DDP / HSDP (and EP's experts, by their divide factor) average the
    gradients, which undoes that mean. A step without any valid label weighs its (zero) losses by
    1 / 1, not 0 / 0."""
    return grad_mean_size / count.clamp(min=1).float()
