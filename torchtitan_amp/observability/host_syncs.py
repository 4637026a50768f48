"""Host syncs, counted where a CPU run can see them: the reads and ops that would make the host
wait for a GPU's stream, whatever device the code runs on.

On CUDA these stall the stream (the host waits for every queued kernel): a device -> host scalar
read (`.item()`, `bool(t)`, `float(t)`, `int(t)`: `aten._local_scalar_dense`), `.tolist()`, a
copy between host and device without non_blocking (either way), and the ops whose output size
depends on the data (`nonzero`, `bincount`, `unique`, `masked_select`, boolean-mask indexing,
`repeat_interleave` without `output_size`, `equal`). On a CPU they cost nothing, which is why they
are counted instead: the ops at the dispatcher (a TorchDispatchMode), `.tolist()` at the Python API (on a CPU tensor it
reads memory without dispatching an op).

    with HostSyncs() as syncs:
        trainer.train_step(batches)
    syncs.total, syncs.counts  # 1, Counter({"_local_scalar_dense": 1})

Sort, argsort, topk, scatter_add, cumsum and a `repeat_interleave` given its `output_size` do not
sync. Ops that DTensor or a compiled graph run inside themselves are not seen one by one: a
compiled region's syncs are graph breaks instead (torch._dynamo.explain shows them).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose output size is read from the data: a CUDA kernel has to return it to the host first.
SIZE_READING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "bincount",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "masked_select",
        "equal",
    }
)


_host = threading.local()


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Reads that are not the training step's own, left out of every count: host data by design
    (the data loader's permutation and token windows, before their copy to the device, wait for
    no device) and a test's own evidence taken inside a step."""
    _host.depth = getattr(_host, "depth", 0) + 1
    try:
        yield
    finally:
        _host.depth -= 1


