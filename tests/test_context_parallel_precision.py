"""Context parallel's cross-rank arithmetic against fp64: the bf16 error must not grow
with the number of cp ranks.

Our CP has no softmax merge (context_parallel.py: one SDPA call per rank over the all-gathered
keys and values), so the only arithmetic across ranks is the sum of the ranks' partial key/value
gradients, the reduce-scatter behind the all-gather, in `mixed_precision.cp_reduce_dtype`. One
4-rank launch (tests/workers/cp_precision.py) runs the same bf16 attention problems (S = 512, 4
heads of 64, batch 1, two seeds) at cp = 1, 2 and 4, with that sum in float32 and in bfloat16.

The bounds, from the arithmetic (u = 2**-8, bf16's unit roundoff):
- the forward output and dq involve no cross-rank sum: a query's row is the same kernel over the
  same (exactly gathered) keys, only in another order, so the fp32 accumulation inside the kernel
  moves each value by about S * 2**-24 before its bf16 rounding; that flips the rounding of a
  fraction ~S * 2**-24 / u of the elements by one ulp (2u), so their errors agree within
  2u * sqrt(S * 2**-24 / u) (measured: identical, to the last digit);
- an fp32 sum of cp bf16 partials is exact but for cp - 1 roundings of 2**-24, then ONE rounding
  to bf16: every element within u |exact| + cp 2**-24 sum_i |p_i| of the exact sum, at any cp
  (measured: at most 0.996 of that; relative Frobenius error 1.7e-3 at cp 2 and 4);
- a bf16 sum rounds every running sum: at cp 2 that is the same one rounding (equal to fp32's),
  at cp 4 three; elements where the partials cancel are off by many times the one-rounding bound
  (measured ~7e3 times) and the relative error of the sum grows (measured 1.7e-3 -> 2.2e-3 for dk,
  2.1e-3 for dv: 1.34x / 1.27x fp32's);
- end to end, vs the fp64 attention: with fp32 the sum adds at most one rounding (u relative) to
  what the ranks' kernels computed, so dk/dv at cp 4 stay within cp 1's error + u (measured: dk
  4.6e-3 at cp 1, 3.9e-3 at cp 2 and 4; a part of the queries per kernel call rounds less);
  with bf16 they grow from cp 2 to cp 4 (measured dk 3.95e-3 -> 4.17e-3, dv 3.87e-3 -> 4.03e-3).
The same numbers to 3 digits under AVX2 emulation of bf16 (ATEN_CPU_CAPABILITY=avx2).
Swapping the fp32 sum for bf16 in context_parallel._GatherSequence fails the fp32 tests here
(the wire dtype, the one-rounding bound, the growth), as checked by hand when this was written.
"""

from __future__ import annotations

import math

import pytest

from tests.support.launch import run_distributed
from tests.workers import cp_precision

pytestmark = pytest.mark.dist

U = 2.0**-8  # bf16 unit roundoff
OPTIONS = {"batch": 1, "heads": 4, "seq_len": 512, "head_dim": 64, "seeds": [0, 1], "scale": 1.0}
GRADS = ("dk", "dv")


@pytest.fixture(scope="module")
def errors() -> dict:
    jobs = [{"name": name, "reduce_dtype": name} for name in ("float32", "bfloat16")]
    return run_distributed(cp_precision.measure, 4, OPTIONS, jobs, timeout=240)[0]["jobs"]


def _mean(errors: dict, job: str, cp: int, key: str) -> float:
    values = errors[job]["errors"][str(cp)][key]
    return sum(values) / len(values)


@pytest.mark.parametrize("job", ["float32", "bfloat16"])
def test_the_gradients_travel_in_cp_reduce_dtype(errors: dict, job: str) -> None:
    assert errors[job]["wire_dtypes"] == [job]


@pytest.mark.parametrize("job", ["float32", "bfloat16"])
def test_forward_and_dq_do_not_depend_on_cp(errors: dict, job: str) -> None:
    bound = 2 * U * math.sqrt(OPTIONS["seq_len"] * 2.0**-24 / U)
    for key in ("out", "dq"):
        base = errors[job]["errors"]["1"][key]
        assert 0 < min(base) and max(base) < 2 * U, base  # bf16 really ran, a few roundings' error
        for cp in (2, 4):
            for one, many in zip(base, errors[job]["errors"][str(cp)][key]):
                assert abs(many - one) <= bound, (key, cp, one, many, bound)


@pytest.mark.parametrize("cp", [2, 4])
def test_fp32_sum_rounds_once_at_any_cp(errors: dict, cp: int) -> None:
    for key in GRADS:
        ratios = errors["float32"]["errors"][str(cp)][f"{key}_sum_bound_ratio"]
        assert max(ratios) <= 1.0, (key, ratios)


def test_bf16_sum_grows_with_cp(errors: dict) -> None:
    for key in GRADS:
        # Two partials: one rounding whether the sum runs in fp32 or bf16.
        assert errors["bfloat16"]["errors"]["2"][f"{key}_sum"] == errors["float32"]["errors"]["2"][f"{key}_sum"]
        # Four: three roundings of running sums; where partials cancel, far beyond one rounding.
        assert min(errors["bfloat16"]["errors"]["4"][f"{key}_sum_bound_ratio"]) > 100, key
        assert _mean(errors, "bfloat16", 4, f"{key}_sum") > 1.15 * _mean(errors, "float32", 4, f"{key}_sum"), key


def test_end_to_end_error_does_not_grow_with_cp_in_fp32(errors: dict) -> None:
    for key in GRADS:
        one = _mean(errors, "float32", 1, key)
        for cp in (2, 4):
            assert _mean(errors, "float32", cp, key) <= one + U, (key, cp)
        # The bf16 sum, by contrast, makes them grow from cp 2 to cp 4 and exceed fp32's.
        bf16_2, bf16_4 = _mean(errors, "bfloat16", 2, key), _mean(errors, "bfloat16", 4, key)
        assert bf16_4 > 1.02 * bf16_2 and bf16_4 > 1.02 * _mean(errors, "float32", 4, key), (key, bf16_2, bf16_4)
