"""A parameter's local size, split the way torch splits it: torch.chunk rows on TP's sharded dim,
then FSDP2's dim-0 chunks (and their padding to a multiple of the shard degree)."""

from __future__ import annotations

import math

from torchtitan_amp.memory.specs import Layout, ParamSpec


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk-style splitting n rows into `parts`.

    Args:
        n: the rows split.
        parts: how many chunks (the shard degree).
        index: which chunk, from 0; past the last non-empty chunk the result is 0.
    """
    per = -(-n // parts)
    return max(0, min(per, n - index * per))


def tp_local_shape(spec: ParamSpec, tp: int, tp_rank: int = 0) -> tuple[int, ...]:
    """The shape of a parameter's tensor-parallel shard on one rank (torch.chunk-style along the
    spec's tp_dim; the whole shape when tp is 1 or the parameter is not split).

    Args:
        spec: the parameter: its full shape and the dim TP splits (None: replicated).
        tp: the tensor-parallel degree.
        tp_rank: the tensor-parallel rank whose shards are counted (uneven shards: rank 0's are the
            largest).
    """
    if tp == 1 or spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], tp, tp_rank)
    return tuple(shape)


def _rest(shape: tuple[int, ...], dim: int) -> int:
    return math.prod(shape) // shape[dim] if shape[dim] else 0


def fsdp_local_numel(shape: tuple[int, ...], shards: int, rank: int, dim: int = 0) -> int:
    """Elements of this rank's FSDP shard (torch.chunk slices of `dim`, unpadded).

    Args:
        shape: the parameter's TP-local shape.
        shards: the FSDP shard degree.
        rank: this rank's index among the shards, from 0.
        dim: the dim FSDP splits (0; 1 for EP-split expert weights).
    """
    return chunk_size(shape[dim], shards, rank) * _rest(shape, dim)


def fsdp_padded_numel(shape: tuple[int, ...], shards: int, dim: int = 0) -> int:
    """Elements of one padded shard: FSDP2 pads `dim` to a multiple of the shard degree.

    Args:
        shape: the parameter's TP-local shape.
        shards: the FSDP shard degree.
        dim: the dim FSDP splits (0; 1 for EP-split expert weights).
    """
    return -(-shape[dim] // shards) * _rest(shape, dim)


def fsdp_split(spec: ParamSpec, shape: tuple[int, ...], layout: Layout) -> tuple[tuple[int, ...], int, int]:
    """(what FSDP shards, over how many ranks, along which dim) for a parameter whose TP-local
    shape is `shape`: an EP-split expert weight keeps E / ep experts and is sharded on dim 1 over
    efsdp (dim 0 is EP's already: a second split of it would be a strided layout); every other
    parameter on dim 0 over dp_shard x cp.

    Args:
        spec: the parameter (whether it is a routed expert's weight).
        shape: its TP-local shape.
        layout: the parallel layout: dp_replicate, dp_shard, tp, pp, cp and ep degrees, the batch
            and sequence, the pipeline schedule and activation checkpointing.
    """
    if spec.expert and layout.ep > 1:
        return (shape[0] // layout.ep, *shape[1:]), layout.efsdp, 1
    return shape, layout.fsdp_shard, 0


def efsdp_rank(layout: Layout, fsdp_rank: int) -> int:
    """A rank's index among the experts' FSDP shards: EP takes the innermost ranks of dp_shard x cp
    (ParallelDims.build_mesh unflattens it as (efsdp, ep))."""
    return fsdp_rank // layout.ep
