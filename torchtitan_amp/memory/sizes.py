"""Bytes by dtype name, the unit every term of the memory model returns, and how reports print it."""

from __future__ import annotations

from torchtitan_amp.core.rules import SHORT

ByDtype = dict[str, int]


def add_bytes(into: dict[str, int], dtype: str, nbytes: int) -> None:
    """Add `nbytes` to `into[dtype]` in place; zero bytes add no entry.

    Args:
        into: the bytes by dtype name, updated in place.
        dtype: the dtype name ("bfloat16", "float32", ...).
        nbytes: the bytes to add (rounded down to an int).
    """
    if nbytes:
        into[dtype] = into.get(dtype, 0) + int(nbytes)


def sum_bytes(d: ByDtype) -> int:
    return sum(d.values())


def merge(*parts: ByDtype) -> ByDtype:
    out: ByDtype = {}
    for part in parts:
        for k, v in part.items():
            add_bytes(out, k, v)
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_by_dtype(d: ByDtype) -> str:
    if not d:
        return "-"
    return " + ".join(f"{fmt_bytes(v)} {SHORT.get(k, k)}" for k, v in sorted(d.items()))
