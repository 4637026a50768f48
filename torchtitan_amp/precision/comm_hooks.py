"""DDP gradient compression that honours lower_precision_safe_modules and works on gloo and nccl."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchtitan_amp.core.rules import dtype_name

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


@dataclass
class CompressHookState:
    group: dist.ProcessGroup | None
    dtype: torch.dtype
    low_precision_params: frozenset[int]
    # Bytes this rank put on the wire for gradients, by dtype name: what tests and benchmarks read.
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def comm_hook_state(plan: PrecisionPlan, model: nn.Module, group: dist.ProcessGroup | None) -> CompressHookState | None:
    """State for `compress_hook` on the DDP path, or None when gradients travel in fp32.

    Args:
        plan: the precision plan: its comm_hook, reduce_dtype and lower-precision-safe modules.
        model: the model DDP replicates, whose safe modules' gradients travel in reduce_dtype.
        group: the data-parallel process group the gradients are averaged over; None: the
            default group.
    """
    if plan.comm_hook == "none":
        return None
    low = {id(p) for m in model.modules() if plan.is_safe(m) for p in m.parameters(recurse=False)}
    return CompressHookState(group, plan.reduce_dtype, frozenset(low))


def _bucket_slices(bucket: dist.GradBucket) -> Iterator[tuple[int, int, int]]:
    """(parameter id, start, end) of each gradient inside the bucket's flat buffer."""
    buffer = bucket.buffer()
    base, size = buffer.data_ptr(), buffer.element_size()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        start = (g.data_ptr() - base) // size
        yield id(p), start, start + g.numel()


def _all_reduce_mean(flat: torch.Tensor, state: CompressHookState) -> torch.futures.Future:
    world = dist.get_world_size(state.group)
    flat.div_(world)
    state.bytes_sent[dtype_name(flat.dtype)] += flat.numel() * flat.element_size()
    return dist.all_reduce(flat, group=state.group, async_op=True).get_future()


def _gather(buffer: torch.Tensor, ranges: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    if len(ranges) == 1:
        start, end = ranges[0]
        return buffer[start:end].to(dtype, copy=True)
    return torch.cat([buffer[s:e] for s, e in ranges]).to(dtype)


def _scatter(buffer: torch.Tensor, ranges: list[tuple[int, int]], flat: torch.Tensor) -> None:
    offset = 0
    for start, end in ranges:
        buffer[start:end].copy_(flat[offset : offset + end - start])
        offset += end - start


# No annotations on purpose: DDP compares them to the real classes, and this module's postponed
# annotations are strings.
def compress_hook(state, bucket):  # type: ignore[no-untyped-def, unused-ignore]  # untyped: see above
    """All-reduce safe modules' gradients in `state.dtype`, the rest in fp32; return fp32.

    torch's bf16_compress_hook refuses non-NCCL backends by name and casts whole buckets, so it
    can neither run on gloo nor keep norm/embedding gradients in fp32.
    """
    buffer = bucket.buffer()
    ranges: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for pid, start, end in _bucket_slices(bucket):
        ranges[pid in state.low_precision_params].append((start, end))
    parts: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
    futures = []
    for low, dtype in ((True, state.dtype), (False, buffer.dtype)):
        if ranges[low]:
            flat = _gather(buffer, ranges[low], dtype)
            parts.append((ranges[low], flat))
            futures.append(_all_reduce_mean(flat, state))

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        # Inside a callback of an nccl future the current stream waits on that collective only;
        # wait() on each other future makes it wait on theirs too before the flat buffers are read.
        for fut in futures:
            fut.wait()
        for rngs, flat in parts:
            _scatter(buffer, rngs, flat)
        return buffer

    # Chained from a collective's own future, never collect_all: collect_all's future carries no
    # CUDA events, and an nccl future completes when the all-reduce is queued, so its callback
    # could read the buffers before nccl has written them (each rank keeping its own gradient).
    return futures[0].then(decompress)


def install_comm_hook(model: nn.Module, state: CompressHookState | None) -> None:
    if state is not None:
        # replicate() gives the module register_comm_hook by swapping its class, out of the stubs' sight
        model.register_comm_hook(state, compress_hook)  # type: ignore[operator]
