"""CRC-32 checksums of checkpoint files: each rank computes its share at save, every rank
re-checks its share before a load (zlib, ~2.5-4 GiB/s: about one read of 1/world of the files)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from torchtitan_amp.checkpoint.format import one_line


def file_crc32(path: Path, chunk: int = 16 << 20) -> str:
    """CRC-32 of a file as 8 hex digits (zlib: ~4 GiB/s here, so checking costs about one read)."""
    crc = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def verify_checksums(path: str | Path, meta: dict[str, Any], part: tuple[int, int] = (0, 1)) -> str | None:
    """Recompute the manifest's CRC-32s of one share of the files; the first mismatch as one line, or
    None. Checkpoints saved without checksums pass.

    Args:
        path: the checkpoint's step folder.
        meta: the checkpoint's manifest (its "crc32" maps file name -> CRC-32).
        part: (index, count): this caller checks files index, index + count, ... of the sorted names,
            so that count ranks split the work; (0, 1) checks every file.
    """
    path = Path(path)
    crcs = meta.get("crc32") or {}
    for name in sorted(crcs)[part[0] :: part[1]]:
        try:
            got = file_crc32(path / name)
        except OSError as e:
            return f"{path}: file {name} cannot be read ({one_line(e)})"
        if got != crcs[name]:
            return f"{path}: file {name} has CRC-32 {got}, the manifest says {crcs[name]} (corrupt)"
    return None
