"""Distributed checkpoints: save, resume bit for bit, reshard, survive crashes and preemption.

- `format.py`: the on-disk format (names, marker and manifest, what makes a folder complete,
  inspecting and scanning, the single-file model export);
- `integrity.py`: CRC-32 checksums of the files;
- `manager.py`: `CheckpointManager`, driven by one table of stateful parts (`PARTS`: model,
  optimizer, LR schedule, loss scaler, train state in DCP; dataloader and RNG per rank);
- `cli.py`: `python -m torchtitan_amp.checkpoint list | verify | export`.

Pre-emption signals and fault injection are run control (torchtitan_amp/run_control.py). See
docs/checkpointing.md.
"""

from torchtitan_amp.checkpoint.format import (
    EXPORT_FILE,
    FORMAT_VERSION,
    KINDS,
    MARKER,
    CheckpointInfo,
    export_checkpoint,
    inspect_checkpoint,
    scan_folder,
)
from torchtitan_amp.checkpoint.integrity import file_crc32, verify_checksums
from torchtitan_amp.checkpoint.manager import (
    PARTS,
    STATE_NAMES,
    CheckpointManager,
    StatePart,
    TrainState,
    validate_config,
)
from torchtitan_amp.errors import CheckpointError

__all__ = ["EXPORT_FILE", "FORMAT_VERSION", "KINDS", "MARKER", "PARTS", "STATE_NAMES", "CheckpointError",
           "CheckpointInfo", "CheckpointManager", "StatePart", "TrainState", "export_checkpoint", "file_crc32",
           "inspect_checkpoint", "scan_folder", "validate_config", "verify_checksums"]
