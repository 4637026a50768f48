"""Optimizer-state precision and stochastic rounding: `optimizer.state_dtype` keeps
AdamW's moments in bf16 (or fp32 under pure bf16 weights), `optimizer.stochastic_rounding` rounds
pure-bf16 weight updates without bias. Unit tests here; the layouts, resume and cross-dtype
resume in test_optim_state_dist.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan_amp.config import OptimizerConfig, load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.report import optimizer_summary
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module
from torchtitan_amp.train.optim import AdamWMixedState, build_optimizer, stochastic_round_bf16

CPU = torch.device("cpu")
ULP_AT_1 = 2.0**-7  # bf16 spacing in [1, 2)


def _adamw(params: list[nn.Parameter], **kw) -> AdamWMixedState:
    kw.setdefault("stochastic_rounding", False)
    return AdamWMixedState(
        params,
        seed=kw.pop("seed", 0),
        lr=kw.pop("lr", 1e-2),
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=kw.pop("weight_decay", 0.1),
        **kw,
    )


def _steps(opt: torch.optim.Optimizer, params: list[nn.Parameter], n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("value", [1.0 + 2.0**-10, -(1.0 + 3 * 2.0**-11), 3.0 + 3 * 2.0**-9])
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(value: float) -> None:
    x = torch.full((200_000,), value)
    r = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    ulp = 2.0 ** (math.floor(math.log2(abs(value))) - 7)  # bf16 keeps 8 significand bits
    lo = math.copysign(math.floor(abs(value) / ulp) * ulp, value)  # the neighbour towards zero
    hi = lo + math.copysign(ulp, value)
    assert set(r.unique().tolist()) == {lo, hi}
    p_up = (abs(value) - abs(lo)) / ulp
    # The mean of n Bernoulli(p) draws: within 5 standard deviations of p.
    sigma = math.sqrt(p_up * (1 - p_up) / x.numel())
    assert abs(float((r == hi).float().mean()) - p_up) < 5 * sigma
    assert abs(float(r.double().mean()) - value) < 5 * sigma * ulp


def test_stochastic_rounding_keeps_exact_values_and_infinities() -> None:
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    assert torch.equal(stochastic_round_bf16(x, torch.Generator().manual_seed(1)).float(), x)


def test_fp32_state_on_fp32_params_is_torch_adamw_bit_for_bit() -> None:
    """The per-parameter path runs torch's own AdamW math: with nothing to round it is torch's
    single-tensor AdamW exactly."""
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(8, 5)), nn.Parameter(torch.randn(5))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    ours = _adamw(a, state_dtype=torch.float32)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    _steps(ours, a, 5)
    _steps(ref, b, 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(ours.state[x]["exp_avg_sq"], ref.state[y]["exp_avg_sq"]) for x, y in zip(a, b))


def test_bf16_moments_stay_bf16_and_track_fp32_moments() -> None:
    """Moments rounded to bf16 every step (relative error <= 2**-9 each) change each update by a
    relative ~2**-8 at most, so after n steps of lr 1e-2 the weights differ by < n * lr * 2**-7."""
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(64, 32))]
    b = [nn.Parameter(a[0].detach().clone())]
    low, ref = _adamw(a, state_dtype=torch.bfloat16), _adamw(b, state_dtype=torch.float32)
    _steps(low, a, 10)
    _steps(ref, b, 10)
    assert low.state[a[0]]["exp_avg"].dtype == low.state[a[0]]["exp_avg_sq"].dtype == torch.bfloat16
    assert a[0].dtype == torch.float32
    diff = float((a[0] - b[0]).detach().abs().max())
    assert 0 < diff < 10 * 1e-2 * 2.0**-7


def test_stochastic_rounding_moves_weights_that_nearest_rounding_freezes() -> None:
    """Pure bf16 weights at 1.0 take AdamW updates of ~lr = 1e-3 per step, under half a bf16 ulp
    (2**-8): rounding to nearest returns 1.0 every time, stochastic rounding follows the fp32
    trajectory on average (bias < 5 standard deviations of the mean over 4096 weights)."""
    n, steps, lr = 4096, 40, 1e-3

    def run(sr: bool | None) -> torch.Tensor:
        dtype = torch.float32 if sr is None else torch.bfloat16
        p = nn.Parameter(torch.ones(n, dtype=dtype))
        opt = _adamw([p], state_dtype=torch.float32, stochastic_rounding=bool(sr), lr=lr, weight_decay=0.0)
        for _ in range(steps):
            p.grad = torch.ones(n, dtype=dtype)
            opt.step()
        return p.detach().float()

    fp32, nearest, stochastic = run(None), run(False), run(True)
    assert torch.equal(nearest, torch.ones(n))
    target = float(fp32.mean())
    assert target < 1 - 0.9 * steps * lr
    # Each weight's rounding errors are bounded by one ulp per step and unbiased: their sum over
    # the steps has variance < steps * ulp**2 / 4 (a Bernoulli's variance is at most 1/4).
    sigma = math.sqrt(steps * (ULP_AT_1 / 2) ** 2 / 4 / n)
    assert abs(float(stochastic.mean()) - target) < 5 * sigma


def test_stochastic_rounding_is_a_function_of_seed_step_and_parameter() -> None:
    """Replicas (same seed, same parameter order) round alike; another seed rounds differently."""

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(123)  # the global RNG must not matter: draw it differently each time
        torch.rand(seed + 1)
        p = nn.Parameter(torch.linspace(1, 2, 1000).bfloat16())
        opt = _adamw([p], state_dtype=torch.float32, stochastic_rounding=True, seed=seed % 2, lr=1e-3)
        _steps(opt, [p], 3)
        return p.detach()

    assert torch.equal(run(0), run(2)) and not torch.equal(run(0), run(1))


def test_load_keeps_the_state_dtype_and_converts_the_other() -> None:
    """torch's Optimizer.load_state_dict casts moments to the parameter's dtype: fp32 moments of
    bf16 weights would come back rounded. They must load exactly, and a state saved in the other
    dtype loads converted."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(16, 16).bfloat16())
    opt = _adamw([p], state_dtype=torch.float32)
    _steps(opt, [p], 2)
    saved = opt.state_dict()
    q = nn.Parameter(p.detach().clone())
    again = _adamw([q], state_dtype=torch.float32)
    again.load_state_dict(saved)
    assert torch.equal(again.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    assert again.state[q]["exp_avg"].dtype == torch.float32
    bf16 = _adamw([nn.Parameter(q.detach().clone())], state_dtype=torch.bfloat16)
    bf16.load_state_dict(saved)
    moment = next(iter(bf16.state.values()))["exp_avg"]
    assert moment.dtype == torch.bfloat16 and torch.equal(moment, opt.state[p]["exp_avg"].bfloat16())


def test_build_optimizer_uses_torch_adamw_unless_the_plan_asks() -> None:
    """The plan says when torch's AdamW cannot hold the state (moments in the storage dtype,
    rounded to nearest: torch's; anything else: AdamWMixedState); build_optimizer follows it."""
    params = list(nn.Linear(4, 4).parameters())
    assert type(build_optimizer(params, OptimizerConfig(), CPU)) is torch.optim.AdamW
    assert type(build_optimizer(params, OptimizerConfig(), CPU, state_dtype=torch.bfloat16)) is AdamWMixedState
    plan = lambda *args: job_mod.resolve(load_config([*BASE, *args]), 1, "cpu").plan  # noqa: E731
    assert not plan().mixed_state_optimizer and not plan(*PURE_BF16).mixed_state_optimizer
    assert plan("--optimizer.state_dtype", "float32").mixed_state_optimizer is False
    assert plan("--optimizer.state_dtype", "bfloat16").mixed_state_optimizer
    assert plan(*PURE_BF16, "--optimizer.stochastic_rounding").mixed_state_optimizer
    assert plan(*PURE_BF16, "--optimizer.state_dtype", "float32").mixed_state_optimizer


BASE = [
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--metrics.log_freq",
    "1",
]
PURE_BF16 = ["--training.dtype", "bfloat16", "--mixed_precision.enabled", "false"]


@pytest.mark.parametrize(
    "args, state",
    [
        ([], "float32"),
        (["--optimizer.state_dtype", "bfloat16"], "bfloat16"),
        (PURE_BF16, "bfloat16"),
        ([*PURE_BF16, "--optimizer.state_dtype", "float32"], "float32"),
    ],
)
def test_plan_decides_the_state_dtype(args: list[str], state: str) -> None:
    plan = job_mod.resolve(load_config([*BASE, *args]), 1, "cpu").plan
    assert optimizer_summary(plan)["state_dtype"] == state


@pytest.mark.parametrize(
    "args, match",
    [
        (["--optimizer.stochastic_rounding"], "'optimizer.stochastic_rounding' rounds bf16 weights"),
        (
            ["--optimizer.state_dtype", "bfloat16", "--optimizer.implementation", "fused"],
            "'optimizer.implementation' = 'fused' picks a kernel of torch's AdamW",
        ),
    ],
)
def test_settings_that_cannot_hold_are_refused(args: list[str], match: str) -> None:
    with pytest.raises(PrecisionError, match=match):
        job_mod.resolve(load_config([*BASE, *args]), 1, "cpu")


def test_report_shows_state_dtype_rounding_and_bytes_per_param(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    args = [
        *BASE,
        *PURE_BF16,
        "--optimizer.state_dtype",
        "float32",
        "--optimizer.stochastic_rounding",
        "--training.steps",
        "2",
        "--job.dump_folder",
        str(tmp_path),
    ]
    t = trainer_module.Trainer(load_config(args))
    t.train()
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert report["optimizer"] == {
        "state_dtype": "float32",
        "update": "fp32 math per parameter (AdamWMixedState)",
        "weight_rounding": "stochastic",
    }
    # bf16 weights and gradients, fp32 moments: 2 + 2 + 8.
    assert report["bytes_per_param"]["trained_total"] == 12
    states = [s["exp_avg"] for s in t.run.optimizer.state.values()]
    assert states and all(s.dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.bfloat16 for p in t.run.model.parameters())
