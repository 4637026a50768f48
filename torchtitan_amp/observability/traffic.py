"""Count the bytes torch.distributed collectives move, by category and dtype.

One implementation for benchmarks/comm.py (traffic per training step) and
tests/workers/dry_run_worker.py (the real runs the dry run must predict exactly); a user can
count a job's traffic the same way. `install()`
wraps, once per process, the Python entry points the collectives go through:

- torch.distributed's all_gather_single / all_gather_into_tensor / reduce_scatter_single /
  reduce_scatter_tensor / all_reduce (FSDP2, the DDP comm hooks);
- with `point_to_point=True`: dist.send / dist.recv, and pipelining's `_batch_p2p` helper
  (_sorted_batch_p2p calls it too; P2POp insists on the original isend/irecv, so those cannot be
  wrapped themselves);
- with `functional=True`: torch.distributed._functional_collectives (DTensor, i.e. TP); their
  all-gathers take the input shard, so they count it times the group size.

Volumes: all-gather output, reduce-scatter input, all-reduce buffer, point-to-point tensor (the
convention of torchtitan_amp.memory and the dry run). A collective built on another counts once.
Only calls inside `counting()` are counted, under the category `install(categorize=...)` gives
an (op, group) pair; by default the op: "all_gather", "reduce_scatter", "all_reduce", "send",
"recv".

DDP without a compress hook all-reduces in C++, out of these wrappers' sight:
`install_default_ddp_hook()` has DDP given torch's Python equivalent instead (`default_ddp_hook`,
passed to apply_ddp: `allreduce_hook`, the same fp32 buckets through dist.all_reduce) so that its
traffic is seen too.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

Categorize = Callable[[str, Any], str]

COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
# Calls per category: latency-bound collectives cost per call, whatever their bytes.
CALL_COUNTS: dict[str, int] = defaultdict(int)
# With install(record_calls=True): (category, dtype, shape, factor) of every counted call.
CALLS: list[tuple[str, str, list[int], int]] = []

_state = threading.local()
_settings: dict[str, Any] = {"on": False, "installed": False, "categorize": None, "record_calls": False}


def _by_op(op: str, group: Any) -> str:
    return op


def group_name(group: Any) -> str:
    """The name of a process group given as None (the default group), a name, a ProcessGroup or
    anything else functional collectives accept (a mesh, a list of ranks)."""
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    import torch.distributed._functional_collectives as funcol

    return funcol._resolve_group_name(group)


def group_size(group: Any) -> int:
    return dist.distributed_c10d._get_group_size_by_name(cast("GroupName", group_name(group)))


def record(op: str, group: Any, tensor: torch.Tensor, factor: int = 1) -> None:
    """Count one call's tensor (times `factor`) under its category and dtype.

    Args:
        op: the collective ("all_gather", "reduce_scatter", "all_reduce", "send", ...).
        group: its process group, in any form group_name accepts.
        tensor: the tensor whose bytes are counted.
        factor: how many times it counts (e.g. the ranks of an all-to-all).
    """
    category = _settings["categorize"](op, group)
    dtype = str(tensor.dtype).removeprefix("torch.")
    COUNTS[category][dtype] += tensor.numel() * tensor.element_size() * factor
    CALL_COUNTS[category] += 1
    if _settings["record_calls"]:
        CALLS.append((category, dtype, list(tensor.shape), factor))


def _wrap(module: Any, name: str, op: str, tensor_arg: str, factor: Callable[[Any], int] | None = None) -> None:
    original = getattr(module, name, None)
    if original is None:  # e.g. dist.all_gather_single is new in torch 2.13; older FSDP2 never calls it
        return
    sig = inspect.signature(original)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_state, "inside", False)
        if _settings["on"] and not outer:  # a collective built on another counts once
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            group = bound.arguments.get("group")
            record(op, group, bound.arguments[tensor_arg], factor(group) if factor else 1)
        _state.inside = True
        try:
            return original(*args, **kwargs)
        finally:
            _state.inside = outer

    setattr(module, name, counted)


def _wrap_batch_p2p() -> None:
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    @functools.wraps(original)
    def counted(p2p_ops: list[dist.P2POp], *args: Any, **kwargs: Any) -> Any:
        if _settings["on"]:
            for op in p2p_ops:
                record("send" if op.op is dist.distributed_c10d.isend else "recv", op.group, op.tensor)
        return original(p2p_ops, *args, **kwargs)

    schedules._batch_p2p = counted


def install(
    categorize: Categorize | None = None,
    *,
    point_to_point: bool = False,
    functional: bool = False,
    record_calls: bool = False,
) -> None:
    """Wrap the collectives (once per process; counting starts with `counting()`).

    Args:
        categorize: names a call's category from its op and group; None: the op's name.
        point_to_point: also count send, recv and the pipeline's batched p2p.
        functional: also count the functional collectives (DTensor's, TP's).
        record_calls: also keep every call (category, dtype, shape, factor) in CALLS.
    """
    if _settings["installed"]:
        raise RuntimeError("collective counters are already installed in this process")
    _settings.update(installed=True, categorize=categorize or _by_op, record_calls=record_calls)
    _wrap(dist, "all_gather_single", "all_gather", "output_tensor")
    _wrap(dist, "all_gather_into_tensor", "all_gather", "output_tensor")
    _wrap(dist, "reduce_scatter_single", "reduce_scatter", "input")
    _wrap(dist, "reduce_scatter_tensor", "reduce_scatter", "input")
    _wrap(dist, "all_reduce", "all_reduce", "tensor")
    if point_to_point:
        _wrap(dist, "send", "send", "tensor")
        _wrap(dist, "recv", "recv", "tensor")
        _wrap_batch_p2p()
    if functional:
        import torch.distributed._functional_collectives as funcol

        _wrap(funcol, "all_gather_single", "all_gather", "self", factor=group_size)
        _wrap(funcol, "all_gather_tensor", "all_gather", "self", factor=group_size)
        _wrap(funcol, "reduce_scatter_single", "reduce_scatter", "self")
        _wrap(funcol, "reduce_scatter_tensor", "reduce_scatter", "self")
        _wrap(funcol, "all_reduce", "all_reduce", "self")


def is_installed() -> bool:
    return bool(_settings["installed"])


@contextlib.contextmanager
def counting() -> Iterator[dict[str, dict[str, int]]]:
    """Count the collectives issued inside the block, from zero; yields the live counts (read
    them, or `snapshot()`, after the block)."""
    if not _settings["installed"]:
        raise RuntimeError("install() the collective counters first")
    COUNTS.clear()
    CALL_COUNTS.clear()
    CALLS.clear()
    _settings["on"] = True
    try:
        yield COUNTS
    finally:
        _settings["on"] = False


def snapshot() -> dict[str, dict[str, int]]:
    """The counts as plain dicts: {category: {dtype: bytes}}."""
    return {category: dict(by_dtype) for category, by_dtype in COUNTS.items()}


def call_counts() -> dict[str, int]:
    """Collective calls per category since `counting()` began."""
    return dict(CALL_COUNTS)


_DEFAULT_DDP_HOOK = [False]  # set by install_default_ddp_hook; read when DDP is applied


def install_default_ddp_hook() -> None:
    """Make DDP's C++ default all-reduce visible: from now on, where the plan installs no compress
    hook, DDP is given torch's `allreduce_hook` (same buckets, same dtype, mean: default_ddp_hook)."""
    _DEFAULT_DDP_HOOK[0] = True


def default_ddp_hook() -> Callable[..., Any] | None:
    """The hook DDP runs where the plan has no compress hook: torch's Python `allreduce_hook` while
    traffic is recorded (install_default_ddp_hook), else None (DDP's C++ all-reduce)."""
    if not _DEFAULT_DDP_HOOK[0]:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook
