"""The pinned-memory stager of `checkpoint.async_mode = "async_with_pinned_mem"`: DCP's async_save
hands it the state dict, it copies every tensor into pinned host buffers, and the upload thread
writes those while training goes on.

One per run (Saver.pinned_stager): its host buffers are made, pinned and kept at the first save
(torch's StateDictStager, keyed by the source storage) and refilled by every later one; close()
frees them. torch's DefaultStager keeps them on 2.13 but drops them after every save on 2.11, so a
stager of our own behaves the same on both.

Stream order: the copies run in a thread of their own, on a staging stream. A stream does not wait
for another by itself, so before the thread starts the staging stream waits for the compute stream
(whatever the step queued there, the optimizer's update of the weights included, lands in the
copy; torch's DefaultStager leaves this out and copies whatever the weights hold when the copy
kernels happen to run). The thread synchronizes the staging stream before its future completes,
and the saver waits for that future before training goes on (Saver._async_save): the next step's
optimizer cannot write a tensor the copies still read.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager


def compute_stream() -> Any:
    """The stream the step's kernels were queued on (this thread's current one)."""
    return torch.accelerator.current_stream()


def staging_stream() -> Any:
    """A stream of the current accelerator for the copies, made on the main thread (a thread's
    own first use could otherwise take the compute stream); None without an accelerator."""
    return torch.Stream() if torch.accelerator.is_available() else None


class PinnedStager(AsyncStager):
    """DCP AsyncStager: stage() returns a future of the staged state dict (pinned host copies)."""

    _synchronize_after_execute = False  # the saver waits for the staging future itself

    def __init__(self, pin_memory: bool = True) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        self.copier = StateDictStager(pin_memory=pin_memory, share_memory=False)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-staging")
        self.stream = staging_stream()

    def stage(self, state_dict: Any, **kwargs: Any) -> Future:
        if self.stream is not None:
            self.stream.wait_stream(compute_stream())
        return self.executor.submit(self._copy, state_dict)

    def _copy(self, state_dict: Any) -> Any:
        if self.stream is None:
            return self.copier.stage(state_dict, non_blocking=False)
        with self.stream:
            staged = self.copier.stage(state_dict, non_blocking=True)
        self.stream.synchronize()  # the future completes once every copy has landed
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to do: the staging future completes when the copies have landed."""

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.copier.close()
