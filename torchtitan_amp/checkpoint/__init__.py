"""Distributed checkpoints: save, resume bit for bit, reshard, survive crashes and preemption.

- `format.py`: the on-disk format (names, marker and manifest, what makes a folder complete,
  inspecting and scanning, the single-file model export);
- `integrity.py`: CRC-32 checksums of the files;
- `parts.py`: one table of stateful parts (`PARTS`: model, optimizer, LR schedule, loss scaler,
  train state in DCP; dataloader, RNG and validation position per rank) and `RunState`, the live
  objects it reads and writes; `train_state.py` holds `TrainState`;
- `ranks.py`: `RankLayout` (this rank's place in the job) and the cross-rank `agree` / `all_ok`;
- `saving.py`: `Saver` (saves, async saves with their stager and group, commits, exports);
  `staging.py` (the run's pinned-memory stager, its copies after the step's kernels);
  `loading.py` (choosing, verifying and restoring a checkpoint); `retention.py` (keep_latest_k);
  `stopping.py` (the per-step stop poll); `preemption.py` (stop signals, the pre-emption
  deadline, fault injection);
- `replicas.py`: who saves what under fault tolerance (the shared checkpoint by one replica group,
  each group's own per-rank files in `ft-replica-<id>/`);
- `manager.py`: `CheckpointManager`, which composes them for the trainer;
- `cli.py`: `python -m torchtitan_amp.checkpoint list | verify | export`.

See docs/checkpointing.md.
"""

import importlib
from typing import Any

# Resolved on first use (PEP 562), so that `python -m torchtitan_amp.checkpoint` can check the
# environment (an old torch, no torchdata) before anything imports torch.
_EXPORTS = {
    "format": (
        "EXPORT_FILE",
        "FORMAT_VERSION",
        "KINDS",
        "MARKER",
        "CheckpointInfo",
        "export_checkpoint",
        "inspect_checkpoint",
        "scan_folder",
    ),
    "integrity": ("file_crc32", "verify_checksums"),
    "manager": ("CheckpointManager", "validate_config"),
    "parts": ("PARTS", "StatePart"),
    "train_state": ("TrainState",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted([*_HOME, "CheckpointError"])


def __getattr__(name: str) -> Any:
    if name == "CheckpointError":
        from torchtitan_amp.core.errors import CheckpointError

        return CheckpointError
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
