"""Block-scaled formats in emulation: MXFP8 and NVFP4 quantization against the specs'
rules on hand-made blocks, bit-equality with torchao's quantizers on random data, stochastic
rounding (unbiased, reproducible), the random Hadamard transform (cancels), and the emulated
Linear's three GEMMs against an fp64 reference within the format's error bound.

The bound (`_gemm_bound`): each operand element v, in a block with scale S (MXFP8: X = 2^e;
NVFP4: s_t * s_b), is off by at most E(v) = S * max(r * |v/S|, a, |v/S| - vmax) with
(r, a, vmax) = (2^-4, 2^-10, 448) for e4m3 (half an ulp of 3 mantissa bits; half e4m3's smallest
subnormal 2^-9; saturation), (2^-2, 2^-2, 6) for e2m1 round-to-nearest (the grid's largest
relative half-gap is 1/4, its smallest absolute one 1/4) and (2^-1, 2^-1, 6) for e2m1 stochastic
rounding (any point of a gap). Then for C = A B^T over K:
  |C_emulated - C_exact| <= sum_k (E_a |b| + |a| E_b + E_a E_b) + (gamma_K + 3u) sum_k |qa| |qb|
where u = 2^-24 and gamma_K = K u / (1 - K u) covers the fp32 accumulation in any order (the
products of dequantized operands are exact in fp32) and the 3u the tensor-scale alpha. The Linear
returns C in its input's dtype: one more rounding, + u_out |C_returned| (u_out = 2^-8 for a bf16
output: 8 significant bits, round to nearest; 0 for fp32). A priori
(no saturation, no subnormals) that is |error| <= (2r + r^2 + gamma_K (1 + r)^2) sum_k |a||b|:
12.9% of sum |a||b| for e4m3 (r = 1/16), 56.3% for e2m1 RNE; the measured errors are far below
it (random signs cancel), and the test checks the element-wise a posteriori form.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit import linear as bl

pytestmark = pytest.mark.unit

U32 = 2.0**-24
GRID = torch.tensor(bs.E2M1_GRID)


def _torchao():
    """torchao's mx_formats, or skip (the emulation itself never needs torchao)."""
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
        nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
        cfg = pytest.importorskip("torchao.prototype.mx_formats.config")
        kern = pytest.importorskip("torchao.prototype.mx_formats.kernels")
    finally:
        quiet.setLevel(level)
    return mx, nv, cfg, kern


def _row(*blocks: list[float], block: int) -> torch.Tensor:
    return torch.tensor([v for b in blocks for v in (b + [0.0] * (block - len(b)))], dtype=torch.float32)


# ----------------------------------------------------------------------------- e2m1


def test_e2m1_grid_codes_decode_to_the_sixteen_values() -> None:
    vals = bs.e2m1_to_fp32(torch.arange(16, dtype=torch.uint8))
    assert vals[:8].tolist() == list(bs.E2M1_GRID)
    assert vals[8:].tolist() == [-v for v in bs.E2M1_GRID]
    assert torch.signbit(vals[8]) and not torch.signbit(vals[0])  # code 8 is -0
    # every grid value rounds to its own code, either way of rounding
    g = torch.Generator().manual_seed(0)
    assert bs.round_e2m1(vals).tolist() == list(range(16))
    assert bs.round_e2m1(vals, generator=g).tolist() == list(range(16))


def test_e2m1_round_to_nearest_even_ties_and_saturation() -> None:
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 2.9, 4.4, 6.5, 1e9, -5.0, -0.1, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 3.0, 4.0, 6.0, 6.0, -4.0, -0.0, -6.0]
    got = bs.e2m1_to_fp32(bs.round_e2m1(y))
    assert got.tolist() == want
    assert torch.signbit(got[14])  # -0.1 -> -0, sign kept


def test_e2m1_round_to_nearest_even_equals_a_brute_force_nearest_on_a_dense_sweep() -> None:
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0))])
    y = torch.cat([torch.linspace(-7, 7, 200_001), near, -near])
    d = (y.abs().clamp(max=6).unsqueeze(1) - GRID).abs()
    best = d.min(1, keepdim=True).values
    cand = (d == best).to(torch.int64) * torch.arange(8)  # the tied codes; prefer the even one
    even = torch.where(
        ((d == best) & (torch.arange(8) % 2 == 0)).any(1), (cand * (cand % 2 == 0)).amax(1), cand.amax(1)
    )
    want = even.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)
    assert torch.equal(bs.round_e2m1(y), want)


def test_e2m1_pack_puts_the_even_element_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 15, 8, 0, 7]], dtype=torch.uint8)
    packed = bs.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x8F, 0x70]]
    assert torch.equal(bs.unpack_e2m1(packed), codes)


