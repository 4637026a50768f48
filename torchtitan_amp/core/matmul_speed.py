"""What this device's matmul achieves in each dtype: the MFU denominator, and the measurement the
precision plan asks before it puts a job's matmuls in a low-precision dtype.

CPUs differ by two orders of magnitude here: with AVX512-BF16 or AMX a bf16 matmul runs 2-4x
faster than fp32, while an AVX2-only CPU emulates bf16 and fp16 at ~1-3 GFLOP/s against ~75 in
fp32. No spec sheet says which, so on CPU we time it. On CUDA the bf16 tensor-core peak comes
from a table (like torchtitan); bf16 is native from compute capability 8.0 (Ampere) on, while
torch emulates it on older GPUs (V100, T4), and fp16 is assumed native.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.core.rules import dtype_name, short_name

logger = logging.getLogger("torchtitan_amp")

# Dense bf16 tensor-core peak FLOP/s (vendors' datasheets; their "with sparsity" figures are twice
# these), matched as case-insensitive substrings of torch.cuda.get_device_name. Order matters: a
# more specific name must precede any entry that is a substring of it ("H200 NVL" and "H200"
# before "H20", "L40S" and "L40" before "L4"); tests/test_precision_hardware.py checks that every
# entry is reachable.
_GPU_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("A100", 312e12),
    ("A800", 312e12),  # the export A100: same SMs and clocks, less NVLink
    ("A10G", 125e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM; its device name carries no form-factor suffix
    ("H200 NVL", 835e12),  # 1,671 sparse; 600 W PCIe card
    ("H200", 989e12),
    ("H20", 148e12),
    # B300 (Blackwell Ultra) in HGX: 36 PFLOPS FP16/BF16 sparse for 8 GPUs (NVIDIA's HGX B300
    # table, as for HGX B200) = 2.25 PFLOPS dense per GPU; Blackwell Ultra raised FP4, not BF16.
    ("B300", 2.25e15),
    ("B200", 2.25e15),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    # Each MI250X GCD is its own torch device, so this is half the package figure.
    ("MI250X", 191.5e12),
)
_FALLBACK_GPU = "H100"

# 1024^3 takes milliseconds in fp32/bf16 on a few cores: long enough to hit the GEMM kernel's
# steady state, short enough that the one-off measurement doesn't delay start-up.
_CPU_MATMUL_SIZE = 1024
_CPU_WARMUP_REPS = 2
_CPU_TIMING_BUDGET_S = 0.3

# The native check: square matmuls of this size on one thread, fp32 and low precision timed in
# turn, best of each. One thread because the question is what a core's instructions do; several
# threads on a busy machine measured 0.4-300 GFLOP/s for the same matmul (OpenMP waits on
# descheduled threads), one thread stays within ~2x. 256^3 costs ~30 ms where low precision is
# emulated, well under a millisecond where it is native.
_CHECK_SIZE = 256
_CHECK_MIN_REPS = 3
_CHECK_BUDGET_S = 0.1

# A low-precision matmul at under this fraction of fp32's rate is emulated, not native. Measured,
# one thread, three classes of CPU: native bf16 runs at 2.0-2.5x fp32 (Zen 4 AVX512-BF16);
# AVX512 without AVX512-BF16 (an Intel Xeon: no bf16 dot-product instructions, bf16 goes via fp32)
# at 0.22-0.30x, varying from process to process; emulated bf16/fp16 at 0.01-0.03x (AVX2, and
# fp16 on AVX512 CPUs without AVX512-FP16). Every rank (and every torchft replica group) measures
# on its own and must decide alike, or one rank all-gathers bf16 while another all-gathers fp32:
# the threshold sits in the widest gap, over 2.5x from both neighbouring classes, so that timing
# noise on busy cores never splits a job. A CPU at 0.3x would train slower in bf16 anyway.
NATIVE_MIN_RATIO = 0.8

# Skips the measurement: "native" or "emulated" (all dtypes below fp32), e.g. to pin the answer
# for every rank of a job on mixed hardware.
LOWP_ENV = "TORCHTITAN_AMP_LOWP_MATMUL"


def gpu_peak_flops(device_name: str) -> float:
    lowered = device_name.lower()
    for name, flops in _GPU_PEAK_BF16_FLOPS:
        if name.lower() in lowered:
            return flops
    _warn_unknown_gpu(device_name)
    return dict(_GPU_PEAK_BF16_FLOPS)[_FALLBACK_GPU]


@functools.cache
def _warn_unknown_gpu(device_name: str) -> None:
    # Cached so the warning appears once per GPU model, not once per call.
    logger.warning(
        "Peak FLOP/s of GPU %r is unknown; MFU assumes %s (%.0f TFLOP/s bf16)",
        device_name,
        _FALLBACK_GPU,
        dict(_GPU_PEAK_BF16_FLOPS)[_FALLBACK_GPU] / 1e12,
    )


def _time_mm(n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, dtype=dtype)
    start = time.perf_counter()
    torch.mm(a, a)
    return time.perf_counter() - start


def measure_cpu_matmul_flops(dtype: torch.dtype) -> float:
    """The best FLOP/s of square matmuls in `dtype` on this process's threads (uncached)."""
    # Grow the size only while a matmul stays cheap: an emulated bf16/fp16 GEMM runs at
    # ~1 GFLOP/s, where 1024^3 would cost seconds of start-up per process.
    n = 128
    while n < _CPU_MATMUL_SIZE and _time_mm(2 * n, dtype) < 0.02:
        n *= 2
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(_CPU_WARMUP_REPS):
        torch.mm(a, b)
    # Best-of rather than mean: interference from other processes only ever makes a rep slower.
    best_s = math.inf
    deadline = time.perf_counter() + _CPU_TIMING_BUDGET_S
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        end = time.perf_counter()
        best_s = min(best_s, end - start)
        if end >= deadline:
            break
    return 2 * n**3 / best_s


