"""The data-parallel-aware, resumable loader every dataset kind is served through."""

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_amp.core.errors import DataError
from torchtitan_amp.data import text
from torchtitan_amp.data.index import open_split
from torchtitan_amp.data.packed import PackedTextDataset, Sample
from torchtitan_amp.data.tokenizer import Tokenizer
from torchtitan_amp.data.tokens import Batch, TokenWindowDataset
from torchtitan_amp.models.attention import remember_host_copy
from torchtitan_amp.observability.host_syncs import uncounted


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto `device`. On CUDA from pinned memory with non_blocking=True: a copy from
    pageable memory first waits for everything queued on the stream (CUDA's rule for pageable
    sources), which would drain the GPU once per micro-batch. The trainer's loader pins already
    (build_dataloader's pin_memory); pinning here covers batches from anywhere else. The pinned
    block is not reused before the copy is done: torch's host allocator records the copy's stream.
    The copy keeps `t` (models.attention.remember_host_copy): document ids and the BlockMask cache
    key are then computed from the host batch, with no device sync."""
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    if device.type != "cuda":
        return remember_host_copy(t.to(device), t)
    if not t.is_pinned():
        t = t.pin_memory()
    return remember_host_copy(t.to(device, non_blocking=True), t)


@contextlib.contextmanager
def _no_set_vital_warning() -> Iterator[None]:
    """torchdata's StatefulDataLoader.__init__ calls torch.set_vital, which torch 2.13 deprecates
    with a UserWarning that every run would print and no user can act on; only that warning is
    silenced, only around the constructor."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"'set_vital' is deprecated", category=UserWarning)
        yield


def _stack_samples(samples: list[Sample]) -> Sample:
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


class ParallelAwareDataLoader(StatefulDataLoader):
    """StatefulDataLoader whose state is the run's global data position: samples consumed over all
    data-parallel ranks (the datasets' docstrings give the order). Every rank yields the same number
    of batches, so the position is `start` + batches yielded x B x R on every rank, exact whatever
    the worker count (prefetched batches are not counted), and any R can resume from it.
    """

    def __init__(
        self,
        dataset: PackedTextDataset | TokenWindowDataset,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        samples_per_step: int = 0,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"local_batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise DataError(f"num_workers must be >= 0, got {num_workers}")
        if num_workers and not isinstance(dataset, TokenWindowDataset):
            raise DataError(
                "num_workers > 0 needs a 'tokens:' dataset (pydoc, path: and chat: are tokenised in memory "
                "and every worker would repeat the same samples)"
            )
        with _no_set_vital_warning():
            if isinstance(dataset, TokenWindowDataset):
                # The dataset builds whole batches (one vectorised gather), so no collation here.
                super().__init__(dataset, batch_size=None, num_workers=num_workers, pin_memory=pin_memory)
            else:
                super().__init__(
                    dataset, batch_size=batch_size, num_workers=0, collate_fn=_stack_samples, pin_memory=pin_memory
                )
        self._packed = dataset
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.local_batch_size = batch_size
        self.seed = seed
        # Sequences per optimizer step over all ranks (the trainer's global batch); a resume with
        # another value continues from the same sample but cuts the steps elsewhere.
        self.samples_per_step = samples_per_step or batch_size * dp_world_size
        self._yielded = 0  # batches handed out since the dataset's `start`
        self.resume_note = ""  # what the last load_state_dict changed, for the manager to log once

    @property
    def samples(self) -> int:
        """The run's samples consumed so far, over all data-parallel ranks."""
        return self._packed.start + self._yielded * self.local_batch_size * self.dp_world_size

    @property
    def epoch(self) -> int:
        """Epoch of the most recently loaded sample of this rank (0 before the first)."""
        if not self._yielded:
            return 0
        return self._packed.global_sample(self._yielded * self.local_batch_size - 1) // self._packed.num_windows

    @property
    def num_windows_per_epoch(self) -> int:
        """Samples one rank sees in a pass over the split (the same on every rank)."""
        return self._packed.num_windows_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        # A new iterator continues from the position (new workers start from `start`); batches an
        # earlier iterator prefetched but never handed out are dropped, as they were never counted.
        # The base iterator is made here, not at the first next(): making it draws a seed from the
        # global RNG, which callers fence with fork_rng around iter().
        self._packed.restart(self.samples)
        self._yielded = 0
        self.next_iter_state = None
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        while True:
            # Host tensors (the permutation, the token windows): no read here waits for a device.
            with uncounted():
                batch = next(batches, None)
            if batch is None:
                return
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.dp_world_size,
            "position": {
                "samples": self.samples,
                "epoch": self.epoch,
                "windows": self._packed.num_windows,
                "seed": self.seed,
                "samples_per_step": self.samples_per_step,
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # An empty state means "start from the beginning" (e.g. a checkpoint without data state).
        if not state_dict:
            return
        position = state_dict.get("position")
        if not isinstance(position, dict):
            raise DataError(
                f"dataloader state needs a 'position' (the global data position), got keys {sorted(state_dict)}"
            )
        self._packed.restart(self._check_position(position, state_dict.get("world_size")))
        self._yielded = 0

    def _check_position(self, position: dict[str, Any], saved_world: Any) -> int:
        windows, samples = position.get("windows"), position.get("samples")
        if not isinstance(samples, int) or samples < 0:
            raise DataError(f"dataloader state needs int 'samples' >= 0, got {position!r}")
        if windows != self._packed.num_windows:
            raise DataError(
                f"dataloader state was saved over {windows} windows but this run's dataset has "
                f"{self._packed.num_windows} (another dataset or seq_len?)"
            )
        notes = []
        if saved_world != self.dp_world_size:
            notes.append(f"saved on {saved_world} data-parallel ranks, now {self.dp_world_size}")
        if position.get("samples_per_step") != self.samples_per_step:
            notes.append(
                f"global batch was {position.get('samples_per_step')} sequences, now "
                f"{self.samples_per_step}: steps from here cut the sample stream differently "
                "from the straight run"
            )
        if position.get("seed") != self.seed:
            notes.append(f"seed was {position.get('seed')}, now {self.seed}: the order from here differs")
        self.resume_note = (
            (f"data resumes at sample {samples} (epoch {position.get('epoch')}); " + "; ".join(notes)) if notes else ""
        )
        return samples


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
    samples_per_step: int = 0,
) -> ParallelAwareDataLoader:
    """A data loader yielding (inputs, labels), both int64 [local_batch_size, seq_len], forever.

    Args:
        dataset: 'pydoc', 'path:<file or folder>' (tokenised in memory here),
            'tokens:<folder>[:split]' (prepared shards, memory-mapped; data/index.py says what is
            checked) or 'chat:<file.jsonl>' (conversations, loss on assistant tokens: data/chat.py).
        tokenizer: the tokenizer that makes (or made) the ids.
        seq_len: tokens per sequence.
        local_batch_size: sequences per batch on this rank.
        dp_rank: this rank's data-parallel index, 0 .. dp_world_size - 1 (which share of the data it reads).
        dp_world_size: the data-parallel degree.
        seed: the seed of the sequence order.
        num_workers: background worker processes loading batches (0: in the training process).
        pin_memory: CUDA only: batches come in page-locked memory, for non-blocking copies (to_device).
        samples_per_step: sequences per optimizer step over all ranks (0: one batch per rank), saved
            with the position so that a resume with another global batch says so.
    """
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
        return ParallelAwareDataLoader(
            windows, dp_rank, dp_world_size, local_batch_size, num_workers, pin_memory, seed, samples_per_step
        )
    if dataset.startswith("chat:"):
        from torchtitan_amp.data.chat import ChatWindows, chat_windows

        stream, trained = chat_windows(dataset, tokenizer, seq_len)
        packed: PackedTextDataset = ChatWindows(stream, trained, seq_len, dp_rank, dp_world_size, seed)
        return ParallelAwareDataLoader(
            packed, dp_rank, dp_world_size, local_batch_size, num_workers, pin_memory, seed, samples_per_step
        )
    tokens = text.corpus_tokens(dataset, tokenizer)
    packed = PackedTextDataset(tokens, seq_len, dp_rank, dp_world_size, seed)
    return ParallelAwareDataLoader(
        packed, dp_rank, dp_world_size, local_batch_size, num_workers, pin_memory, seed, samples_per_step
    )