# ----------------------------------------------------------------------------- MXFP8 worked values


def test_mxfp8_worked_values_of_the_ocp_floor_rule() -> None:
    x = _row(
        [448.0, -1.0, 2.0**-9],  # amax 448: e = 8 - 8 = 0, scale 0x7F, elements exact
        [3.0, 0.1, 1e-4, 2.0**-17, 3 * 2.0**-18],  # amax 3: X = 2^(1-8) = 2^-7
        [480.0, 500.0, 460.0, 256.0],  # amax 500: X = 2^0; 480, 500, 460 saturate to 448
        [],  # zero block
        [2.0**-120, -(2.0**-121)],  # e = -128 clamped to -127 (E8M0's smallest, 0x00)
        [2.0**-140],  # fp32 subnormal: clamped X = 2^-127, element 2^-13 -> 0
        block=32,
    )
    q = bs.quantize_mxfp8(x, scale_mode="floor")
    assert q.scale.tolist() == [127, 120, 127, 0, 0, 0]
    d = q.dequantize().reshape(6, 32)
    assert d[0, :3].tolist() == [448.0, -1.0, 2.0**-9]
    # 0.1 * 2^7 = 12.8 -> 13 (spacing 1 in [8, 16)); 1e-4 * 2^7 = 0.0128 -> 7 * 2^-9 (subnormal);
    # 2^-17 * 2^7 = 2^-10 is half the smallest subnormal: a tie, to even (0); 1.5 * 2^-10 -> 2^-9
    assert d[1, :5].tolist() == [3.0, 13 * 2.0**-7, 7 * 2.0**-9 * 2.0**-7, 0.0, 2.0**-16]
    assert d[2, :4].tolist() == [448.0, 448.0, 448.0, 256.0]
    assert d[3].abs().sum() == 0 and not torch.signbit(d[3]).any()
    assert d[4, :2].tolist() == [2.0**-120, -(2.0**-121)]  # exact: 128 and 64 times 2^-127
    assert d[5, 0] == 0.0
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.uint8


def test_mxfp8_rceil_rounds_the_scale_up_and_clips_nothing() -> None:
    x = _row([448.0, 1.0], [449.0, 100.0], [500.0], block=32)
    q = bs.quantize_mxfp8(x, scale_mode="rceil")
    assert q.scale.tolist() == [127, 128, 128]  # 448/448 = 2^0; 449/448 and 500/448 -> 2^1
    d = q.dequantize().reshape(3, 32)
    # 449/2 = 224.5 -> 224 (spacing 16 in [128, 256)); 100/2 = 50 -> 48 (spacing 4 in [32, 64))
    assert d[1, :2].tolist() == [448.0, 96.0]
    assert d[2, 0] == 512.0  # 500/2 = 250 -> 256; the floor rule saturates it to 448 instead


def test_mxfp8_rceil_dequantizes_the_top_of_fp32_to_inf() -> None:
    """rceil's one overflow: with scale 2^120 an element from 248 x 2^120 (3.2965e38) up rounds to
    e4m3's 256 (248 is the tie between 240 and 256, to even), and 256 x 2^120 = 2^128 is past
    fp32's largest value. The floor rule clamps such a block's top to 448 x 2^119 instead."""
    x = _row([248 * 2.0**120, 247.9 * 2.0**120, 3.4e38], block=32).reshape(1, 32)
    q = bs.quantize_mxfp8(x, scale_mode="rceil")
    assert q.scale.item() == 127 + 120 and q.data.to(torch.float32)[0, :3].tolist() == [256.0, 240.0, 256.0]
    d = q.dequantize()[0, :3]
    assert d[0] == d[2] == math.inf and d[1] == 240 * 2.0**120
    assert bs.quantize_mxfp8(x, scale_mode="floor").dequantize()[0, :3].tolist() == [448 * 2.0**119] * 3


def test_mxfp8_refuses_nan_and_inf_or_encodes_a_nan_scale() -> None:
    x = torch.ones(2, 64)
    x[0, 40] = float("nan")
    with pytest.raises(bs.NonFiniteBlockError, match=r"1 NaN and 0 inf value\(s\).*check_finite=False"):
        bs.quantize_mxfp8(x)
    x[1, 3] = float("inf")
    with pytest.raises(bs.NonFiniteBlockError, match="1 NaN and 1 inf"):
        bs.quantize_mxfp8(x)
    q = bs.quantize_mxfp8(x, check_finite=False)
    assert q.scale.tolist() == [[119, 255], [255, 119]]  # 0xFF is E8M0's NaN
    d = q.dequantize()
    assert d[0, 32:].isnan().all() and d[1, :32].isnan().all()
    assert (d[0, :32] == 1).all() and (d[1, 32:] == 1).all()


