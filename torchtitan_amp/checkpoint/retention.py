"""Retention: `checkpoint.keep_latest_k` prunes old full checkpoints once a newer one is committed."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from torchtitan_amp.checkpoint.format import scan_folder

logger = logging.getLogger("torchtitan_amp")


def purge(folder: Path, keep_latest_k: int, saved_step: int, kind: str = "full") -> None:
    """Remove the oldest checkpoints of one kind beyond the newest keep_latest_k; runs (on rank 0) after
    a newer one is complete.

    Checkpoints of later steps than the one just saved (left by a run resumed from an older
    step: a load_step, or a newer checkpoint that failed its checksum) are neither counted
    nor removed: counting them would delete the checkpoint just written.

    Args:
        folder: the checkpoint folder (the run's, or a replica group's own).
        keep_latest_k: how many to keep; 0 keeps all.
        saved_step: the step just saved.
        kind: the kind counted ("full"; "replica" in a replica group's own folder); others are kept.
    """
    if not keep_latest_k:
        return
    complete, _ = scan_folder(folder)
    full = sorted(s for s, info in complete.items() if info.kind == kind and s <= saved_step)
    for step in full[:-keep_latest_k]:
        path = folder / f"step-{step}"
        doomed = path.with_name(path.name + ".deleting")
        os.rename(path, doomed)  # a half-deleted folder must never look like a checkpoint
        shutil.rmtree(doomed, ignore_errors=True)
        logger.info("removed %s (keep_latest_k = %d)", path, keep_latest_k)
