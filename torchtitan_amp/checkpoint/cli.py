"""`python -m torchtitan_amp.checkpoint {list FOLDER | verify STEP_DIR | export STEP_DIR OUTPUT [DTYPE]}`."""

from __future__ import annotations

import sys

from torchtitan_amp.errors import CheckpointError
from torchtitan_amp.rules import DTYPES


def main(argv: list[str]) -> int:
    # Imported here, not at the top: cli() checks the environment before anything imports torch.
    from torchtitan_amp.checkpoint.format import export_checkpoint, inspect_checkpoint, scan_folder
    from torchtitan_amp.checkpoint.integrity import verify_checksums

    if len(argv) >= 2 and argv[0] == "list":
        complete, problems = scan_folder(argv[1])
        for step, info in sorted(complete.items()):
            print(f"step-{step}\t{info.kind}\tworld_size {info.meta.get('world_size')}\t{info.meta.get('saved_at')}")
        for line in problems:
            print(line)
        return 0
    if len(argv) == 2 and argv[0] == "verify":
        try:
            info = inspect_checkpoint(argv[1])
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        bad = verify_checksums(info.path, info.meta)
        if bad:
            print(f"error: {bad}", file=sys.stderr)
            return 2
        n = len(info.meta.get("crc32") or {})
        print(f"{info.path}: complete, {len(info.meta['files'])} files"
              + (f", {n} CRC-32s match" if n else " (saved without checksums: sizes checked)"))
        return 0
    if len(argv) in (3, 4) and argv[0] == "export":
        dtype = argv[3] if len(argv) == 4 else "float32"
        if dtype not in DTYPES:
            print(f"error: dtype must be one of {', '.join(DTYPES)}", file=sys.stderr)
            return 2
        try:
            print(export_checkpoint(argv[1], argv[2], dtype))
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print("usage: python -m torchtitan_amp.checkpoint list FOLDER\n"
          "       python -m torchtitan_amp.checkpoint verify STEP_DIR\n"
          "       python -m torchtitan_amp.checkpoint export STEP_DIR OUTPUT.pt [float32|bfloat16|float16]",
          file=sys.stderr)
    return 2


def cli() -> None:
    """Console entry point (`torchtitan-amp-checkpoint`, `python -m torchtitan_amp.checkpoint`)."""
    from torchtitan_amp.environment import require

    require()
    sys.exit(main(sys.argv[1:]))
