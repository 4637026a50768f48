"""Packed windows over an in-memory token tensor (the `pydoc` / `path:` datasets)."""

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from torchtitan_amp.errors import DataError

Sample = tuple[torch.Tensor, torch.Tensor]


class PackedTextDataset(IterableDataset):
    """Infinite stream of (input, label) windows of `seq_len` tokens, sharded by data-parallel rank.

    The token stream is cut into non-overlapping windows of seq_len + 1 tokens. Each epoch draws a
    permutation of all windows from a generator seeded with seed + epoch, identical on every rank;
    rank r takes permutation positions r, r + R, r + 2R, ... so ranks see disjoint windows, and the
    remainder is dropped so every rank gets the same number of windows per epoch.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, dp_rank: int, dp_world_size: int, seed: int) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise DataError(
                f"dp_rank must be in [0, dp_world_size), got dp_rank={dp_rank}, dp_world_size={dp_world_size}"
            )
        window = seq_len + 1
        needed = dp_world_size * window
        if tokens.numel() < needed:
            raise DataError(
                f"corpus has {tokens.numel()} tokens but needs at least {needed} "
                f"(dp_world_size {dp_world_size} x (seq_len {seq_len} + 1))"
            )
        self._tokens = tokens
        self._window = window
        self._dp_rank = dp_rank
        self._dp_world_size = dp_world_size
        self._seed = seed
        self._num_windows = tokens.numel() // window
        self.num_windows_per_epoch = self._num_windows // dp_world_size
        self._epoch = 0
        self._index = 0
        self._rank_windows_epoch = -1
        self._rank_windows = torch.empty(0, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced sample (0 before the first)."""
        return self._epoch

    def _windows_of_epoch(self, epoch: int) -> torch.Tensor:
        if epoch != self._rank_windows_epoch:
            generator = torch.Generator().manual_seed(self._seed + epoch)
            permutation = torch.randperm(self._num_windows, generator=generator)
            stop = self.num_windows_per_epoch * self._dp_world_size
            self._rank_windows = permutation[self._dp_rank : stop : self._dp_world_size]
            self._rank_windows_epoch = epoch
        return self._rank_windows

    def _next_sample(self) -> Sample:
        if self._index == self.num_windows_per_epoch:
            self._epoch += 1
            self._index = 0
        start = int(self._windows_of_epoch(self._epoch)[self._index]) * self._window
        # Advance before returning so a state_dict taken now resumes with the following sample.
        self._index += 1
        window = self._tokens[start : start + self._window].to(torch.int64)
        return window[:-1], window[1:]

    def __iter__(self) -> Iterator[Sample]:
        # All progress lives on the dataset (not in the generator), which is what state_dict saves.
        while True:
            yield self._next_sample()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        epoch, index = state_dict.get("epoch"), state_dict.get("index")
        if not isinstance(epoch, int) or not isinstance(index, int) or epoch < 0:
            raise DataError(f"dataset state needs int 'epoch' >= 0 and int 'index', got {state_dict!r}")
        if not 0 <= index <= self.num_windows_per_epoch:
            raise DataError(
                f"dataset state index {index} is outside [0, {self.num_windows_per_epoch}] windows per epoch "
                "(was it saved with a different dataset, seq_len or dp_world_size?)"
            )
        self._epoch = epoch
        self._index = index