def test_quantizers_refuse_a_length_that_is_not_a_multiple_of_the_block() -> None:
    with pytest.raises(ValueError, match="blocks of 32.*pad the reduction dim"):
        bs.quantize_mxfp8(torch.ones(4, 48))
    with pytest.raises(ValueError, match="blocks of 16"):
        bs.quantize_nvfp4(torch.ones(4, 24))
    with pytest.raises(ValueError, match="both dims multiples of 16"):
        bs.quantize_nvfp4(torch.ones(8, 32), block_2d=True)


# ----------------------------------------------------------------------------- NVFP4 worked values


def test_nvfp4_worked_values_with_an_exact_tensor_scale() -> None:
    # tensor_amax = 2688 makes s_t = 2688 / (448 * 6) = 1 exactly, so s_b = e4m3(amax / 6).
    x = _row(
        [6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, -5, 0.3, 4.4, 2.9, 0, -6],  # s_b = 1
        [0.75, 0.1, -0.05],  # s_b = 0.125: elements x8 -> 6, 0.8 -> 1, -0.4 -> -0.5
        [6.3, 3.0],  # 6.3/6 = 1.05 -> e4m3 1.0: 6.3 saturates to 6
        [6 * 2.0**-8, 2.0**-8],  # s_b = 2^-8, an e4m3 subnormal (kept)
        [6 * 2.0**-11],  # s_b = 2^-11 rounds to e4m3 0: the block flushes to 0
        [],  # zero block: s_b = 0, elements +0
        block=16,
    )
    q = bs.quantize_nvfp4(x, tensor_amax=torch.tensor(2688.0))
    assert q.tensor_scale.item() == 1.0
    assert q.scale.to(torch.float32).tolist() == [1.0, 0.125, 1.0, 2.0**-8, 0.0, 0.0]
    d = q.dequantize().reshape(6, 16)
    assert d[0, :15].tolist() == [6, 4, 4, 2, 2, 1, 1, 0, -0.0, -4, 0.5, 4, 3, 0, -6]
    assert d[1, :3].tolist() == [0.75, 0.125, -0.0625]
    assert d[2, :2].tolist() == [6.0, 3.0]
    assert d[3, :2].tolist() == [6 * 2.0**-8, 2.0**-8]
    assert (d[4:] == 0).all()
    assert q.codes.shape == (48,) and q.codes.dtype == torch.uint8 and q.scale.dtype == torch.float8_e4m3fn


def test_nvfp4_tensor_scale_puts_the_largest_block_at_448() -> None:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 1e-3
    q = bs.quantize_nvfp4(x)
    assert q.tensor_scale.item() == pytest.approx(x.abs().max().item() / 2688, rel=1e-7)
    assert q.scale.to(torch.float32).max().item() == 448.0
    zero = bs.quantize_nvfp4(torch.zeros(2, 32))  # no 0/0: s_t floored at 2^-126
    assert zero.tensor_scale.item() == 2.0**-126 and (zero.dequantize() == 0).all()


def test_nvfp4_refuses_nan_or_encodes_a_nan_scale() -> None:
    x = torch.ones(1, 32)
    x[0, 20] = float("nan")
    with pytest.raises(bs.NonFiniteBlockError, match="NVFP4 quantization.*1 NaN"):
        bs.quantize_nvfp4(x)
    d = bs.quantize_nvfp4(x, check_finite=False).dequantize()
    assert (d[0, :16] == 1).all() and d[0, 16:].isnan().all()


def test_nvfp4_2d_scaling_quantizes_w_and_w_transposed_identically() -> None:
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    w[5, 20] = 40.0  # an outlier: its tile's 256 elements share its scale
    q2 = bs.quantize_nvfp4(w, block_2d=True)
    s = q2.scale.to(torch.float32)  # (48, 2): one value per 16x16 tile, repeated on its 16 rows
    assert torch.equal(s, s[::16].repeat_interleave(16, 0))
    assert s[0, 1] == 448.0 and (s[16:, :] < 448).all()
    qt = bs.quantize_nvfp4(w.t().contiguous(), block_2d=True)
    assert torch.equal(q2.dequantize(), qt.dequantize().t())
    q1, q1t = bs.quantize_nvfp4(w), bs.quantize_nvfp4(w.t().contiguous())
    assert not torch.equal(q1.dequantize(), q1t.dequantize().t())  # 1x16 differs per orientation


