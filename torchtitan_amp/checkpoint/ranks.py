"""Where this rank stands in the job (`RankLayout`, a frozen value read once when checkpointing
starts) and the two ways the ranks settle an outcome together: `agree` (rank 0 decides, every rank
gets its answer or its error) and `all_ok` (every rank reports, the first error is raised
everywhere). A checkpoint step that fails on one rank must fail on all, or the others would
wait in the next collective until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from torchtitan_amp.checkpoint.format import one_line
from torchtitan_amp.core.errors import CheckpointError


@dataclass(frozen=True)
class RankLayout:
    """This rank's place in the job, as the checkpoint files record it: global rank and world,
    data-parallel rank and degree (the dataloader's), pipeline degree."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_degree: int = 1
    pp_degree: int = 1

    @classmethod
    def current(cls, dataloader: Any, pp_degree: int = 1) -> RankLayout:
        """The running job's layout; one process without a process group is rank 0 of 1."""
        initialized = dist.is_initialized()
        return cls(
            rank=dist.get_rank() if initialized else 0,
            world_size=dist.get_world_size() if initialized else 1,
            dp_rank=getattr(dataloader, "dp_rank", 0),
            dp_degree=getattr(dataloader, "dp_world_size", 1),
            pp_degree=pp_degree,
        )

    @property
    def stage_ranks(self) -> int:
        """Ranks per pipeline stage: the mesh is row-major with pp outermost, so each stage owns a
        contiguous block of ranks."""
        return self.world_size // self.pp_degree

    @property
    def pp_rank(self) -> int:
        return self.rank // self.stage_ranks


def agree(ranks: RankLayout, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 and hand every rank its result, or raise its error on every rank."""
    result: list[Any] = [None, None]
    if ranks.rank == 0:
        try:
            result = [fn(), None]
        except (CheckpointError, OSError) as e:
            result = [None, str(e) if isinstance(e, CheckpointError) else one_line(e)]
    if dist.is_initialized() and ranks.world_size > 1:
        dist.broadcast_object_list(result, src=0)
    if result[1] is not None:
        raise CheckpointError(result[1])
    return result[0]


def all_ok(ranks: RankLayout, error: str | None, extra: Any = None) -> list[Any]:
    """Gather (error, extra) from every rank; raise the first error everywhere as a CheckpointError.
    Returns every rank's `extra`, in rank order. Collective when a process group of several ranks is up.

    Args:
        ranks: where this rank sits in the job (the world size to gather over).
        error: this rank's error line, or None when it has none.
        extra: anything picklable to hand to every rank alongside.
    """
    gathered: list[Any] = [(error, extra)]
    if dist.is_initialized() and ranks.world_size > 1:
        gathered = [None] * ranks.world_size
        dist.all_gather_object(gathered, (error, extra))
    errors = [e for e, _ in gathered if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return [x for _, x in gathered]
