"""Block-scaled formats, bit-exact in emulation on any device: MXFP8 and NVFP4.

Each function quantizes along the last dimension (the reduction dimension of the matmul that will
consume the operand), in blocks, and returns the stored form: element codes and per-block scales,
plus NVFP4's fp32 per-tensor scale. Dequantizing gives fp32 values that are exact (each is an
element times a power of two, or an e2m1 value times an e4m3 value), so a matmul of dequantized
operands has exact products and only its fp32 accumulation rounds (linear.py).

MXFP8 (OCP Microscaling Formats v1.0): blocks of 32 e4m3 elements sharing one power-of-two scale X,
  stored E8M0 (biased exponent, 0x00 = 2^-127, 0xFF = NaN); elements float8_e4m3fn = RNE(v / X)
  saturated to +-448; the exponent is clamped to E8M0's [-127, 127]. Two scale rules:
  `scale_mode="rceil"` (the default: the training recipes' rule, cuBLAS / TransformerEngine /
  torchao's MXFP8 training default RCEIL): X = 2^ceil(log2(amax / 448)), so amax / X <= 448 and no
  element is clipped; `scale_mode="floor"` (the spec's section 6.3 "minimally supported"
  conversion): X = 2^(floor(log2(amax)) - emax_elem), emax of e4m3 = 8, so amax / X lies in
  [256, 512) and the top of a block saturates to 448 (measured on real operands: 14-16% of the
  blocks, 13-25% more L2 error than rceil, docs/numerics.md). A zero block has log2(0) = -inf,
  clamped: scale 0x00 (2^-127), elements +0. rceil's one overflow: an element of a block whose
  scale is 2^120 (amax at or above 448 * 2^119) that rounds to e4m3's 256 dequantizes to
  256 * 2^120 = 2^128, past fp32's range: inputs of magnitude at or above 248 * 2^120 (3.2967e38)
  dequantize to inf (floor clamps them to 448 * 2^119).
NVFP4 (NVIDIA: blocks of 16 e2m1 elements, e4m3 block scales, an fp32 tensor scale):
  tensor scale s_t = amax(tensor) / (448 * 6) (fp32, floored at 2^-126 so that an all-zero or
  denormal tensor still has a finite reciprocal); block scale s_b = e4m3_RNE(amax(block) / 6 / s_t)
  (e4m3 subnormals kept; an all-zero block gets s_b = 0 and elements +0); elements
  e2m1(v * ((1 / s_t) / s_b)) clamped to +-6, rounded to nearest even on the grid
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} or stochastically from a seeded torch.Generator.
  `block_2d=True` shares one scale per 16x16 tile (the recipe's weight scaling): the quantized
  tensor is then the same whichever of its two dimensions a matmul reduces over.

Non-finite input is refused (`NonFiniteBlockError`) unless `check_finite=False`, when a block
holding NaN or +-inf gets a NaN scale (E8M0 0xFF, e4m3 0x7F) and dequantizes to NaN. The check
reads one bool back to the host per call (a sync on a GPU): it is for tools that quantize weights;
training (`BlockScaledRecipe`, below) turns it off, so that a non-finite operand, such
as an fp16 gradient whose loss scale overflowed, reaches the loss scaler's and the trainer's checks.

Against torchao 0.18's quantizers (torchao.prototype.mx_formats: to_mx FLOOR / RCEIL,
nvfp4_quantize) the results are bit-identical on finite random data whose blocks are not tiny
(tests/test_blockscaled.py); they differ, by design, where torchao departs from the rules above:
  - to_mx FLOOR divides by max(X, 2^-126): a block with amax < 2^-118 keeps scale 0x00 but is
    scaled as if 0x01; to_mx RCEIL multiplies by 1 instead of 2^127 when the scale is 0x00.
  - to_mx RCEIL (eager, and its Triton casts without the PTX instruction) takes ceil(log2(amax /
    448)) with an fp32 log2, which rounds the log2 of a quotient just above a power of two 2^k onto
    k once fp32's spacing at k is coarser than log2 of the excess (|k| >= 5 for 1 + 2^-23): one
    scale lower than the rule, the block's top clamped to 448.
  - torchao's Triton MXFP8 casts with FLOOR (triton_to_mxfp8_dim0 / dim1, which MXFP8Linear's
    kernels use for column-wise operands) take the exponent of bf16(amax): on an fp32 operand an
    amax within 2^-9 below a power of two rounds up to it, one scale higher than the rule; on bf16
    operands (the plan's) the two agree.
  - nvfp4_quantize and NVFP4Linear's kernels clamp block scales up to e4m3's smallest normal
    2^-6 (blocks with amax < 2^-6 * 6 * s_t: this rule keeps e4m3 subnormal scales, which round on
    a fixed 2^-9 grid, so such a block's top can land past 6 and clip; torchao's clamp flushes
    more of it instead), and nvfp4_quantize divides 0 by 0 for an all-zero tensor.
  - NVFP4Linear casts its inputs to bf16 and rounds the RHT output to bf16 before quantizing;
    the emulation quantizes the fp32 rotation of the operand as the plan stores it.
torchao has no stochastic rounding, 2-D scaling or NaN refusal on CPU (its SR and 2-D kernels are
Triton-only).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from torchtitan_amp.core.errors import NonFiniteError

MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E4M3_EMAX = 8  # e4m3's largest normal is 1.75 * 2^8
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0
NVFP4_TENSOR_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688
ScaleMode = Literal["floor", "rceil"]
F32_MIN_NORMAL = 2.0**-126
# Magnitudes of the e2m1 codes 0..7 (bit 3 is the sign).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_MODES = ("floor", "rceil")


class NonFiniteBlockError(NonFiniteError, ValueError):
    """A tensor handed to a block-scaled quantizer holds NaN or inf."""


@dataclasses.dataclass(frozen=True)
class MXFP8Quantized:
    """data: float8_e4m3fn, the input's shape; scale: uint8 E8M0 (biased exponent), one per block
    of the last dimension, shape (..., K // block_size)."""

    data: torch.Tensor
    scale: torch.Tensor
    block_size: int = MX_BLOCK

    def scale_fp32(self) -> torch.Tensor:
        return e8m0_to_fp32(self.scale)

    def dequantize(self) -> torch.Tensor:
        """fp32, exact: each element times its block's power of two."""
        d = self.data.to(torch.float32)
        blocks = d.reshape(*d.shape[:-1], -1, self.block_size)
        return (blocks * self.scale_fp32().unsqueeze(-1)).reshape(d.shape)


@dataclasses.dataclass(frozen=True)
class NVFP4Quantized:
    """codes: uint8, two e2m1 codes a byte (element 2i in the low nibble, as torchao packs them),
    shape (..., K // 2); scale: float8_e4m3fn, one per 1x16 block, shape (..., K // 16) (with
    block_2d the 16 rows of a tile repeat the tile's scale); tensor_scale: fp32, 0-d."""

    codes: torch.Tensor
    scale: torch.Tensor
    tensor_scale: torch.Tensor
    block_2d: bool = False
    block_size: int = NVFP4_BLOCK

    def elements(self) -> torch.Tensor:
        """The e2m1 values as fp32, unscaled."""
        return e2m1_to_fp32(unpack_e2m1(self.codes))

    def dequantize(self, with_tensor_scale: bool = True) -> torch.Tensor:
        """fp32. Without the tensor scale the values are exact (e2m1 x e4m3 fits in fp32); the
        tensor scale is one more fp32 multiply (the GEMM's alpha on hardware)."""
        e = self.elements()
        blocks = e.reshape(*e.shape[:-1], -1, self.block_size)
        out = (blocks * self.scale.to(torch.float32).unsqueeze(-1)).reshape(e.shape)
        return out * self.tensor_scale if with_tensor_scale else out


# ----------------------------------------------------------------------------- helpers


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2.0**e in fp32, exactly, for integer e in [-149, 127] (built from the bits)."""
    e = e.to(torch.int32)
    normal = torch.bitwise_left_shift((e + 127).clamp(min=1), 23)
    subnormal = torch.bitwise_left_shift(torch.ones_like(e), (e + 149).clamp(0, 22))
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) for finite x > 0 (fp32 subnormals included), exact; int32."""
    _, e = torch.frexp(x.to(torch.float32))
    return e - 1


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for finite x > 0, exact; int32."""
    m, e = torch.frexp(x.to(torch.float32))
    return torch.where(m == 0.5, e - 1, e)


def e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    s = scale.view(torch.uint8).to(torch.int32)
    return torch.where(s == E8M0_NAN, torch.nan, exp2_int(s - E8M0_BIAS))


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(
            f"{what} quantizes along the last dimension in blocks of {block}; "
            f"shape {tuple(x.shape)} is not a multiple (pad the reduction dim with zeros)"
        )
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_amax(blocks: torch.Tensor, check_finite: bool, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax of each block over its finite values, which blocks are all finite). amax propagates
    NaN and inf, so finiteness is read off the amaxes (1/16 or 1/32 of the data)."""
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    if check_finite and not bool(finite.all()):
        n_nan, n_bad = int(torch.isnan(blocks).sum()), int((~torch.isfinite(blocks)).sum())
        raise NonFiniteBlockError(
            f"{what}: the tensor of shape {tuple(blocks.shape[:-2]) + (blocks.shape[-2] * blocks.shape[-1],)} "
            f"holds {n_nan} NaN and {n_bad - n_nan} inf value(s); a block scale cannot be derived "
            "from them (pass check_finite=False to encode NaN scales instead)"
        )
    if not check_finite:
        amax = torch.where(finite, amax, torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=-1))
    return amax, finite


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte along the last dim: element 2i low nibble, 2i+1 high (torchao's)."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | torch.bitwise_left_shift(c[..., 1::2], 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8)
    return torch.stack([p & 0xF, torch.bitwise_right_shift(p, 4)], dim=-1).reshape(*p.shape[:-1], -1)


def e2m1_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = grid[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def _round_e2m1_parts(
    y: torch.Tensor, generator: torch.Generator | None, codes: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(4-bit codes, uint8, or None unless `codes`; the rounded values, fp32, signed) of y. On
    [0, 2), [2, 4), [4, 6] the grid has steps 0.5, 1, 2 (powers of two, so |y| / step is exact):
    the value is r * step and the code r + 0, 2, 4 for the integer r that |y| / step rounds to."""
    a = y.abs().clamp(max=E2M1_MAX)
    small, mid = a < 2, a < 4
    step = torch.where(small, 0.5, torch.where(mid, 1.0, 2.0))
    t = a / step
    if generator is None:
        r = torch.round(t)  # half to even: an even r is an even code, since the offsets are even
    else:
        lo = torch.floor(t)
        u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
        r = lo + (u < (t - lo)).to(t.dtype)
    value = torch.copysign(r * step, y)  # the sign of y, -0 included
    if not codes:
        return None, value
    code = (r + torch.where(small, 0.0, torch.where(mid, 2.0, 4.0))).to(torch.uint8)
    return code | (torch.signbit(y).to(torch.uint8) << 3), value


def round_e2m1(y: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 values already scaled into e2m1's range -> 4-bit codes (uint8, sign in bit 3).

    Magnitudes above 6 saturate to 6. Without a generator: round to nearest, ties to the even
    code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). With one:
    stochastic rounding, up with probability (|y| - lo) / (hi - lo) from torch.rand(generator),
    so E[result] = y for |y| <= 6 (to the 2^-24 resolution of torch.rand). The sign of y is kept,
    -0 included, as torchao keeps it."""
    codes, _ = _round_e2m1_parts(y, generator)
    assert codes is not None  # asked for (codes=True)
    return codes


# ----------------------------------------------------------------------------- MXFP8


def mx_scale_exponent(amax: torch.Tensor, scale_mode: str = "rceil") -> torch.Tensor:
    """The unbiased shared exponent of each block (int32) from its fp32 amax (finite, >= 0)."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, not {scale_mode!r}")
    amax = amax.to(torch.float32)
    zero = amax == 0
    safe = torch.where(zero, 1.0, amax)
    if scale_mode == "floor":
        e = floor_log2(safe) - E4M3_EMAX
    else:
        e = ceil_log2(safe / E4M3_MAX)  # the fp32 division torchao and cuBLAS round first
    e = torch.where(zero, -E8M0_BIAS, e)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize_mxfp8(
    x: torch.Tensor, *, block_size: int = MX_BLOCK, scale_mode: str = "rceil", check_finite: bool = True
) -> MXFP8Quantized:
    """MXFP8 (e4m3 elements, E8M0 scales) along the last dim; see the module docstring.

    Args:
        x: the tensor to quantize; its last dim a multiple of `block_size` (pad it with zeros).
        block_size: elements sharing one scale (32 in the MX spec).
        scale_mode: the scale rule, "rceil" (the training recipes') or "floor" (the spec's).
        check_finite: True refuses NaN / inf in `x` (NonFiniteBlockError; one host sync); False
            gives a block holding one a NaN scale instead.
    """
    blocks = _blocks(x, block_size, "MXFP8")
    amax, finite = _block_amax(blocks, check_finite, "MXFP8 quantization")
    e = mx_scale_exponent(amax, scale_mode)
    # v * 2^-e is exact: 2^-e is in [2^-127, 2^127] and anything it pushes into fp32's denormals
    # is far below e4m3's smallest subnormal relative to the block.
    y = (blocks * exp2_int(-e).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    data = y.to(torch.float8_e4m3fn).reshape(x.shape)
    scale = (e + E8M0_BIAS).to(torch.uint8)
    if not check_finite:
        scale = torch.where(finite, scale, torch.full_like(scale, E8M0_NAN))
    return MXFP8Quantized(data, scale, block_size)


# ----------------------------------------------------------------------------- NVFP4


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 s_t = amax / (448 * 6), floored at 2^-126 (zero or denormal tensors)."""
    return (amax.to(torch.float32) / NVFP4_TENSOR_DIVISOR).clamp(min=F32_MIN_NORMAL)


def _nvfp4_block_scale(block_amax: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    s = (block_amax / E2M1_MAX) / tensor_scale
    return s.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def _tile_amax(block_amax: torch.Tensor, shape: torch.Size, tile: int) -> torch.Tensor:
    """From the amaxes of the 1 x tile blocks of a 2-D tensor, (r, c // tile): the amax of each
    tile x tile square, repeated on its rows (the 1 x tile layout the GEMM reads)."""
    if len(shape) != 2 or shape[0] % tile or shape[1] % tile:
        raise ValueError(f"2-D NVFP4 scaling needs a 2-D tensor with both dims multiples of {tile}, not {tuple(shape)}")
    t = block_amax.reshape(shape[0] // tile, tile, -1).amax(dim=1)
    return t.repeat_interleave(tile, dim=0)


def _nvfp4_parts(
    x: torch.Tensor,
    generator: torch.Generator | None,
    block_2d: bool,
    tensor_amax: torch.Tensor | None,
    check_finite: bool,
    want_codes: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, signed e2m1 values in blocks, block scales e4m3, tensor scale fp32) of x."""
    blocks = _blocks(x, NVFP4_BLOCK, "NVFP4")
    block_amax, finite = _block_amax(blocks, check_finite, "NVFP4 quantization")
    amax = block_amax.amax() if tensor_amax is None else tensor_amax.to(torch.float32)
    s_t = nvfp4_tensor_scale(amax)
    if block_2d:
        block_amax = _tile_amax(block_amax, x.shape, NVFP4_BLOCK)
    s_b = _nvfp4_block_scale(block_amax, s_t)
    s_b32 = s_b.to(torch.float32)
    # The reciprocal as torchao (and its Triton kernel) computes it: (1 / s_t) / s_b.
    recip = torch.where(s_b32 > 0, (1.0 / s_t) / torch.where(s_b32 > 0, s_b32, 1.0), 0.0)
    y = blocks * recip.unsqueeze(-1)  # magnitudes past 6 saturate in the rounding
    codes, values = _round_e2m1_parts(y, generator, want_codes)
    if not check_finite:
        nan = torch.tensor(float("nan")).to(torch.float8_e4m3fn).view(torch.uint8)
        s_b = torch.where(finite, s_b.view(torch.uint8), nan).view(torch.float8_e4m3fn)
    return None if codes is None else codes.reshape(x.shape), values, s_b, s_t


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    block_2d: bool = False,
    tensor_amax: torch.Tensor | None = None,
    check_finite: bool = True,
) -> NVFP4Quantized:
    """NVFP4 along the last dim; see the module docstring.

    Args:
        x: the tensor to quantize; its last dim a multiple of 16 (both dims with `block_2d`).
        generator: turns on stochastic rounding of the elements (the scales are always RNE);
            None rounds to nearest even.
        block_2d: one scale per 16x16 tile instead of per 1x16 block.
        tensor_amax: overrides the amax the tensor scale is derived from (a delayed or
            all-reduced amax); None takes x's own.
        check_finite: True refuses NaN / inf in `x` (NonFiniteBlockError; one host sync); False
            gives a block holding one a NaN scale instead.
    """
    codes, _, s_b, s_t = _nvfp4_parts(x, generator, block_2d, tensor_amax, check_finite)
    assert codes is not None  # asked for (want_codes=True)
    return NVFP4Quantized(pack_e2m1(codes), s_b, s_t, block_2d)


def nvfp4_dequantized(
    x: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    block_2d: bool = False,
    tensor_amax: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_nvfp4(x, ...).dequantize(with_tensor_scale=False) and the tensor scale, without
    packing and decoding the codes (the emulated GEMM's path; the same bits).

    Args:
        x: the tensor to quantize, as quantize_nvfp4 takes it.
        generator: stochastic rounding of the elements; None rounds to nearest even.
        block_2d: one scale per 16x16 tile instead of per 1x16 block.
        tensor_amax: the amax the tensor scale is derived from; None takes x's own.
        check_finite: True refuses NaN / inf in `x` (NonFiniteBlockError; one host sync); False
            gives a block holding one a NaN scale instead.
    """
    _, values, s_b, s_t = _nvfp4_parts(x, generator, block_2d, tensor_amax, check_finite, want_codes=False)
    return (values * s_b.to(torch.float32).unsqueeze(-1)).reshape(x.shape), s_t


# ----------------------------------------------------------------------------- the recipe


FORMATS = ("mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class BlockScaledRecipe:
    """One block-scaled recipe. `seed` seeds the RHT signs (fixed for the run, as NVIDIA's recipe
    uses one sign vector) and, per module, the SR generator. `check_finite` (off: training's
    setting) refuses NaN / inf in any operand (NonFiniteBlockError; one host sync per quantized
    operand, six per Linear step). Off, a block holding one gets a NaN scale and the NaN reaches
    the output or the gradients, where training's own check finds it: fp16's loss scaler skips the
    step and backs off (an overflowed scaled gradient is the common case), training.skip_nonfinite_steps
    skips it, otherwise the run stops with its non-finite error. No read of the device either way."""

    format: Literal["mxfp8", "nvfp4"]
    mx_scale_mode: ScaleMode = "rceil"
    weight_2d: bool = False
    rht: bool = False
    stochastic_rounding: bool = False
    seed: int = 0
    check_finite: bool = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"block-scaled format must be one of {FORMATS}, not {self.format!r}")
        if self.mx_scale_mode not in SCALE_MODES:
            raise ValueError(f"mx_scale_mode must be one of {SCALE_MODES}, not {self.mx_scale_mode!r}")
        extras = [n for n in ("weight_2d", "rht", "stochastic_rounding") if getattr(self, n)]
        if self.format == "mxfp8" and extras:
            raise ValueError(
                f"{', '.join(extras)} belong to the nvfp4 recipe; mxfp8 (torchao's MXLinear) "
                "has 1x32 scaling, no RHT and no stochastic rounding"
            )

    @classmethod
    def nvfp4_full(cls, seed: int = 0) -> BlockScaledRecipe:
        """NVIDIA's NVFP4 pre-training recipe: 2-D weights, RHT on wgrad, SR on gradients."""
        return cls("nvfp4", weight_2d=True, rht=True, stochastic_rounding=True, seed=seed)

    @property
    def block_size(self) -> int:
        return MX_BLOCK if self.format == "mxfp8" else NVFP4_BLOCK

    def describe(self) -> dict[str, str]:
        """Each pass's operands and their format, for a report."""
        if self.format == "mxfp8":
            f = f"mxfp8 e4m3 1x32 e8m0 ({self.mx_scale_mode})"
            return {"forward": f"x {f}; W {f}", "dgrad": f"dy {f}; W^T {f}", "wgrad": f"dy^T {f}; x^T {f}"}
        w = "nvfp4 16x16" if self.weight_2d else "nvfp4 1x16"
        sr = " SR" if self.stochastic_rounding else ""
        rht = " RHT16" if self.rht else ""
        return {
            "forward": f"x nvfp4 1x16; W {w}",
            "dgrad": f"dy nvfp4 1x16{sr}; W^T {w}",
            "wgrad": f"dy^T nvfp4 1x16{sr}{rht}; x^T nvfp4 1x16{rht}",
        }


def recipe_of(
    fmt: str, scale_mode: ScaleMode, weight_2d: bool, rht: bool, sr: bool, seed: int
) -> BlockScaledRecipe | None:
    """The config's recipe (None: block_scaled = "none"); the nvfp4 options apply to nvfp4 only.

    Args:
        fmt: mixed_precision.block_scaled: "none", "mxfp8" or "nvfp4".
        scale_mode: MXFP8's scale rule, "rceil" or "floor" (see the module docstring).
        weight_2d: NVFP4 weights scaled in 16x16 tiles instead of 1x16 blocks.
        rht: NVFP4's weight-gradient operands rotated by a 16-point random Hadamard transform.
        sr: NVFP4's gradient operands rounded stochastically.
        seed: seeds the RHT signs and each module's stochastic-rounding generator.
    """
    if fmt == "none":
        return None
    if fmt == "mxfp8":
        return BlockScaledRecipe("mxfp8", mx_scale_mode=scale_mode, seed=seed)
    return BlockScaledRecipe("nvfp4", weight_2d=weight_2d, rht=rht, stochastic_rounding=sr, seed=seed)
