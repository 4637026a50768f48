"""The per-step agreement to stop: every rank polls once a step whether a stop signal reached any
rank, and commits a finished background save on the way (so a save's commit never waits for the
next save or the end of the run)."""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from torchtitan_amp.checkpoint.preemption import stop_requested
from torchtitan_amp.checkpoint.ranks import RankLayout
from torchtitan_amp.checkpoint.saving import Saver

logger = logging.getLogger("torchtitan_amp")


def should_stop(ranks: RankLayout, group: dist.ProcessGroup | None, saver: Saver) -> bool:
    """All ranks agree (one tiny all-reduce) whether a stop signal reached any of them; a finished
    background save is committed here too. Call once per step on every rank.

    Args:
        ranks: where this rank sits in the job (the world size).
        group: the group the flags travel on as a CPU tensor, a gloo group
            (distributed.control_group), so reading the result back never waits for the GPU; None:
            the default group, gloo already.
        saver: the run's saver, whose background upload is checked and committed.
    """
    stop = stop_requested()
    signum = int(signal.Signals[stop]) if stop else 0
    flags = [signum, int(saver.uploading())]
    if dist.is_initialized() and ranks.world_size > 1:
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        flags = [int(x) for x in t.tolist()]
    signum, still_writing = flags
    if saver.pending is not None and not still_writing:
        saver.finish_pending()
    if signum and ranks.rank == 0:
        logger.warning(
            "stop requested (%s on some rank): %s",
            signal.Signals(signum).name,
            "saving a checkpoint and exiting"
            if saver.enabled
            else "exiting after this step (checkpoint.enable is false: nothing is saved)",
        )
    return bool(signum)
