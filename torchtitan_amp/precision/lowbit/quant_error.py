"""How much a low-precision format loses of one GEMM operand: quantize-dequantize it in a named
format and measure the error (benchmarks/blockscaled_error.py tabulates it for real activations,
weights and gradients of the debug model).

An operand is 2-D and quantized along its last dimension (the reduction dimension of the GEMM that
reads it), as lowbit/linear.py quantizes it. The formats:

  bf16                   round to nearest even; no scale.
  fp8 tensorwise         torchao's tensorwise recipe: one fp32 scale 448 / amax (e4m3) for inputs and
                         weights, 57344 / amax (e5m2) for gradients (`grad=True`), saturated cast.
  fp8 rowwise            torchao's rowwise recipe: e4m3, one scale per row (along the reduction
                         dim), max / amax rounded down to a power of two.
  mxfp8 floor | rceil    lowbit/formats.py's quantize_mxfp8 (1x32 blocks, E8M0 scales).
  nvfp4 1x16 | 16x16     lowbit/formats.py's NVFP4 (16x16: one scale per tile, weights).
  ... + RHT              the 16-point random Hadamard transform along the reduction dim first (the
                         recipe's wgrad operands); errors are measured back in the original basis.
  ... + SR               stochastic rounding of the e2m1 elements from a seeded generator.

Measures (`QuantError`, each over the nonzero entries and blocks): the relative L2 error
||q(x) - x|| / ||x||; the largest |q(x) - x| over amax(x); the fraction of nonzero elements that
quantize to zero (flushed); the fraction of nonzero scaling groups (blocks, rows, the tensor) where
the clamp to the format's largest magnitude changed some element beyond rounding (saturated: a
scaled magnitude above the max plus half the grid step below it; MXFP8's floor rule lets a block's
top reach 512; NVFP4's round-to-nearest e4m3 block scale lets it reach 6.375, which rounds to 6,
while its scale is normal, but a block whose scale is an e4m3 subnormal, amax below 2^-6 * 6 * s_t,
rounds it on the fixed 2^-9 grid, and its top can land far past 6). Flushing and clipping are
read where the quantizer sees the values (after the RHT).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit.linear import rht_matrix

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344
TORCHAO_EPS = 1e-12  # torchao.float8's floor on amax before max / amax
# A scaled magnitude above these is changed by the clamp to the max, not only by rounding: the max
# plus half the grid step below it (e4m3 416 -> 448, e5m2 49152 -> 57344, e2m1 4 -> 6).
CLIPS = {torch.float8_e4m3fn: 464.0, torch.float8_e5m2: 61440.0, "e2m1": 7.0}
FORMATS = (
    "bf16",
    "fp8 tensorwise",
    "fp8 rowwise",
    "mxfp8 floor",
    "mxfp8 rceil",
    "nvfp4 1x16",
    "nvfp4 16x16",
    "nvfp4 1x16 + SR",
    "nvfp4 1x16 + RHT",
    "nvfp4 1x16 + RHT + SR",
)


@dataclasses.dataclass
class QuantError:
    """Sums over one or more tensors; `merge` pools them, the properties read the pooled values."""

    err_sq: float = 0.0  # sum of (q - x)^2
    ref_sq: float = 0.0  # sum of x^2
    max_err: float = 0.0  # largest |q - x|, each tensor's divided by its amax
    nonzero: int = 0
    flushed: int = 0
    groups: int = 0  # nonzero scaling groups
    saturated: int = 0

    @property
    def rel_l2(self) -> float:
        return math.sqrt(self.err_sq / self.ref_sq) if self.ref_sq else 0.0

    @property
    def flushed_frac(self) -> float:
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def saturated_frac(self) -> float:
        return self.saturated / self.groups if self.groups else 0.0

    def merge(self, other: QuantError) -> QuantError:
        return QuantError(
            self.err_sq + other.err_sq,
            self.ref_sq + other.ref_sq,
            max(self.max_err, other.max_err),
            self.nonzero + other.nonzero,
            self.flushed + other.flushed,
            self.groups + other.groups,
            self.saturated + other.saturated,
        )


class _Quantized(NamedTuple):
    """A quantize-dequantize result in the quantizer's basis (padded, rotated)."""

    values: torch.Tensor  # fp32
    clipped: torch.Tensor  # bool, one per scaling group: an element's scaled magnitude exceeded the max
    group_amax: torch.Tensor  # one per scaling group (0: an all-zero group, not counted)


