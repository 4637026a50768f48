"""Checkpoints of replica groups under fault tolerance (torchft; docs/fault_tolerance.md): who
saves what, and where a group reads its own state back.

Every group holds the same model, optimizer state, schedule and counters after each committed
step, so one group saves them: the group holding rank 0 of the step's quorum (torchft's
`participating_rank() == 0`, as torchtitan does). That is whichever live group ranks first, so
saves go on while any group lives, and exactly one group writes each step's shared checkpoint
`step-N/` (a full checkpoint, the saver's per-rank files included).

Every group also writes its own ranks' files (data position, RNG states, validation position) at
the same steps into `ft-replica-<id>/step-N/`, committed with a marker like any checkpoint, so a
full restart of every group loads the shared state and each group its own files. A group without
its own step-N (it was dead, or not yet back, when step N was saved) takes the data and
validation positions from the shared checkpoint: positions are global (samples consumed by the
run, data/loader.py), the same in every group's files; its RNG states stay as seeded.

Under DiLoCo the groups train apart between syncs: at a sync their weights are the same, their
inner optimizer states (AdamW moments) are not. Each group's own files then also hold its
optimizer state (DCP, `own_dcp_parts`), which a full restart loads over the shared one; a group
without its own step-N takes the saving group's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan_amp.checkpoint.format import inspect_checkpoint
from torchtitan_amp.core.errors import CheckpointError

logger = logging.getLogger("torchtitan_amp")

KIND = "replica"  # the marker kind of a group's own files


@dataclass(frozen=True)
class ReplicaGroup:
    """This torchrun's replica group: its id, and whether it writes the step's shared checkpoint
    (asked at each save; every rank of the group gets the same answer from torchft)."""

    replica_id: int
    saves_shared: Callable[[], bool]


def own_dcp_parts(diloco: bool) -> tuple[str, ...]:
    """The DCP parts (parts.PARTS) a group saves in its own files too: under DiLoCo the inner
    optimizer's state, which is each group's own; none when the groups average every step."""
    return ("optimizer",) if diloco else ()


def folder(checkpoint_folder: Path, replica_id: int) -> Path:
    """Where group `replica_id` keeps its own ranks' files."""
    return checkpoint_folder / f"ft-replica-{replica_id}"


def own_files(
    checkpoint_folder: Path, replica: ReplicaGroup, step: int, world_size: int
) -> tuple[Path, dict[str, Any]] | None:
    """The group's own complete `step-N` (path, marker) when it was saved by a group of this layout,
    else None (the shared checkpoint's files are read instead). Rank 0 only.

    Args:
        checkpoint_folder: the run's checkpoint folder (the groups' own folders are inside it).
        replica: this replica group.
        step: the step being loaded.
        world_size: this group's number of ranks; files saved by a group of another size are not read.
    """
    path = folder(checkpoint_folder, replica.replica_id) / f"step-{step}"
    if not path.is_dir():
        logger.info(
            "replica group %d has no files of its own for step %d (it was not training then): "
            "data position from the shared checkpoint, RNG states as seeded",
            replica.replica_id,
            step,
        )
        return None
    try:
        info = inspect_checkpoint(path)
    except CheckpointError as e:
        logger.warning("checkpoint: ignoring %s; data position from the shared checkpoint", e)
        return None
    if info.kind != KIND or info.meta["world_size"] != world_size:
        logger.warning(
            "checkpoint: %s was saved by a group of %s ranks (this one has %d): data position "
            "from the shared checkpoint",
            path,
            info.meta.get("world_size"),
            world_size,
        )
        return None
    return path, info.meta
