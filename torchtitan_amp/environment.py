"""Is this Python able to run torchtitan_amp? Checked before anything imports torch, so that an
old torch or a missing torchdata is one line naming the fix, not an ImportError deep in a module
(Lightning's RequirementCache is the anchor). Imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

MIN_TORCH = (2, 13)
INSTALL = "pip install torch==2.13.0 -r requirements.txt"
# (module to import, what to install): beyond torch, what a run imports unconditionally.
_REQUIRED = (("torchdata.stateful_dataloader", "torchdata==0.11.0"),) + (
    (("tomli", "tomli"),) if sys.version_info < (3, 11) else ())


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a source build without distribution metadata
        return importlib.import_module("torch").__version__
    except ImportError:
        return None


def problem() -> str | None:
    """What is missing or too old, as one line with the install command; None when all is there."""
    version = _torch_version()
    if version is None:
        return f"torch is not installed in {sys.executable}; install what torchtitan_amp needs with: {INSTALL}"
    if _version_tuple(version) < MIN_TORCH:
        return (f"torch {version} is older than the supported {'.'.join(map(str, MIN_TORCH))} "
                f"(in {sys.executable}); install it with: {INSTALL}")
    for module, package in _REQUIRED:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"{package.split('=')[0]} is missing or broken ({e}); install it with: pip install {package}"
    return None


def require() -> None:
    """Exit with code 2 and one `error: ...` line when this Python cannot run torchtitan_amp."""
    message = problem()
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