def _is_uncounted() -> bool:
    return getattr(_host, "depth", 0) > 0


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def sync_name(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name under which the dispatcher op `func` called with `args` counts as a host sync, or
    None when it does not sync.

    Args:
        func: the dispatcher op (an OpOverload).
        args: its positional arguments.
        kwargs: its keyword arguments.
    """
    name = func.overloadpacket.__name__
    if name in SIZE_READING_OPS:
        return name
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor):
        # The Tensor overloads: without output_size the kernel sums the repeats on the host.
        size = kwargs.get("output_size", args[2] if len(args) > 2 else None)
        return None if size is not None else "repeat_interleave_without_output_size"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and _has_bool_index(args[1]):
        if name != "index" and _masked_fill(args, kwargs):
            return None
        return f"{name}_with_bool_mask"  # a mask is turned into indices by nonzero
    if name in ("_to_copy", "copy_") and _blocking_host_copy(name, args, kwargs):
        return "blocking_host_device_copy"
    return None


def _masked_fill(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """index_put_ that ATen runs as masked_fill_ (no nonzero): one bool mask on self's device, a
    one-element host value (`t[mask] = 0`), no accumulation; e.g. DTensor's vocab-parallel
    embedding masks its out-of-shard token ids this way."""
    self, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    masks = [i for i in indices if i is not None]
    return (
        not accumulate
        and len(masks) == 1
        and masks[0].device == self.device
        and isinstance(values, torch.Tensor)
        and values.numel() == 1
        and values.device.type == "cpu"
    )


def _blocking_host_copy(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy between host memory and an accelerator without non_blocking: on CUDA the host waits
    for the stream, in either direction."""
    src = args[1] if name == "copy_" else args[0]
    dst = args[0].device if name == "copy_" else kwargs.get("device")
    if not isinstance(src, torch.Tensor) or dst is None:
        return False
    kinds = {src.device.type, torch.device(dst).type}
    blocking = not (args[2] if name == "copy_" and len(args) > 2 else kwargs.get("non_blocking", False))
    return "cpu" in kinds and len(kinds - {"cpu", "meta"}) == 1 and blocking


class _OpSyncs(TorchDispatchMode):
    """The dispatcher half: counts each syncing op into `counts`."""

    def __init__(
        self, counts: Counter[str], where: list[str] | None, host_tensors: Callable[[], Collection[int]] | None = None
    ) -> None:
        super().__init__()
        self.counts, self.where, self.host_tensors = counts, where, host_tensors
        self.paused = 0  # inside a .tolist() counted already: its copy to the host is part of it

    def add(self, name: str) -> None:
        if _is_uncounted():
            return
        self.counts[name] += 1
        if self.where is not None:
            self.where.append(f"{name} at {_caller()}")

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = sync_name(func, args, kwargs)
        if name == "_local_scalar_dense" and self.host_tensors is not None and id(args[0]) in self.host_tensors():
            name = None  # a tensor kept on the host on every device: its read waits for nothing
        if name is not None and not self.paused:
            self.add(name)
        return func(*args, **kwargs)


def _caller() -> str:
    """The innermost frame of the calling Python code outside torch (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} {frame.name}"
    return "?"


def _counting_tolist(ops: _OpSyncs, tolist: Any) -> Any:
    """Tensor.tolist that counts itself: no dispatcher op on a CPU tensor (a copy to the host on
    CUDA, counted here instead). Patched on the class, not a TorchFunctionMode: such a mode is not
    active in an activation-checkpoint recompute, which runs inside backward."""

    def counted(self: torch.Tensor) -> Any:
        ops.add("tolist")
        ops.paused += 1
        try:
            return tolist(self)
        finally:
            ops.paused -= 1

    return counted


class HostSyncs:
    """Counts host syncs (see the module's docstring) while active; one instance at a time,
    usable around a step, a forward or a backward. With `where`, `self.where` lists each sync with
    the line of code outside torch that caused it (slower: a stack walk per sync). `host_tensors`
    gives the ids of tensors that live on the host whatever the device (a CPU run cannot tell
    them apart): their scalar reads are not counted."""

    def __init__(self, where: bool = False, host_tensors: Callable[[], Collection[int]] | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.where: list[str] | None = [] if where else None
        self._ops = _OpSyncs(self.counts, self.where, host_tensors)
        self._tolist: Any = None  # Tensor.tolist as it was before __enter__

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncs:
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = _counting_tolist(self._ops, self._tolist)  # type: ignore[method-assign]
        self._ops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ops.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]

    def reset(self) -> dict[str, int]:
        """The counts so far (a plain dict), then start again from zero."""
        seen = dict(self.counts)
        self.counts.clear()
        if self.where is not None:
            self.where.clear()
        return seen


def optimizer_step_counters(optimizer: Any) -> set[int]:
    """The ids of the optimizer's host-side step counters: torch keeps AdamW's `step` on the host
    for its foreach and for-loop kernels (not capturable) and reads it per parameter, which on
    CUDA waits for nothing (the fused kernel keeps it on the device and reads nothing)."""
    return {
        id(state["step"])
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"
    }


class StepSyncs:
    """Per training step of a Trainer (duck-typed: `train`, `train_step`, `step`): the host syncs
    inside `train_step` (the step's compute: forward, backward, clipping, optimizer) and in the
    whole loop iteration (that plus the log, validation, the stop poll and a checkpoint save).
    `install` before `train()`, `finish` after it (it closes the last step); then for each
    counted step s, `steps[s]` =
    {"train_step": n, "loop": m, "syncs": {op: n in train_step}, "where": [...] (where=True)}.
    `only` names the steps to count (None: all): the counting mode slows every op it sees."""

    def __init__(self, only: set[int] | None = None, where: bool = False) -> None:
        self.only, self.where = only, where
        self.steps: dict[int, dict[str, Any]] = {}
        self._open: tuple[int, HostSyncs] | None = None  # the step being counted, its counter

    def install(self, trainer: Any) -> None:
        """Wrap this trainer's train_step (an instance attribute: the class is untouched)."""
        train_step = trainer.train_step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            self._close()
            if self.only is not None and trainer.step not in self.only:
                return train_step(*args, **kwargs)
            syncs = HostSyncs(where=self.where, host_tensors=lambda: optimizer_step_counters(trainer.run.optimizer))
            self._open = (trainer.step, syncs)
            syncs.__enter__()  # left at the next step's start (or the end of train): the loop's
            try:
                return train_step(*args, **kwargs)
            finally:
                record = {"train_step": syncs.total, "syncs": dict(syncs.counts)}
                if syncs.where is not None:
                    record["where"] = list(syncs.where)
                self.steps[trainer.step] = record

        trainer.train_step = counted_step

    def finish(self) -> None:
        """After train(): the last counted step's loop total."""
        self._close()

    def _close(self) -> None:
        """The open step's loop total: everything counted since its train_step began."""
        if self._open is not None:
            step, syncs = self._open
            syncs.__exit__(None, None, None)
            self.steps[step]["loop"] = syncs.total
            self._open = None
