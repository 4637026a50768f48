"""What this machine can run: tests skip, and launches leave jobs out, on these answers."""

from __future__ import annotations

import functools


@functools.cache
def cpu_scaled_mm_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes rowwise scales (torch 2.13's does, 2.11's
    asserts scalar scales): asked of torch directly, so the fp8 probe's answer is checked against
    something other than itself."""
    import torch

    a = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def c_compiler() -> str | None:
    """The C++ compiler inductor needs on CPU, if any: torch.compile tests skip without one, and
    launches leave their compiled jobs out."""
    import shutil

    return shutil.which("g++") or shutil.which("c++") or shutil.which("cc")


NO_COMPILER = "torch.compile (inductor on CPU) needs a C++ compiler: none of g++ / c++ / cc is on PATH"
