"""Is this Python able to run torchtitan_amp, and the features a job turns on? Checked before
anything imports torch, so that an old torch, a missing torchdata or a tracker's missing package
is one line naming the fix, not an ImportError deep in a module (Lightning's RequirementCache is
the anchor). Imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile

MIN_TORCH = (2, 11)
INSTALL = "pip install torch==2.13.0 -r requirements.txt"
# (module to import, what to install): beyond torch, what a run imports unconditionally.
_REQUIRED = (("torchdata.stateful_dataloader", "torchdata==0.11.0"),) + (
    (("tomli", "tomli"),) if sys.version_info < (3, 11) else ()
)


WANDB_INSTALL = "pip install wandb"
# torchft is an extra (pyproject's [ft]), pinned to the release the kill tests pass on.
TORCHFT_INSTALL = "pip install torchft-nightly==2026.10.26"


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
        return (
            f"torch {version} is older than the supported {'.'.join(map(str, MIN_TORCH))} "
            f"(in {sys.executable}); install it with: {INSTALL}"
        )
    for module, package in _REQUIRED:
        try:
            importlib.import_module(module)
        except ImportError as e:
            return f"{package.split('=')[0]} is missing or broken ({e}); install it with: pip install {package}"
    return None


def wandb_missing() -> str | None:
    """Why metrics.enable_wandb cannot work in this Python, or None; asked only when it is on, and
    before any model is built (main's config check, job.resolve)."""
    if importlib.util.find_spec("wandb") is None:
        return f"'metrics.enable_wandb' needs the wandb package, which is not installed: {WANDB_INSTALL}"
    return None


def torchft_missing() -> str | None:
    """Why fault_tolerance.enable cannot work in this Python, or None; asked only when it is on,
    before any process group exists."""
    if importlib.util.find_spec("torchft") is None:
        return (
            f"'fault_tolerance.enable' needs torchft, which is not installed: {TORCHFT_INSTALL} "
            f"(or pip install torchtitan-amp[ft])"
        )
    return None


def separate_inductor_cache() -> None:
    """Give each emulated CPU capability its own torch.compile cache.

    Inductor's cache key ignores ATEN_CPU_CAPABILITY, which picks the vector ISA it generates:
    measured on torch 2.13, blocks compiled natively (AVX512) and then loaded under
    ATEN_CPU_CAPABILITY=avx2 computed NaN, and the reverse corrupted the heap (malloc abort). A
    run that sets the variable (docs/performance.md's AVX2 emulation) gets
    <tmp>/torchinductor_<user>_<capability> unless TORCHINDUCTOR_CACHE_DIR is set already."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        user = "".join(c if c.isalnum() else "_" for c in _user())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{user}_{capability}"
        )


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        return f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"


def require() -> None:
    """Exit with code 2 and one `error: ...` line when this Python cannot run torchtitan_amp."""
    message = problem()
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