def test_the_gemm_path_dequantizes_the_same_bits_without_packing() -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(20))
    for kw in ({}, {"block_2d": True}):
        for seed in (None, 21):

            def gen(seed: int | None = seed) -> torch.Generator | None:
                return None if seed is None else torch.Generator().manual_seed(seed)

            q = bs.quantize_nvfp4(w, generator=gen(), **kw)
            deq, s_t = bs.nvfp4_dequantized(w, generator=gen(), **kw)
            assert torch.equal(deq, q.dequantize(with_tensor_scale=False)) and torch.equal(s_t, q.tensor_scale)


# ----------------------------------------------------------------------------- torchao parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_equal_torchao_bit_for_bit_on_random_data(dtype) -> None:
    mx, nv, cfg, kern = _torchao()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-4, 4, 64).unsqueeze(1)).to(dtype)
    modes = {"floor": cfg.ScaleCalculationMode.FLOOR, "rceil": cfg.ScaleCalculationMode.RCEIL}
    for mode, theirs in modes.items():
        q = bs.quantize_mxfp8(x, scale_mode=mode)
        scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, theirs)
        assert torch.equal(q.scale, scale.view(torch.uint8)), mode
        assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8)), mode
    y = (torch.randn(64, 256, generator=g) * 3).to(dtype)  # no block below torchao's scale clamp
    q = bs.quantize_nvfp4(y)
    scale, codes = nv.nvfp4_quantize(y, 16, nv.per_tensor_amax_to_scale(y.float().abs().amax()))
    assert torch.equal(q.scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(q.codes, codes.view(torch.uint8))
    z = torch.randn(4096, generator=g) * 4
    assert torch.equal(bs.round_e2m1(z), kern.f32_to_f4_unpacked(z))
    assert torch.equal(bs.pack_e2m1(bs.round_e2m1(z)), kern.pack_uint4(bs.round_e2m1(z)))


def test_where_torchao_departs_from_the_rule() -> None:
    """Documented, not copied: torchao's FLOOR scales a block with amax < 2^-118 by 2^-126 while
    storing 0x00 (2^-127), so its own dequantization is off by 2; its RCEIL takes
    ceil(log2(amax / 448)) with an fp32 log2, which rounds the log2 of a quotient just above a
    power of two 2^k onto k for |k| >= 5 (fp32's spacing there is coarser than log2(1 + 2^-23)):
    one scale lower than the rule, the block's top clamped to 448; its NVFP4 clamps block scales
    up to 2^-6 (e4m3's smallest normal). Here all follow the rule (see lowbit/formats.py)."""
    mx, nv, cfg, _ = _torchao()
    for k, lower in ((0, False), (3, False), (5, True), (10, True), (40, True), (-20, True)):
        z = _row([448.0 * 2.0**k * (1 + 2.0**-23)], block=32).reshape(1, 32)
        theirs, _ = mx.to_mx(z, torch.float8_e4m3fn, 32, cfg.ScaleCalculationMode.RCEIL)
        ours = bs.quantize_mxfp8(z, scale_mode="rceil")
        assert ours.scale.item() == 127 + k + 1 and theirs.view(torch.uint8).item() == 127 + k + 1 - lower, k
    x = _row([2.0**-120], block=32).reshape(1, 32)
    scale, data = mx.to_mx(x, torch.float8_e4m3fn, 32, cfg.ScaleCalculationMode.FLOOR)
    theirs = data.to(torch.float32)[0, 0] * 2.0**-127
    assert scale.view(torch.uint8).item() == 0 and theirs.item() == 2.0**-121
    assert bs.quantize_mxfp8(x, scale_mode="floor").dequantize()[0, 0].item() == 2.0**-120
    y = _row([2688.0], [6 * 2.0**-8], block=16).reshape(1, 32)
    theirs_scale, _ = nv.nvfp4_quantize(y, 16, torch.tensor(1.0))
    assert theirs_scale.to(torch.float32).tolist() == [[448.0, 2.0**-6]]
    assert bs.quantize_nvfp4(y).scale.to(torch.float32).tolist() == [[448.0, 2.0**-8]]


# ----------------------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased() -> None:
    draws = 4000
    y = torch.linspace(-6.0, 6.0, 97)  # grid points, midpoints and everything between
    g = torch.Generator().manual_seed(4)
    vals = bs.e2m1_to_fp32(bs.round_e2m1(y.expand(draws, -1).contiguous(), generator=g))
    mean = vals.to(torch.float64).mean(0)
    # per value: one draw is lo or hi with p = (y - lo) / gap, std = gap * sqrt(p (1 - p))
    lo = GRID[(torch.bucketize(y.abs(), GRID, right=True) - 1).clamp(0, 7)]
    hi = GRID[(torch.bucketize(y.abs(), GRID, right=True)).clamp(0, 7)]
    gap = (hi - lo).clamp(min=1e-12)
    p = (y.abs() - lo) / gap
    std = gap * torch.sqrt(p * (1 - p))
    tol = 5 * std / math.sqrt(draws) + 1e-6  # 5 sigma of the mean
    assert ((mean - y.double()).abs() <= tol.double()).all()
    # round to nearest is biased on the same points: 0.3 -> 0.5 every time
    assert bs.e2m1_to_fp32(bs.round_e2m1(torch.tensor([0.3]))).item() == 0.5
    exact = vals[:, torch.isin(y.abs(), GRID)]
    assert (exact == exact[0]).all()  # grid points never move


def test_stochastic_nvfp4_dequantizes_to_the_input_on_average_and_replays_from_the_seed() -> None:
    draws = 1500
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    # 1500 copies in one call, with the tensor amax of one copy: every copy gets the same scales
    q = bs.quantize_nvfp4(x.repeat(draws, 1), generator=g, tensor_amax=x.abs().amax())
    assert torch.equal(q.scale.view(torch.uint8), q.scale.view(torch.uint8)[:4].repeat(draws, 1))
    mean = q.dequantize().double().reshape(draws, 4, 64).mean(0)
    s = (q.scale[:4].to(torch.float32).repeat_interleave(16, -1) * q.tensor_scale).double()
    # a gap is at most 2 (in [4, 6]): one draw's std <= 1 (x S). An element whose block scale
    # rounded down lies past 6 and saturates, deterministically: its mean is off by (|x|/S - 6) S.
    clipped = (x.double().abs() / s - 6).clamp(min=0) * s
    assert ((mean - x.double()).abs() <= 5 * s / math.sqrt(draws) + clipped).all()
    assert (clipped > 0).any()  # the case is exercised
    first = bs.quantize_nvfp4(x, generator=torch.Generator().manual_seed(6))
    assert torch.equal(bs.quantize_nvfp4(x, generator=torch.Generator().manual_seed(6)).codes, first.codes)
    assert not torch.equal(bs.quantize_nvfp4(x, generator=torch.Generator().manual_seed(7)).codes, first.codes)


# ----------------------------------------------------------------------------- RHT


def test_rht_is_orthogonal_exactly_and_equals_torchao_s() -> None:
    r = bl.rht_matrix(seed=11)
    assert torch.equal(r @ r.t(), torch.eye(16))  # entries +-1/4: every sum is exact
    assert torch.equal(r, bl.rht_matrix(seed=11)) and not torch.equal(r, bl.rht_matrix(seed=12))
    signs = bl.rht_signs(11)
    _torchao()
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    assert torch.equal(get_rht_matrix(tuple(signs.int().tolist()), "cpu", torch.float32, 16), r)


def test_rht_on_both_wgrad_operands_cancels_up_to_fp32_rounding() -> None:
    g = torch.Generator().manual_seed(8)
    dy_t, x_t = torch.randn(24, 256, generator=g), torch.randn(40, 256, generator=g)  # (N, M), (K, M)
    dy_t[3, 17] = 300.0
    r = bl.rht_matrix(seed=9)
    a, b = bl.apply_rht(dy_t, r), bl.apply_rht(x_t, r)
    exact = dy_t.double() @ x_t.double().t()
    in_fp64 = bl.apply_rht(dy_t.double(), r) @ bl.apply_rht(x_t.double(), r).t()
    assert torch.allclose(in_fp64, exact, rtol=0, atol=1e-11)  # cancels: R R^T = I
    # fp32: each rotated element carries gamma_16 of |x||R|, the product gamma_M of |a||b|
    m = dy_t.shape[1]
    ra, rb = bl.apply_rht(dy_t.abs(), r.abs()).double(), bl.apply_rht(x_t.abs(), r.abs()).double()
    bound = (m + 2 * 16 + 4) * U32 * (ra @ rb.t())
    assert ((a @ b.t()).double() - exact).abs().le(bound).all()
    assert not torch.equal(a, dy_t)  # it did rotate: the outlier is spread over its 16-block
    assert a[3].abs().max() < 300.0 / 3


# ----------------------------------------------------------------------------- emulated GEMMs


def _elem_bound(v: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    r, a, vmax = {"e4m3": (2.0**-4, 2.0**-10, 448.0), "e2m1": (0.25, 0.25, 6.0), "e2m1_sr": (0.5, 0.5, 6.0)}[kind]
    safe = torch.where(scale > 0, scale, 1.0)
    y = v.double().abs() / safe
    e = torch.maximum(torch.maximum(r * y, torch.full_like(y, a)), y - vmax)
    # (1 + 2^-20): the fp32 rounding of v * (1/s) before the element rounds; a zero scale flushes
    return torch.where(scale > 0, safe * e * (1 + 2.0**-20), v.double().abs())


def _quantize_with_scale(t: torch.Tensor, recipe, gen=None, block_2d=False):
    """(dequantized fp64 with its tensor scale, the per-element scale, the kind of rounding)."""
    if recipe.format == "mxfp8":
        q = bs.quantize_mxfp8(t, scale_mode=recipe.mx_scale_mode)
        s = q.scale_fp32().repeat_interleave(32, -1)
        return q.dequantize().double(), s.double(), "e4m3"
    q = bs.quantize_nvfp4(t, generator=gen, block_2d=block_2d)
    s = q.scale.to(torch.float32).repeat_interleave(16, -1).double() * q.tensor_scale.double()
    return q.dequantize(with_tensor_scale=False).double() * q.tensor_scale.double(), s, "e2m1_sr" if gen else "e2m1"


def _pad_to(t: torch.Tensor, block: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, -t.shape[-1] % block)).contiguous()


def _gemm_bound(a, b, recipe, gen_a=None, block_2d_b=False):
    pad = -a.shape[-1] % recipe.block_size  # zeros, as the emulation pads the reduction dim
    a, b = torch.nn.functional.pad(a, (0, pad)), torch.nn.functional.pad(b, (0, pad))
    qa, sa, ka = _quantize_with_scale(a, recipe, gen_a)
    qb, sb, kb = _quantize_with_scale(b, recipe, None, block_2d_b)
    ea, eb = _elem_bound(a, sa, ka), _elem_bound(b, sb, kb)
    k = a.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    aa, ab = a.double().abs(), b.double().abs()
    return ea @ ab.t() + aa @ eb.t() + ea @ eb.t() + (gamma + 3 * U32) * (qa.abs() @ qb.abs().t())


RECIPES = {
    "mxfp8_floor": bs.BlockScaledRecipe("mxfp8", mx_scale_mode="floor"),
    "mxfp8_rceil": bs.BlockScaledRecipe("mxfp8", mx_scale_mode="rceil"),
    "nvfp4": bs.BlockScaledRecipe("nvfp4"),
    "nvfp4_2d": bs.BlockScaledRecipe("nvfp4", weight_2d=True),
}


def _operands(seed: int, m: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)  # blocks of differing range
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    x[1, 7], w[2, k // 2] = 80.0, 3.0  # outliers
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(RECIPES))
def test_emulated_forward_is_within_the_format_bound_of_fp64(name, dtype) -> None:
    recipe = RECIPES[name]
    x, w = (t.to(dtype).float() for t in _operands(10, 32, 48, 128))
    y = bl.block_scaled_linear(x.to(dtype), w.to(dtype), None, recipe)
    assert y.dtype == dtype
    exact = x.double() @ w.double().t()
    # the GEMM's bound, plus the output's rounding to bf16 (2^-8 of it; none in fp32)
    bound = (
        _gemm_bound(x, w, recipe, block_2d_b=recipe.weight_2d) + (dtype == torch.bfloat16) * 2.0**-8 * y.double().abs()
    )
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    # it is quantized (far above fp32's own error), and the bound is well under sum |x||w| (which
    # any error below "every sign wrong" meets) and near the a priori 2r + r^2 (56% / 13%; e2m1's
    # absolute half-gap of 1/4 below 1 adds to it)
    scale = x.double().abs() @ w.double().abs().t()
    assert err.sum() / scale.sum() > 1e-3
    assert bound.sum() / scale.sum() < (0.7 if recipe.format == "nvfp4" else 0.14)


def test_emulated_gemm_pads_a_reduction_dim_that_is_not_a_multiple_of_the_block() -> None:
    x, w = _operands(11, 8, 16, 80)  # 80 = 2.5 MX blocks
    xp, wp = torch.nn.functional.pad(x, (0, 16)), torch.nn.functional.pad(w, (0, 16))
    for recipe in RECIPES.values():
        assert torch.equal(bl.block_scaled_linear(x, w, None, recipe), bl.block_scaled_linear(xp, wp, None, recipe))


def _dgrad_wgrad_by_hand(x, w, dy, recipe, gen):
    """The backward GEMMs composed from the public pieces, to check the autograd wiring."""
    sr = gen if recipe.stochastic_rounding else None
    if recipe.weight_2d:
        w2d = bl.quantize_operand(w, recipe, block_2d=True)
        wq = w2d._replace(values=w2d.values.t())
    else:
        wq = bl.quantize_operand(w.t(), recipe)
    dx = bl.emulated_mm(bl.quantize_operand(dy, recipe, generator=sr), wq, dy.shape[0], w.shape[1])
    r = bl.rht_matrix(recipe.seed) if recipe.rht else None
    dw = bl.emulated_mm(
        bl.quantize_operand(dy.t(), recipe, generator=sr, rht=r), bl.quantize_operand(x.t(), recipe, rht=r), *w.shape
    )
    return dx, dw


@pytest.mark.parametrize("name", ["mxfp8_floor", "nvfp4", "nvfp4_full"])
def test_backward_gemms_are_the_recipe_s_and_within_the_bound(name) -> None:
    recipe = RECIPES.get(name) or bs.BlockScaledRecipe.nvfp4_full(seed=3)
    x, w = _operands(12, 64, 48, 32)
    dy = torch.randn(64, 48, generator=torch.Generator().manual_seed(13))
    lin = bl.BlockScaledLinear(32, 48, bias=True, recipe=recipe, sr_stream=5)
    with torch.no_grad():
        lin.weight.copy_(w)
    xr = x.clone().requires_grad_(True)
    gen_ = lin.sr_generator()
    state = gen_.get_state() if gen_ is not None else None
    lin(xr).backward(dy)
    gen = None
    if state is not None:
        gen = torch.Generator()
        gen.set_state(state)
    dx, dw = _dgrad_wgrad_by_hand(x, w, dy, recipe, gen)
    assert torch.equal(xr.grad, dx) and torch.equal(lin.weight.grad, dw)
    assert torch.equal(lin.bias.grad, dy.sum(0))
    # dgrad within the bound (SR's where the recipe rounds gradients stochastically)
    if state is not None:
        gen.set_state(state)
    b_dx = _gemm_bound(dy, w.t().contiguous(), recipe, gen, block_2d_b=recipe.weight_2d)
    assert ((dx.double() - dy.double() @ w.double()).abs() <= b_dx).all()
    # wgrad within the bound of its (rotated) operands plus the rotation's own fp32 error
    gt, xt = _pad_to(dy.t(), recipe.block_size), _pad_to(x.t(), recipe.block_size)
    slack = 0.0
    if recipe.rht:
        r = bl.rht_matrix(recipe.seed)
        slack = 40 * U32 * (bl.apply_rht(gt.abs(), r.abs()).double() @ bl.apply_rht(xt.abs(), r.abs()).double().t())
        gt, xt = bl.apply_rht(gt, r), bl.apply_rht(xt, r)
    b_dw = _gemm_bound(gt, xt, recipe, gen) + slack
    assert ((dw.double() - dy.double().t() @ x.double()).abs() <= b_dw).all()


def test_stochastic_gradients_replay_from_the_seed() -> None:
    x, w = _operands(14, 32, 32, 64)
    grads = []
    for seed in (1, 1, 2):
        lin = bl.BlockScaledLinear(64, 32, bias=False, recipe=bs.BlockScaledRecipe.nvfp4_full(seed=seed))
        with torch.no_grad():
            lin.weight.copy_(w)
        lin(x).sum().backward()
        grads.append(lin.weight.grad)
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def test_linear_runs_bf16_3d_inputs_and_from_linear_keeps_the_parameters() -> None:
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 32).to(torch.bfloat16)
    lin = bl.BlockScaledLinear.from_linear(base, bs.BlockScaledRecipe("mxfp8"))
    assert lin.weight is base.weight and lin.bias is base.bias
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 5, 32) and y.dtype == torch.bfloat16
    y.float().pow(2).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.bfloat16
    ref = base(x.detach()).float()
    assert ((y.float() - ref).norm() / ref.norm()) < 0.1  # e4m3: ~4% rms per element
    assert "recipe=mxfp8" in repr(lin)


