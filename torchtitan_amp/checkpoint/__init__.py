"""Distributed checkpoints: save, resume bit for bit, reshard, survive crashes and preemption.

- `format.py`: the on-disk format (names, marker and manifest, what makes a folder complete,
  inspecting and scanning, the single-file model export);
- `integrity.py`: CRC-32 checksums of the files;
- `manager.py`: `CheckpointManager`, driven by one table of stateful parts (`PARTS`: model,
  optimizer, LR schedule, loss scaler, train state in DCP; dataloader and RNG per rank); its jobs
  are `saving.py` (saves, async saves, commits, exports), `loading.py` (choosing, verifying and
  restoring a checkpoint), `retention.py` (keep_latest_k) and `stopping.py` (the per-step stop
  poll, close); `train_state.py` holds `TrainState`;
- `cli.py`: `python -m torchtitan_amp.checkpoint list | verify | export`.

Pre-emption signals and fault injection are run control (torchtitan_amp/checkpoint/preemption.py). See
docs/checkpointing.md.
"""

import importlib
from typing import Any

# Resolved on first use (PEP 562), so that `python -m torchtitan_amp.checkpoint` can check the
# environment (an old torch, no torchdata) before anything imports torch.
_EXPORTS = {
    "format": ("EXPORT_FILE", "FORMAT_VERSION", "KINDS", "MARKER", "CheckpointInfo", "export_checkpoint",
               "inspect_checkpoint", "scan_folder"),
    "integrity": ("file_crc32", "verify_checksums"),
    "manager": ("PARTS", "CheckpointManager", "StatePart", "TrainState", "validate_config"),
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