@functools.cache
def cpu_matmul_flops(dtype: torch.dtype, num_threads: int) -> float:
    """Cached per dtype and thread count (the rate scales with threads)."""
    return measure_cpu_matmul_flops(dtype)


@functools.cache
def single_thread_rates(dtype: torch.dtype) -> tuple[float, float]:
    """(FLOP/s of a `dtype` matmul, FLOP/s of an fp32 one), one thread, timed in turn."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(_CHECK_SIZE, _CHECK_SIZE)
        operands = (a, a.to(dtype))
        best = [math.inf, math.inf]
        for x in operands:
            torch.mm(x, x)  # warm-up: kernel selection / JIT
        reps, deadline = 0, time.perf_counter() + _CHECK_BUDGET_S
        while reps < _CHECK_MIN_REPS or time.perf_counter() < deadline:
            for i, x in enumerate(operands):
                start = time.perf_counter()
                torch.mm(x, x)
                best[i] = min(best[i], time.perf_counter() - start)
            reps += 1
    finally:
        torch.set_num_threads(threads)
    flops = 2 * _CHECK_SIZE**3
    return flops / best[1], flops / best[0]


@dataclass(frozen=True)
class LowPrecisionSpeed:
    """How a low-precision matmul compares with fp32 on this device: the fact behind
    `mixed_precision.enabled = "auto"` and behind the warning for an explicit low dtype."""

    device_type: str
    capability: str  # torch.backends.cpu.get_cpu_capability() on CPU ("AVX2", "AVX512", ...)
    dtype: torch.dtype
    native: bool
    # "measured", "env" (LOWP_ENV), "capability" (a CUDA GPU's compute capability says) or
    # "assumed" (another accelerator, or CUDA fp16 / no GPU visible to ask)
    source: str
    gflops: float | None = None  # measured rates, one thread (source "measured" only)
    fp32_gflops: float | None = None

    @property
    def slowdown(self) -> float | None:
        """How many times slower than fp32 (None when not measured)."""
        if self.gflops is None or self.fp32_gflops is None:
            return None
        return self.fp32_gflops / self.gflops

    def describe(self) -> str:
        """One clause for log lines: what was measured and what it means."""
        what = f"{short_name(self.dtype)} matmul on this {self.device_type.upper()} ({self.capability})"
        if self.source == "assumed":
            return f"{short_name(self.dtype)} matmul on {self.device_type} is native"
        if self.source == "capability":
            how = "native" if self.native else "emulated (bf16 tensor cores need compute capability 8.0+)"
            return f"{short_name(self.dtype)} matmul on this GPU ({self.capability}) is {how}"
        if self.source == "env":
            return f"{what} is {'native' if self.native else 'emulated'} ({LOWP_ENV} says so)"
        speed = f"{self.gflops:.1f} vs {self.fp32_gflops:.1f} GFLOP/s in fp32 on one thread"
        if self.native:
            return f"{what} is native: measured {speed}"
        return f"{what} is emulated: measured {speed}, {self.slowdown:.0f}x slower"

    def to_dict(self) -> dict[str, object]:
        return {
            "device_type": self.device_type,
            "capability": self.capability,
            "dtype": dtype_name(self.dtype),
            "native": self.native,
            "source": self.source,
            "gflops": self.gflops,
            "fp32_gflops": self.fp32_gflops,
        }


def cuda_bf16_speed() -> LowPrecisionSpeed | None:
    """bf16 on the current CUDA GPU: native from compute capability 8.0. torch's default
    is_bf16_supported() also says yes where it only emulates bf16 (pre-Ampere), which runs at a
    fraction of fp16's speed; None when no GPU is visible (planning for one elsewhere)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    return LowPrecisionSpeed(
        "cuda", f"{name}, compute capability {major}.{minor}", torch.bfloat16, native, "capability"
    )


def low_precision_speed(device_type: str, dtype: torch.dtype) -> LowPrecisionSpeed:
    """Is a `dtype` matmul native on `device_type`? Measured once per process on CPU."""
    if device_type == "cuda" and dtype == torch.bfloat16:
        speed = cuda_bf16_speed()
        if speed is not None:
            return speed
    if device_type != "cpu":
        return LowPrecisionSpeed(device_type, device_type, dtype, True, "assumed")
    capability = torch.backends.cpu.get_cpu_capability()
    pinned = os.environ.get(LOWP_ENV, "").strip().lower()
    if pinned:
        if pinned not in ("native", "emulated"):
            raise ConfigError(
                f"environment variable {LOWP_ENV}={pinned!r} is not allowed; use 'native' or "
                f"'emulated', or unset it to measure"
            )
        return LowPrecisionSpeed("cpu", capability, dtype, pinned == "native", "env")
    low, fp32 = single_thread_rates(dtype)
    return LowPrecisionSpeed(
        "cpu", capability, dtype, low >= NATIVE_MIN_RATIO * fp32, "measured", low / 1e9, fp32 / 1e9
    )
