"""AdamW construction and the warm-up / stable / decay learning-rate schedule."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import nn

from torchtitan_amp.config import LRSchedulerConfig, OptimizerConfig, load_config
from torchtitan_amp.train.optim import build_lr_scheduler, build_optimizer, lr_factor

CPU = torch.device("cpu")
DECAYS = ("linear", "cosine", "sqrt")


def factors(total: int, **kw) -> list[float]:
    kw = {"warmup": 0, "decay_ratio": -1.0, "decay_type": "linear", "min_lr_factor": 0.0, **kw}
    return [lr_factor(s, total=total, **kw) for s in range(total + 1)]


# ---------------------------------------------------------------------------------------------
# Schedule


@pytest.mark.parametrize("decay_type", DECAYS)
@pytest.mark.parametrize("warmup", [0, 1, 10])
@pytest.mark.parametrize("decay_ratio", [-1.0, 0.0, 0.5, 1.0])
def test_first_step_lr_is_never_zero(decay_type: str, warmup: int, decay_ratio: float) -> None:
    f = factors(20, warmup=warmup, decay_ratio=decay_ratio, decay_type=decay_type)
    assert f[0] > 0
    # Every step actually taken (0 .. total-1) trains with a positive LR, even with min_lr 0.
    assert all(x > 0 for x in f[:-1]), f


def test_warmup_is_linear_from_1_over_w_plus_1_to_peak() -> None:
    f = factors(100, warmup=4, decay_ratio=0.0)
    assert f[:5] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5, 1.0])
    assert all(x == 1.0 for x in f[4:])  # decay_ratio 0: stable to the end


def test_stable_phase_then_decay_over_the_last_fraction() -> None:
    f = factors(100, warmup=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.1)
    assert all(x == 1.0 for x in f[10:81]), "stable from the end of warm-up to the start of decay"
    assert f[90] == pytest.approx(0.1 + 0.9 * 0.5)
    assert f[100] == pytest.approx(0.1)
    decay = f[80:]
    assert all(a > b for a, b in zip(decay, decay[1:])), "decay is strictly decreasing"


@pytest.mark.parametrize(
    "decay_type, at_quarter, at_half",
    [
        ("linear", 0.75, 0.5),
        ("cosine", 0.5 * (1 + math.cos(math.pi / 4)), 0.5),
        ("sqrt", 0.5, 1 - math.sqrt(0.5)),
    ],
)
@pytest.mark.parametrize("min_lr", [0.0, 0.2])
def test_decay_shapes_reach_min_lr_factor(decay_type: str, at_quarter: float, at_half: float, min_lr: float) -> None:
    # warmup 0, decay over all 40 steps.
    f = factors(40, decay_type=decay_type, min_lr_factor=min_lr)
    assert f[0] == 1.0
    assert f[10] == pytest.approx(min_lr + (1 - min_lr) * at_quarter)
    assert f[20] == pytest.approx(min_lr + (1 - min_lr) * at_half)
    assert f[40] == pytest.approx(min_lr)
    assert min(f) == pytest.approx(min_lr) and all(x >= min_lr - 1e-12 for x in f)
    assert all(a >= b for a, b in zip(f, f[1:]))


def test_decay_ratio_minus_one_decays_over_all_steps_after_warmup() -> None:
    f = factors(30, warmup=10, decay_ratio=-1.0, decay_type="linear")
    assert f[10] == 1.0 and f[20] == pytest.approx(0.5) and f[30] == 0.0


def test_decay_never_overlaps_warmup() -> None:
    # warmup 10 + decay 100% of 20 steps do not fit: decay starts at the peak after warm-up.
    f = factors(20, warmup=10, decay_ratio=1.0, decay_type="linear")
    assert f[9] == pytest.approx(10 / 11) and f[10] == 1.0
    assert f[15] == pytest.approx(0.5) and f[20] == 0.0


def test_scheduler_drives_the_optimizer_lr() -> None:
    model = nn.Linear(2, 2)
    opt = build_optimizer(list(model.parameters()), OptimizerConfig(lr=1e-2), CPU)
    cfg = LRSchedulerConfig(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    sched = build_lr_scheduler(opt, cfg, total_steps=10)
    expected = partial(lr_factor, warmup=3, total=10, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    seen = []
    for step in range(10):
        seen.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr()[0] == pytest.approx(1e-2 * expected(step))
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(1e-2 / 4)
    assert max(seen) == pytest.approx(1e-2)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_scheduler_from_job_config() -> None:
    config = load_config(
        [
            "--lr_scheduler.warmup_steps",
            "2",
            "--lr_scheduler.decay_type",
            "sqrt",
            "--lr_scheduler.min_lr_factor",
            "0.5",
            "--optimizer.lr",
            "0.1",
        ]
    )
    opt = build_optimizer(list(nn.Linear(2, 2).parameters()), config.optimizer, CPU)
    sched = build_lr_scheduler(opt, config.lr_scheduler, total_steps=6)
    lrs = []
    for _ in range(7):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # warm-up 1/3, 2/3, then sqrt decay over 4 steps from 1 to 0.5.
    expected = [1 / 3, 2 / 3, 1.0, 1 - 0.5 * math.sqrt(0.25), 1 - 0.5 * math.sqrt(0.5), 1 - 0.5 * math.sqrt(0.75), 0.5]
    assert lrs == pytest.approx([0.1 * e for e in expected])


# ---------------------------------------------------------------------------------------------
# AdamW


@pytest.mark.parametrize(
    "implementation, device, fused_ok, fused, foreach",
    [
        ("fused", CPU, True, True, False),
        ("foreach", CPU, True, False, True),
        ("for-loop", CPU, True, False, False),
        ("auto", CPU, True, True, False),
        ("auto", torch.device("cuda"), True, True, False),
        ("auto", torch.device("meta"), True, False, True),  # no fused kernel there
        ("auto", CPU, False, False, True),  # the plan's loss scaler cannot drive it
    ],
)
def test_adamw_kernel_is_the_configured_one(
    implementation: str, device: torch.device, fused_ok: bool, fused: bool, foreach: bool
) -> None:
    cfg = OptimizerConfig(implementation=implementation)
    opt = build_optimizer(list(nn.Linear(4, 4).parameters()), cfg, device, fused_ok=fused_ok)
    assert isinstance(opt, torch.optim.AdamW)
    assert bool(opt.defaults["fused"]) is fused
    assert bool(opt.defaults["foreach"]) is foreach


def test_adamw_hyperparameters_come_from_config() -> None:
    cfg = OptimizerConfig(lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05)
    params = list(nn.Linear(4, 4).parameters())
    opt = build_optimizer(params, cfg, CPU)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.8, 0.99), 1e-6, 0.05)
    assert [id(p) for p in group["params"]] == [id(p) for p in params]


def test_adamw_kernels_agree() -> None:
    """fused, foreach and the for-loop take the same step (a kernel flag, not a different optimizer)."""
    results = []
    for impl in ("fused", "foreach", "for-loop"):
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        opt = build_optimizer(list(model.parameters()), OptimizerConfig(implementation=impl, lr=1e-2), CPU)
        for _ in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1], results[2], rtol=1e-5, atol=1e-6)
