"""The data-parallel-aware, resumable loader every dataset kind is served through."""

from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_amp.data import text
from torchtitan_amp.data.index import open_split
from torchtitan_amp.data.packed import PackedTextDataset, Sample
from torchtitan_amp.data.tokens import TokenWindowDataset
from torchtitan_amp.errors import DataError
from torchtitan_amp.tokenizer import Tokenizer


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto `device`. On CUDA from pinned memory with non_blocking=True: a copy from
    pageable memory first waits for everything queued on the stream (CUDA's rule for pageable
    sources), which would drain the GPU once per micro-batch. The trainer's loader pins already
    (build_dataloader's pin_memory); pinning here covers batches from anywhere else. The pinned
    block is not reused before the copy is done: torch's host allocator records the copy's stream."""
    if device.type != "cuda":
        return t.to(device)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _stack_samples(samples: list[Sample]) -> Sample:
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


class ParallelAwareDataLoader(StatefulDataLoader):
    """StatefulDataLoader whose state is stored under this dp rank's key, as in torchtitan.

    Keying by rank lets a distributed checkpoint hold every rank's position side by side, and makes
    loading another rank's (or another dp world size's) state fail loudly instead of replaying data.
    """

    def __init__(self, dataset: PackedTextDataset | TokenWindowDataset, dp_rank: int, dp_world_size: int,
                 batch_size: int, num_workers: int = 0, pin_memory: bool = False) -> None:
        if batch_size < 1:
            raise DataError(f"local_batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise DataError(f"num_workers must be >= 0, got {num_workers}")
        if isinstance(dataset, TokenWindowDataset):
            # The dataset builds whole batches (one vectorised gather), so no collation here.
            super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
        elif num_workers:
            raise DataError("num_workers > 0 needs a 'tokens:' dataset (pydoc and path: are tokenised in memory "
                            "and every worker would repeat the same samples)")
        else:
            super().__init__(dataset, batch_size=batch_size, num_workers=0, collate_fn=_stack_samples,
                             pin_memory=pin_memory)
        self._packed = dataset
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self._rank_key = f"dp_rank_{dp_rank}"

    @property
    def epoch(self) -> int:
        """Epoch of the most recently loaded sample; a loaded state shows here once iteration resumes."""
        if isinstance(self._packed, TokenWindowDataset) and self.num_workers:
            # The dataset advances in the workers; the batches this loader yielded tell the epoch.
            return self._packed.epoch_after(self._iterator._num_yielded if self._iterator is not None else 0)
        return self._packed.epoch

    @property
    def num_windows_per_epoch(self) -> int:
        """Samples this rank sees per epoch (the same on every rank)."""
        return self._packed.num_windows_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_key: super().state_dict(), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # An empty state means "start from the beginning" (e.g. a checkpoint without data state).
        if not state_dict:
            return
        if state_dict.get("world_size") != self.dp_world_size:
            raise DataError(
                f"dataloader state was saved with dp world_size {state_dict.get('world_size')}, "
                f"but this run has {self.dp_world_size}; resharding data state is not supported"
            )
        if self._rank_key not in state_dict:
            saved = sorted(k for k in state_dict if k.startswith("dp_rank_"))
            raise DataError(f"dataloader state has no '{self._rank_key}' entry (found: {', '.join(saved) or 'none'})")
        super().load_state_dict(state_dict[self._rank_key])


def build_dataloader(
    dataset: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> ParallelAwareDataLoader:
    """Yields (inputs, labels), both int64 [local_batch_size, seq_len], forever.

    `dataset` is 'pydoc', 'path:<file or folder>' (tokenised in memory here) or
    'tokens:<folder>[:split]' (prepared shards, memory-mapped; data/index.py says what is checked).
    `pin_memory` (CUDA only): batches come in page-locked memory, for non-blocking copies (to_device)."""
    if dataset.startswith("tokens:"):
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
            raise DataError(
                f"dp_rank must be in [0, dp_world_size), got dp_rank={dp_rank}, dp_world_size={dp_world_size}"
            )
        if local_batch_size < 1:
            raise DataError(f"local_batch_size must be >= 1, got {local_batch_size}")
        split = open_split(dataset, tokenizer)
        windows = TokenWindowDataset(split, seq_len, local_batch_size, dp_rank, dp_world_size, seed)
        return ParallelAwareDataLoader(windows, dp_rank, dp_world_size, local_batch_size, num_workers, pin_memory)
    tokens = text.corpus_tokens(dataset, tokenizer)
    packed = PackedTextDataset(tokens, seq_len, dp_rank, dp_world_size, seed)
    return ParallelAwareDataLoader(packed, dp_rank, dp_world_size, local_batch_size, num_workers, pin_memory)
