"""The quantization-error measures of precision/lowbit/quant_error.py on hand-made operands (what
benchmarks/blockscaled_error.py tabulates for real ones), and the numerics matrix's low-precision
GEMM rows resolving to the configs they name (no training)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.machine import cpu_scaled_mm_takes_rowwise_scales
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.lowbit import quant_error as qe


def _rel(q: torch.Tensor, x: torch.Tensor) -> float:
    return float((q - x).norm() / x.norm())


def test_bf16_error_is_within_half_an_ulp() -> None:
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    e = qe.quant_error(x, "bf16")
    # bf16 keeps 8 significant bits: each element within 2^-9 of itself, relatively.
    assert 0 < e.rel_l2 <= 2.0**-9 and e.flushed == 0 and e.saturated == 0
    assert qe.quant_error(x.to(torch.bfloat16).float(), "bf16").rel_l2 == 0.0


def test_fp8_tensorwise_equals_torchao_cast() -> None:
    float8_utils = pytest.importorskip("torchao.float8.float8_utils")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * 3
    for grad, dtype in ((False, torch.float8_e4m3fn), (True, torch.float8_e5m2)):
        scale = float8_utils.tensor_to_scale(x, dtype)
        ref = float8_utils.to_fp8_saturated(x * scale, dtype).to(torch.float32) / scale
        q, _ = qe.fake_quantize(x, "fp8 tensorwise", grad=grad)
        assert torch.equal(q, ref), dtype


def test_fp8_rowwise_scales_are_powers_of_two_per_row() -> None:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    x[3] *= 1000.0  # a row 1000x larger keeps the others' precision (tensorwise would not)
    q, _ = qe.fake_quantize(x, "fp8 rowwise")
    # e4m3 has 3 mantissa bits: every normal element within 2^-4 relatively (scales are powers of
    # two, so scaling adds no rounding; the row max lands in [224, 448]).
    big = x.abs() >= x.abs().amax(-1, keepdim=True) * 2.0**-8
    assert ((q - x).abs()[big] <= x.abs()[big] * 2.0**-4).all()
    # One tensor scale set by the large row pushes the small rows' tails below e4m3's range.
    assert qe.quant_error(x, "fp8 rowwise").flushed == 0 < qe.quant_error(x, "fp8 tensorwise").flushed


def test_mxfp8_floor_saturation_is_counted_per_block_and_rceil_has_none() -> None:
    x = torch.full((1, 64), 1.0)
    x[0, 0] = 1.9 * 2**5  # block 0: amax / 2^(5-8) = 486.4 > 464, clamped to 448
    x[0, 32] = 1.5 * 2**5  # block 1: 384, no clamp
    floor = qe.quant_error(x, "mxfp8 floor")
    assert floor.groups == 2 and floor.saturated == 1 and floor.saturated_frac == 0.5
    q, _ = qe.fake_quantize(x, "mxfp8 floor")
    assert q[0, 0] == 448 * 2.0**-3 and q[0, 32] == 48.0
    assert qe.quant_error(x, "mxfp8 rceil").saturated == 0
    # Powers-of-two scales only shift exponents: rceil and rowwise fp8 (e4m3 both, no clamp,
    # no subnormals here) give the same values.
    assert torch.equal(qe.fake_quantize(x, "mxfp8 rceil")[0], qe.fake_quantize(x, "fp8 rowwise")[0])


def test_nvfp4_flushes_what_rounds_below_a_quarter() -> None:
    # One block whose max is the tensor's: s_t = 6 / 2688, s_b = e4m3(6 / 6 / s_t) = 448, so the
    # elements are scaled by exactly 1 and round on the e2m1 grid: 0.2 -> 0 (flushed), 0.3 -> 0.5.
    x = torch.tensor([[6.0, 0.2, -0.2, 0.3, 1.0, 1.2, 2.6, 5.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    q, _ = qe.fake_quantize(x, "nvfp4 1x16")
    # The values are exact up to the fp32 tensor scale's one rounding (6 / 2688 is not dyadic).
    torch.testing.assert_close(q[0, :8], torch.tensor([6.0, 0.0, -0.0, 0.5, 1.0, 1.0, 3.0, 6.0]), rtol=2.0**-22, atol=0)
    e = qe.quant_error(x, "nvfp4 1x16")
    assert (e.nonzero, e.flushed, e.groups, e.saturated) == (8, 2, 1, 0)
    assert math.isclose(e.rel_l2, _rel(q, x), rel_tol=1e-5)
    assert math.isclose(e.max_err, 0.9 / 6.0, rel_tol=1e-6)  # 5.1 -> 6 is the largest miss


def test_nvfp4_clips_only_blocks_whose_scale_is_an_e4m3_subnormal() -> None:
    """A normal e4m3 block scale rounds by at most 1/16 of itself, so a block's top lands at most
    at 6 x 17/16 = 6.375 and rounds to 6 (not clipped); a scale below e4m3's smallest normal 2^-6
    (a block under 2^-6 x 6 x s_t, 1/28672 of the tensor's amax) rounds on the subnormals' fixed
    2^-9 grid, and its top can land far past 6."""
    x = torch.zeros(1, 48)
    x[0, 0] = 2688.0  # s_t = 2688 / 2688 = 1
    x[0, 16] = 6 * 1.0624  # s_b = 1.0624 -> 1 (the largest normal round-down): top at 6.37
    x[0, 32] = 6 * 1.4 * 2.0**-9  # s_b = 1.4 x 2^-9 -> 2^-9 (subnormal): top at 8.4, clipped to 6
    e = qe.quant_error(x, "nvfp4 1x16")
    assert (e.groups, e.saturated) == (3, 1)
    q, _ = qe.fake_quantize(x, "nvfp4 1x16")
    assert q[0, 16] == 6.0 and q[0, 32] == 6 * 2.0**-9  # 8.4 x 2^-9 quantized 29% low


def test_nvfp4_16x16_weights_share_one_scale_per_tile() -> None:
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(3))
    w[0, 0] = 50.0  # one outlier: its tile's 16 rows lose precision, the other tiles keep theirs
    one_d, two_d = qe.quant_error(w, "nvfp4 1x16"), qe.quant_error(w, "nvfp4 16x16")
    assert two_d.groups == 4 and one_d.groups == 64
    assert two_d.rel_l2 > one_d.rel_l2 and two_d.flushed > one_d.flushed


def test_rht_error_is_measured_in_the_original_basis_and_spreads_outliers() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 256, generator=g) * 0.01
    x[:, ::16] = 5.0  # one outlier per block of 16: the rest of the block flushes without RHT
    plain, rht = qe.quant_error(x, "nvfp4 1x16"), qe.quant_error(x, "nvfp4 1x16 + RHT")
    assert plain.flushed_frac > 0.9 and rht.flushed_frac < 0.1
    q, quant = qe.fake_quantize(x, "nvfp4 1x16 + RHT")
    assert math.isclose(rht.rel_l2, _rel(q, x), rel_tol=1e-5)  # fp64 sums against an fp32 norm
    # R is orthogonal: the error norm is the same in the rotated basis the quantizer saw.
    rotated = qe._rotate(x, qe.rht_matrix(0))
    assert math.isclose(_rel(quant.values, rotated), rht.rel_l2, rel_tol=1e-4)


def test_sr_is_seeded_and_costs_error_for_its_unbiasedness() -> None:
    x = torch.randn(128, 64, generator=torch.Generator().manual_seed(5))
    a, _ = qe.fake_quantize(x, "nvfp4 1x16 + SR", seed=1)
    b, _ = qe.fake_quantize(x, "nvfp4 1x16 + SR", seed=1)
    c, _ = qe.fake_quantize(x, "nvfp4 1x16 + SR", seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert qe.quant_error(x, "nvfp4 1x16 + SR").rel_l2 > qe.quant_error(x, "nvfp4 1x16").rel_l2


def test_pooling_sums_squares_and_keeps_the_worst_max() -> None:
    a = qe.QuantError(err_sq=1.0, ref_sq=100.0, max_err=0.1, nonzero=10, flushed=1, groups=2, saturated=1)
    b = qe.QuantError(err_sq=3.0, ref_sq=300.0, max_err=0.3, nonzero=30, flushed=0, groups=2, saturated=0)
    p = a.merge(b)
    assert p.rel_l2 == 0.1 and p.max_err == 0.3 and p.flushed_frac == 0.025 and p.saturated_frac == 0.25


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="format must be one of"):
        qe.fake_quantize(torch.ones(2, 16), "nvfp8")
    with pytest.raises(ValueError, match="2-D floating tensor"):
        qe.fake_quantize(torch.ones(16), "bf16")


# ---------------------------------------------------------------------------------------------
# numerics_matrix: the low-precision GEMM rows


def test_matrix_low_precision_rows_resolve_to_their_configs() -> None:
    from torchtitan_amp.config import load_config
    from torchtitan_amp.tools import numerics_matrix as nm
    from torchtitan_amp.tools import numerics_runs
    from torchtitan_amp.train.job import resolve

    a = nm.parse_args(["--preset", "blockscaled", "--steps", "300"])
    assert a.tail == 30
    runs, notes = nm.select_runs(a.max_procs, a.only)
    labels = [r.label for r in runs]
    assert (
        labels
        == [
            "single / fp32",
            "single / bf16",
            "single / fp8 rowwise",
            "single / mxfp8",
            "single / nvfp4",
            "single / nvfp4, RHT off",
            "single / nvfp4, SR off",
        ]
        and not notes
    )
    runs.append(nm.select_runs(a.max_procs, "^single / nvfp4, 1x16 W$")[0][-1])  # by --only
    want = {
        "fp8 rowwise": ("rowwise", "none", None),
        "mxfp8": ("none", "mxfp8", None),
        "nvfp4": ("none", "nvfp4", (True, True, True)),
        "nvfp4, RHT off": ("none", "nvfp4", (True, False, True)),
        "nvfp4, SR off": ("none", "nvfp4", (True, True, False)),
        "nvfp4, 1x16 W": ("none", "nvfp4", (False, True, True)),
    }
    for run in runs[2:]:
        config = load_config(nm.train_args(run, a))
        mp = config.mixed_precision
        fp8, fmt, options = want[run.precision.name]
        assert (mp.fp8, mp.block_scaled, mp.param_dtype) == (fp8, fmt, "bfloat16"), run.label
        if fmt == "none" and not cpu_scaled_mm_takes_rowwise_scales():
            with pytest.raises(PrecisionError, match=r"rowwise scales\) fails on cpu"):  # torch 2.11's CPU
                resolve(config, 1, "cpu")
            continue
        plan = resolve(config, 1, "cpu").plan
        if fmt == "none":
            assert plan.fp8 == "rowwise" and plan.block_scaled is None
            continue
        recipe = plan.block_scaled
        assert plan.block_scaled_emulated and recipe.format == fmt
        if options is not None:
            assert (recipe.weight_2d, recipe.rht, recipe.stochastic_rounding) == options, run.label
    # Opt-in: the default matrix, and any multi-process layout, has none of them.
    names = {p.name for p in numerics_runs.LOW_PRECISION_GEMMS}
    assert not any(r.precision.name in names for r in nm.select_runs(8, None)[0])
    assert not any(r.precision.name in names for r in nm.select_runs(8, "nvfp4|mxfp8|fp8")[0] if r.layout.nproc > 1)
    with pytest.raises(SystemExit):
        nm.parse_args(["--preset", "blockscaled", "--only", "x"])