def _fp8_scaled(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> _Quantized:
    """torchao.float8's cast: scale = max / clamp(amax, eps) (in fp64, then fp32), rounded down to a
    power of two if `pow2`, then a saturated cast of x * scale; dequantized by dividing."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / amax.to(torch.float64).clamp(min=TORCHAO_EPS)).to(torch.float32)
    if pow2:
        scale = bs.exp2_int(bs.floor_log2(scale))
    y = x * scale
    q = y.clamp(-fmax, fmax).to(dtype).to(torch.float32) / scale
    over = y.abs() > CLIPS[dtype]
    clipped = over.reshape(amax.shape[0], -1).any(-1) if amax.dim() else over.any()[None]
    return _Quantized(q, clipped, amax.reshape(-1))


def _mxfp8(x: torch.Tensor, mode: str) -> _Quantized:
    q = bs.quantize_mxfp8(x, scale_mode=mode)
    blocks = x.reshape(*x.shape[:-1], -1, bs.MX_BLOCK)
    clipped = (blocks.abs() / q.scale_fp32().unsqueeze(-1) > CLIPS[torch.float8_e4m3fn]).any(-1)
    return _Quantized(q.dequantize(), clipped.reshape(-1), blocks.abs().amax(-1).reshape(-1))


def _nvfp4(x: torch.Tensor, block_2d: bool, generator: torch.Generator | None) -> _Quantized:
    q = bs.quantize_nvfp4(x, block_2d=block_2d, generator=generator)
    blocks = x.reshape(*x.shape[:-1], -1, bs.NVFP4_BLOCK)
    s_b = q.scale.to(torch.float32)
    recip = torch.where(s_b > 0, (1.0 / q.tensor_scale) / torch.where(s_b > 0, s_b, 1.0), 0.0)
    clipped = (blocks.abs() * recip.unsqueeze(-1) > CLIPS["e2m1"]).any(-1)
    amax = blocks.abs().amax(-1)
    if block_2d:  # a tile's 16 rows share one scale: count each tile once
        rows, cols = x.shape[0] // bs.NVFP4_BLOCK, x.shape[1] // bs.NVFP4_BLOCK
        clipped = clipped.reshape(rows, bs.NVFP4_BLOCK, cols).any(1)
        amax = amax.reshape(rows, bs.NVFP4_BLOCK, cols).amax(1)
    return _Quantized(q.dequantize(), clipped.reshape(-1), amax.reshape(-1))


def _pad(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad to multiples (zeros change no amax and are not counted)."""
    return F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))


def fake_quantize(x: torch.Tensor, fmt: str, *, grad: bool = False, seed: int = 0) -> tuple[torch.Tensor, _Quantized]:
    """(q(x) in x's basis and shape, fp32; the quantizer's view) for `fmt` of FORMATS.

    Args:
        x: the 2-D floating operand, quantized along its last dim.
        fmt: one of FORMATS ("bf16", "fp8 tensorwise", "mxfp8 rceil", "nvfp4 16x16 RHT SR", ...).
        grad: the operand is a gradient (fp8 tensorwise then uses e5m2, as torchao does).
        seed: seeds stochastic rounding and the RHT signs, where the format has them.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"a GEMM operand is a 2-D floating tensor, not {tuple(x.shape)} {x.dtype}")
    x = x.to(torch.float32)
    rows, cols = x.shape
    if fmt == "bf16":
        q = x.to(torch.bfloat16).to(torch.float32)
        return q, _Quantized(q, torch.zeros(1, dtype=torch.bool), x.abs().amax().reshape(1))
    if fmt.startswith("fp8"):
        tensorwise = fmt == "fp8 tensorwise"
        amax = x.abs().amax() if tensorwise else x.abs().amax(-1, keepdim=True)
        dtype = torch.float8_e5m2 if tensorwise and grad else torch.float8_e4m3fn
        quant = _fp8_scaled(x, amax, dtype, pow2=not tensorwise)
        return quant.values, quant
    if fmt.startswith("mxfp8"):
        quant = _mxfp8(_pad(x, 1, bs.MX_BLOCK), fmt.split()[1])
        return quant.values[:rows, :cols], quant
    tile = fmt.startswith("nvfp4 16x16")
    xp = _pad(x, bs.NVFP4_BLOCK if tile else 1, bs.NVFP4_BLOCK)
    r = rht_matrix(seed) if "RHT" in fmt else None
    if r is not None:
        xp = _rotate(xp, r)
    generator = torch.Generator(device=x.device).manual_seed(seed) if "SR" in fmt else None
    quant = _nvfp4(xp, tile, generator)
    values = quant.values if r is None else _rotate(quant.values, r.t())
    return values[:rows, :cols], quant


def _rotate(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """t @ blockdiag(r, r, ...) along the last dim."""
    n = r.shape[0]
    return (t.reshape(-1, n) @ r).reshape(t.shape)


def quant_error(x: torch.Tensor, fmt: str, *, grad: bool = False, seed: int = 0) -> QuantError:
    """The error of `fmt` on the 2-D operand `x` (see the module docstring).

    Args:
        x: the 2-D floating operand, quantized along its last dim.
        fmt: one of FORMATS.
        grad: the operand is a gradient (fp8 tensorwise then uses e5m2, as torchao does).
        seed: seeds stochastic rounding and the RHT signs, where the format has them.
    """
    x = x.detach().to(torch.float32)
    q, quant = fake_quantize(x, fmt, grad=grad, seed=seed)
    seen = quant.values  # flushing is what the quantizer produced: zeros in its own basis
    nonzero_seen = _seen_input(x, fmt, seed) != 0
    amax = float(x.abs().amax())
    err = q - x
    live = quant.group_amax > 0
    return QuantError(
        err_sq=float(err.double().square().sum()),
        ref_sq=float(x.double().square().sum()),
        max_err=float(err.abs().amax()) / amax if amax else 0.0,
        nonzero=int(nonzero_seen.sum()),
        flushed=int((nonzero_seen & (seen == 0)).sum()),
        groups=int(live.sum()),
        saturated=int((quant.clipped & live).sum()),
    )


def _seen_input(x: torch.Tensor, fmt: str, seed: int) -> torch.Tensor:
    """x as the quantizer of `fmt` received it (padded, rotated), shaped like its output."""
    if fmt == "bf16" or fmt.startswith("fp8"):
        return x
    if fmt.startswith("mxfp8"):
        return _pad(x, 1, bs.MX_BLOCK)
    xp = _pad(x, bs.NVFP4_BLOCK if fmt.startswith("nvfp4 16x16") else 1, bs.NVFP4_BLOCK)
    return _rotate(xp, rht_matrix(seed)) if "RHT" in fmt else xp
