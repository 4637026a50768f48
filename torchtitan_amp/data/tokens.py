"""`tokens:<folder>[:split]`: seq_len + 1 windows drawn from memory-mapped token shards.

The shards are one token stream (in index order) cut into non-overlapping windows, as the in-memory
path cuts its tensor. The run's sample i is window order_e(i mod N), e = i // N, where order_e is
a keyed Feistel permutation of epoch e: computed per position, so no rank ever holds an O(corpus)
permutation (25M windows of a 50 GB corpus would be 200 MB per rank and per loader worker). Rank r
of R takes samples start + r, start + r + R, ... like PackedTextDataset (so every global batch is a
contiguous block of the run's samples, and any R can resume from a sample count); this rank's
stream is cut into batches, and loader worker k of K builds batches k, k + K, ...: the
StatefulDataLoader takes batches round-robin, so the batches are the same whatever num_workers is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data.index import TokenSplit

Batch = tuple[torch.Tensor, torch.Tensor]
_M64 = (1 << 64) - 1
_ROUNDS = 6


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer on uint64 arrays (numpy wraps on overflow, as intended here).
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class WindowOrder:
    """A seeded permutation of range(n), evaluated at any positions in O(1) memory each.

    A balanced Feistel network is a bijection on [0, 4^h) for any round function; cycle-walking
    (re-applying it to values >= n) restricts it to a bijection on [0, n)."""

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        base = _splitmix64(_splitmix64(seed & _M64) ^ epoch)
        self.keys = [np.uint64(_splitmix64(base ^ r)) for r in range(_ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._feistel(positions.astype(np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._feistel(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


class TokenWindowDataset(IterableDataset):
    """Infinite stream of (inputs, labels) batches, int64 [batch_size, seq_len], from token shards.

    Shards are opened (np.memmap) on first use in each process, so building the dataset reads
    nothing and loader workers open their own maps instead of inheriting pickled ones."""

    def __init__(
        self, split: TokenSplit, seq_len: int, batch_size: int, dp_rank: int, dp_world_size: int, seed: int
    ) -> None:
        window = seq_len + 1
        needed = dp_world_size * window
        if split.num_tokens < needed:
            raise DataError(
                f"{split.index_path} ({split.split}) has {split.num_tokens} tokens but needs at least "
                f"{needed} (dp_world_size {dp_world_size} x (seq_len {seq_len} + 1))"
            )
        self._split = split
        self._paths = [str(s.path) for s in split.shards]
        self._offsets = np.cumsum([0] + [s.num_tokens for s in split.shards])
        self._window = window
        self._batch_size = batch_size
        self._dp_rank, self._dp_world_size, self._seed = dp_rank, dp_world_size, seed
        self.num_windows = split.num_tokens // window
        self.num_windows_per_epoch = self.num_windows // dp_world_size  # per rank, for whole-split passes
        self.start = 0  # the run's sample index this rank's stream is counted from
        self._batches = 0  # batches this process (worker) has produced since `start`
        self._maps: list[np.memmap | None] = [None] * len(self._paths)
        self._orders: dict[int, WindowOrder] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self._paths)
        state["_orders"] = {}
        return state

    def global_sample(self, t: int) -> int:
        """The run's sample index of this rank's t-th sample since `start`."""
        return self.start + t * self._dp_world_size + self._dp_rank

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced sample, when this process produces them (no workers)."""
        return self.global_sample(self._batches * self._batch_size - 1) // self.num_windows if self._batches else 0

    def restart(self, start: int) -> None:
        self.start, self._batches = start, 0

    def _order(self, epoch: int) -> WindowOrder:
        if epoch not in self._orders:
            self._orders = {epoch: WindowOrder(self.num_windows, self._seed, epoch)}
        return self._orders[epoch]

    def _shard(self, i: int) -> np.memmap:
        shard = self._maps[i]
        if shard is None:
            shard = self._maps[i] = np.memmap(self._paths[i], dtype=self._split.dtype, mode="r")
        return shard

    def _tokens(self, start: int) -> np.ndarray:
        """Tokens [start, start + window) of the stream, across shard ends where needed."""
        pieces, end = [], start + self._window
        i = int(np.searchsorted(self._offsets, start, side="right")) - 1
        while start < end:
            stop = min(end, int(self._offsets[i + 1]))
            pieces.append(self._shard(i)[start - self._offsets[i] : stop - self._offsets[i]])
            start, i = stop, i + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def batch(self, j: int) -> Batch:
        """Batch j of this rank's stream: its samples j*B ... j*B + B - 1 since `start`."""
        local = np.arange(j * self._batch_size, (j + 1) * self._batch_size, dtype=np.int64)
        epochs, positions = np.divmod(self.start + local * self._dp_world_size + self._dp_rank, self.num_windows)
        windows = np.empty_like(local)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            windows[chosen] = self._order(int(epoch))(positions[chosen])
        out = np.empty((self._batch_size, self._window), dtype=np.int64)
        for row, window in enumerate(windows):
            out[row] = self._tokens(int(window) * self._window)
        tokens = torch.from_numpy(out)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        while True:
            j = worker + self._batches * workers
            self._batches += 1
            yield self.batch(j)