def test_recipe_refuses_nvfp4_options_on_mxfp8_and_needs_a_generator_for_sr() -> None:
    with pytest.raises(ValueError, match="rht, stochastic_rounding belong to the nvfp4 recipe"):
        bs.BlockScaledRecipe("mxfp8", rht=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="one of"):
        bs.BlockScaledRecipe("fp4")
    with pytest.raises(ValueError, match="seeded torch.Generator"):
        bl.block_scaled_linear(torch.ones(2, 16), torch.ones(4, 16), None, bs.BlockScaledRecipe.nvfp4_full())
    assert bs.BlockScaledRecipe.nvfp4_full().describe()["wgrad"] == "dy^T nvfp4 1x16 SR RHT16; x^T nvfp4 1x16 RHT16"


def test_observers_see_each_gemm_s_block_format_per_pass() -> None:
    """What the audit will check: the element and scale dtypes, the block and the scales' shape
    of both operands of the forward, dgrad and wgrad GEMMs."""
    records: list[bl.GemmRecord] = []
    lin = bl.BlockScaledLinear(64, 48, recipe=bs.BlockScaledRecipe.nvfp4_full())
    with bl.observe_gemms(records.append):
        lin(torch.randn(2, 40, 64)).sum().backward()
    assert [r.what for r in records] == ["forward", "dgrad", "wgrad"]
    fwd, dgrad, wgrad = records
    assert fwd.format == "nvfp4" and fwd.shape == (80, 48, 64)
    assert fwd.a == bl.OperandInfo("float4_e2m1fn", "float8_e4m3fn", (1, 16), (80, 4), "rne", False)
    assert fwd.b == bl.OperandInfo("float4_e2m1fn", "float8_e4m3fn", (16, 16), (48, 4), "rne", False)
    assert dgrad.a.rounding == "stochastic" and dgrad.b.block == (16, 16) and dgrad.shape == (80, 64, 48)
    assert wgrad.a == bl.OperandInfo("float4_e2m1fn", "float8_e4m3fn", (1, 16), (48, 5), "stochastic", True)
    assert wgrad.b.rht and wgrad.b.rounding == "rne" and wgrad.shape == (48, 64, 80)
    mx: list[bl.GemmRecord] = []
    with bl.observe_gemms(mx.append):
        bl.block_scaled_linear(torch.randn(8, 64), torch.randn(16, 64), None, bs.BlockScaledRecipe("mxfp8"))
    assert mx[0].a == bl.OperandInfo("float8_e4m3fn", "float8_e8m0fnu", (1, 32), (8, 2), "rne", False)
    lin(torch.randn(2, 40, 64))
    assert len(records) == 3  # nothing recorded outside the context


