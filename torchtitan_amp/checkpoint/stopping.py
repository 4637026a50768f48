"""The per-step agreement to stop and the shutdown: every rank polls once a step whether a stop
signal reached any rank (committing a finished background save on the way), and close() finishes
the last save and releases the pinned-memory stager."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchtitan_amp.checkpoint.preemption import stop_requested
from torchtitan_amp.checkpoint.saving import close_stager, finish_pending

if TYPE_CHECKING:
    from torchtitan_amp.checkpoint.manager import CheckpointManager

logger = logging.getLogger("torchtitan_amp")


def should_stop(m: CheckpointManager) -> bool:
    """All ranks agree (one tiny all-reduce) whether a stop signal reached any of them; a
    finished background save is committed here too. Call once per step on every rank.

    The flags travel as a CPU tensor on a gloo group (distributed.control_group, made with the
    manager): reading the result back never waits for the GPU."""
    stop = stop_requested()
    signum = int(signal.Signals[stop]) if stop else 0
    flags = [signum, int(m._pending is not None and not m._pending.future.done())]
    if dist.is_initialized() and m.world_size > 1:
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=m._control_pg)
        flags = [int(x) for x in t.tolist()]
    signum, still_writing = flags
    if m._pending is not None and not still_writing:
        finish_pending(m)
    if signum and m.rank == 0:
        logger.warning("stop requested (%s on some rank): %s", signal.Signals(signum).name,
                       "saving a checkpoint and exiting" if m.enabled else
                       "exiting after this step (checkpoint.enable is false: nothing is saved)")
    return bool(signum)


def close(m: CheckpointManager) -> None:
    """Finish any background save, then shut the pinned-memory stager down. Collective."""
    finish_pending(m)
    close_stager(m)
