"""A parameter's local size, split the way torch splits it: torch.chunk rows on TP's sharded dim,
then FSDP2's dim-0 chunks (and their padding to a multiple of the shard degree)."""

from __future__ import annotations

import math

from torchtitan_amp.memory.specs import ParamSpec


def chunk_size(n: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk-style splitting n rows into `parts`."""
    per = -(-n // parts)
    return max(0, min(per, n - index * per))


def tp_local_shape(spec: ParamSpec, tp: int, tp_rank: int = 0) -> tuple[int, ...]:
    if tp == 1 or spec.tp_dim is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] = chunk_size(shape[spec.tp_dim], tp, tp_rank)
    return tuple(shape)


def _rest(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def fsdp_local_numel(shape: tuple[int, ...], shards: int, rank: int) -> int:
    """Elements of this rank's FSDP shard (dim 0, torch.chunk rows, unpadded)."""
    return chunk_size(shape[0], shards, rank) * _rest(shape)


def fsdp_padded_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one padded shard: FSDP2 pads dim 0 to a multiple of the shard degree."""
    return -(-shape[0] // shards) * _rest(shape)