def test_autocast_does_not_change_the_emulated_gemm() -> None:
    x, w = _operands(15, 16, 32, 64)
    for recipe in RECIPES.values():
        plain = bl.block_scaled_linear(x, w, None, recipe)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(bl.block_scaled_linear(x, w, None, recipe), plain)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_a_nan_activation_reaches_the_output_or_with_check_finite_is_refused(fmt) -> None:
    """Training's recipe lets a NaN through (to the loss scaler's and the trainer's checks, with
    no host read); check_finite = True refuses it."""
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    x[1, 3] = float("nan")
    with pytest.raises(bs.NonFiniteBlockError, match="NaN"):
        bl.block_scaled_linear(x, w, None, bs.BlockScaledRecipe(fmt, check_finite=True))
    y = bl.block_scaled_linear(x, w, None, bs.BlockScaledRecipe(fmt))
    assert y[1].isnan().all() and not y[[0, 2, 3]].isnan().any()


def test_a_module_built_on_meta_gets_its_sr_generator_when_it_first_runs() -> None:
    recipe = bs.BlockScaledRecipe.nvfp4_full(seed=4)
    grads = []
    for _ in range(2):
        lin = bl.BlockScaledLinear(64, 32, recipe=recipe, sr_stream=1, device="meta")
        lin.to_empty(device="cpu")
        with torch.no_grad():
            lin.weight.copy_(torch.linspace(-1, 1, 64 * 32).reshape(32, 64))
            lin.bias.zero_()
        assert lin.generator is None
        lin(torch.ones(16, 64)).pow(2).sum().backward()
        assert lin.generator is not None and lin.generator.device.type == "cpu"
        grads.append(lin.weight.grad)
    assert torch.equal(grads[0], grads[1])
    built = bl.BlockScaledLinear.from_linear(torch.nn.Linear(64, 32), recipe)
    assert built.sr_generator() is not None


def test_the_rht_matrix_is_built_once_per_seed_and_device(monkeypatch) -> None:
    """The wgrad's two rotations (and every Linear's, every step) take one cached R per (seed,
    device): the Hadamard matrix is not rebuilt on the CPU and copied to the device per GEMM."""
    built = []
    hadamard = bl.hadamard
    bl.rht_matrix.cache_clear()
    monkeypatch.setattr(bl, "hadamard", lambda n=bl.RHT_DIM: built.append(n) or hadamard(n))
    r = bl.rht_matrix(21, device="cpu")
    assert r is bl.rht_matrix(21, device=torch.device("cpu")) and torch.equal(r @ r.t(), torch.eye(16))
    assert built == [16] and bl.rht_matrix(22, device="cpu") is not r and built == [16, 16]
    lin = bl.BlockScaledLinear(64, 32, recipe=bs.BlockScaledRecipe.nvfp4_full(seed=21))
    for _ in range(2):  # two steps: forward, then dgrad and wgrad with both operands rotated
        lin(torch.randn(32, 64)).square().sum().backward()
    assert built == [16, 16]
