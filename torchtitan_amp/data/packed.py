"""Packed windows over an in-memory token tensor (the `pydoc` / `path:` datasets)."""

from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

from torchtitan_amp.core.errors import DataError

Sample = tuple[torch.Tensor, torch.Tensor]


class PackedTextDataset(IterableDataset):
    """Infinite stream of (input, label) windows of `seq_len` tokens, for one data-parallel rank.

    The token stream is cut into N non-overlapping windows of seq_len + 1 tokens. The run's sample
    i is window perm_e[i mod N] with e = i // N and perm_e a permutation drawn from a generator
    seeded with seed + e: a function of (seed, e, i) alone, whatever the layout. Rank r of R takes
    samples start + r, start + r + R, ...: batched by B, every global batch of G = B x R samples is
    the contiguous block [start + kG, start + (k+1)G), which is what lets another R resume from
    `start` = samples consumed (data/loader.py) with exactly the windows a straight run would use.
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
        self.num_windows = tokens.numel() // window
        self.num_windows_per_epoch = self.num_windows // dp_world_size  # per rank, for whole-split passes
        self.start = 0  # the run's sample index this rank's stream is counted from
        self._produced = 0  # samples this rank has produced since `start`
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def global_sample(self, t: int) -> int:
        """The run's sample index of this rank's t-th sample since `start`."""
        return self.start + t * self._dp_world_size + self._dp_rank

    @property
    def epoch(self) -> int:
        """Epoch of the most recently produced sample (0 before the first)."""
        return self.global_sample(self._produced - 1) // self.num_windows if self._produced else 0

    def restart(self, start: int) -> None:
        self.start, self._produced = start, 0

    def _window_of(self, i: int) -> int:
        epoch, position = divmod(i, self.num_windows)
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(self._seed + epoch)
            self._perm = torch.randperm(self.num_windows, generator=generator)
            self._perm_epoch = epoch
        return int(self._perm[position])

    def _next_sample(self) -> Sample:
        start = self._window_of(self.global_sample(self._produced)) * self._window
        # Advance before returning so a state taken now resumes with the following sample.
        self._produced += 1
        window = self._tokens[start : start + self._window].to(torch.int64)
        return window[:-1], window[1:]

    def __iter__(self) -> Iterator[Sample]:
        # All progress lives on the dataset (not in the generator), which the loader counts from.
        while True:
            yield self._next_sample()
