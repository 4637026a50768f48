"""Block-scaled training on torchao's kernels (precision/lowbit/torchao_kernels.py), wired and checked
on CPU: no device here has MX / NVFP4 tensor cores, so the tests inject the probe
(`kernels_missing` -> None) and convert with torchao's KernelPreference.EMULATED (EMULATED_KERNELS),
which runs torchao's own MXFP8 quantization in PyTorch and multiplies the dequantized operands.
NVFP4Linear is Triton-only (no emulated kernel): its conversion is checked, not its numerics.

The numbers: torchao's emulated GEMM dequantizes each operand into the operand's dtype and calls
mm there. With fp32 operands the dequantized values are e4m3 elements times powers of two, so
every product is exact in fp32 on both sides (ours multiplies the same values, bit-identical
quantization on finite data whose blocks are not tiny: precision/lowbit/formats.py); the two differ
only in the order of the fp32 sum, bounded by 2 * gamma_K * sum_k |a_k b_k| with gamma_K = K u /
(1 - K u), u = 2^-24 (each side's recursive-sum error is at most gamma_K times the absolute sum).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision import block_scaled
from torchtitan_amp.precision.lowbit import capability, torchao_kernels
from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.linear import rht_signs
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.unit

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--metrics.log_freq",
    "1",
]
# fp32 end to end: torchao's emulated GEMM multiplies in the operands' dtype and needs both alike.
FP32 = ["--mixed_precision.enabled", "false"]
MXFP8 = ["--mixed_precision.block_scaled", "mxfp8"]
# NVFP4's kernel takes GEMMs in tiles of 128 rows: 4 sequences of 32 tokens.
NVFP4 = ["--mixed_precision.block_scaled", "nvfp4", "--training.local_batch_size", "4"]


@pytest.fixture(autouse=True)
def _kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(capability, "block_scaled_kernels_missing", lambda fmt, device_type, run_kernel=True: None)
    monkeypatch.setattr(torchao_kernels, "EMULATED_KERNELS", True)


def _resolve(*extra: str, world: int = 1) -> job_mod.Job:
    return job_mod.resolve(load_config([*BASE, *extra]), world, "cpu")


def _abs_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """2 gamma_K |a| |b|^T for a (M, K) @ b (N, K)^T of exact fp32 products."""
    k = a.shape[-1]
    u = 2.0**-24
    return 2 * (k * u / (1 - k * u)) * (a.double().abs() @ b.double().abs().T)


def _mx(t: torch.Tensor, mode: str) -> torch.Tensor:
    return bs.quantize_mxfp8(t, scale_mode=mode).dequantize()


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_torchao_mxfp8_matches_the_emulation_within_the_fp32_summation_bound(mode: str) -> None:
    recipe = BlockScaledRecipe("mxfp8", mx_scale_mode=mode)
    torch.manual_seed(0)
    ours, theirs = nn.Sequential(nn.Linear(128, 64, bias=False)), nn.Sequential(nn.Linear(128, 64, bias=False))
    theirs.load_state_dict(ours.state_dict())
    assert block_scaled.apply_block_scaled(ours, recipe, (), 0) == ["0"]
    assert block_scaled.apply_torchao(theirs, recipe, (), 0) == ["0"]
    assert type(theirs[0]).__name__ == "MXFP8Linear" and theirs[0].scale_calculation_mode.value == mode
    x, g = torch.randn(96, 128) * 3, torch.randn(96, 64) / 7  # g: the loss's fixed output gradient
    results = []
    for model in (ours, theirs):
        xx = x.clone().requires_grad_()
        y = model(xx)
        (y * g).sum().backward()
        results.append((y.detach(), xx.grad, model[0].weight.grad))
    w = ours[0].weight.detach()
    bounds = (
        _abs_bound(_mx(x, mode), _mx(w, mode)),  # forward: reduce over in_features
        _abs_bound(_mx(g, mode), _mx(w.T.contiguous(), mode)),  # dgrad: over out_features
        _abs_bound(_mx(g.T.contiguous(), mode), _mx(x.T.contiguous(), mode)),
    )  # wgrad: over tokens
    plain = (x @ w.T, g @ w, g.T @ x)  # unquantized fp32: what a Linear left out would give
    for what, (a, b), bound, fp32 in zip(("forward", "dgrad", "wgrad"), zip(*results), bounds, plain):
        diff = (a.double() - b.double()).abs()
        assert (diff <= bound).all(), (what, (diff - bound).max().item())
        # The bound tells a quantized GEMM from an unquantized one by a wide margin.
        assert (fp32.double() - b.double()).abs().max() > 100 * bound.max(), what


def test_plan_says_torchao_kernels_and_refuses_what_torchao_cannot_honour_in_one_line() -> None:
    plan = _resolve(*MXFP8).plan
    assert (
        not plan.block_scaled_emulated and "nn.Linear in mxfp8, torchao kernels (torchao MXFP8Linear)" in plan.decision
    )
    assert "torchao kernels" in _resolve(*NVFP4).plan.decision
    for field in ("nvfp4_rht", "nvfp4_stochastic_rounding", "nvfp4_weight_2d"):
        with pytest.raises(PrecisionError) as e:
            _resolve(*NVFP4, f"--mixed_precision.{field}", "false")
        assert f"mixed_precision.{field} = false: torchao's NVFP4 training kernels always use" in str(e.value)
        assert "block_scaled_emulate = true" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(
        PrecisionError,
        match=r"on torchao's kernels: training.local_batch_size x training.seq_len "
        r"/ context_parallel_degree gives 64 tokens a GEMM, and torchao's nvfp4 kernels take "
        r"multiples of 128; set mixed_precision.block_scaled_emulate = true",
    ):
        _resolve(*NVFP4, "--training.local_batch_size", "2")
    with pytest.raises(
        PrecisionError,
        match=r"validation.local_batch_size x validation.seq_len / "
        r"context_parallel_degree gives 32 tokens a GEMM",
    ):
        _resolve(*NVFP4, "--validation.enable", "true", "--validation.local_batch_size", "1")
    # MXFP8 tiles the tokens only in the weight gradient: evaluation batches of any size run.
    assert not _resolve(
        *MXFP8, "--validation.enable", "true", "--validation.local_batch_size", "1"
    ).plan.block_scaled_emulated
    with pytest.raises(
        PrecisionError,
        match="on torchao's kernels: mixed_precision.block_scaled_experts = true: "
        "the grouped experts' GEMMs are emulated only",
    ):
        _resolve(*MXFP8, "--mixed_precision.block_scaled_experts", "true")
    # The emulation honours every option.
    assert _resolve(
        *NVFP4, "--mixed_precision.nvfp4_rht", "false", "--mixed_precision.block_scaled_emulate", "true"
    ).plan.block_scaled_emulated
    # block_scaled_emulate = false with kernels missing: refused, never emulated.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            capability,
            "block_scaled_kernels_missing",
            lambda fmt, d, run_kernel=True: "cpu has no MX / NVFP4 tensor cores",
        )
        with pytest.raises(PrecisionError, match="needs block-scaled tensor cores: cpu has no MX"):
            _resolve(*MXFP8, "--mixed_precision.block_scaled_emulate", "false")


def test_nvfp4_conversion_keeps_parameters_and_takes_the_recipes_signs_and_seeds() -> None:
    # The installed torchao (the project's tested 0.18) has both modules the probe asks for.
    assert (
        capability.block_scaled_torchao_missing("mxfp8") is None
        and capability.block_scaled_torchao_missing("nvfp4") is None
    )
    recipe = BlockScaledRecipe.nvfp4_full(seed=5)
    model = nn.Sequential(nn.Linear(128, 256, bias=False), nn.Linear(256, 128, bias=False))
    weights = [m.weight for m in model]
    assert block_scaled.apply_torchao(model, recipe, (), 0) == ["0", "1"]
    assert [type(m).__name__ for m in model] == ["NVFP4Linear", "NVFP4Linear"]
    assert all(m.weight is w for m, w in zip(model, weights))
    # Checkpoints hold what the plain model's do: the buffers come from the recipe, not the state dict.
    assert sorted(model.state_dict()) == ["0.weight", "1.weight"]
    signs = [int(v) for v in rht_signs(5)]
    assert all(list(m.rht_sign_vector) == signs for m in model)
    assert [int(m._sr_seed) for m in model] == [torchao_kernels.sr_seed(recipe, i) for i in range(2)]
    assert torchao_kernels.sr_seed(recipe, 0) != torchao_kernels.sr_seed(recipe, 1)
    # Built on meta and materialized (to_empty leaves buffers uninitialised): refilled from the recipe.
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(128, 128, bias=False))
    block_scaled.apply_torchao(lazy, recipe, (), 0)
    lazy.to_empty(device="cpu")
    torchao_kernels.materialized([lazy])
    assert list(lazy[0].rht_sign_vector) == signs and int(lazy[0]._sr_seed) == torchao_kernels.sr_seed(recipe, 0)
    # Another data-parallel rank (trainer.run.sr_rank) gets another SR key for the same module.
    torchao_kernels.materialized([lazy], rank=1)
    assert int(lazy[0]._sr_seed) == torchao_kernels.sr_seed(recipe, 0, 1) != torchao_kernels.sr_seed(recipe, 0)
    with pytest.raises(
        PrecisionError,
        match="'nvfp4' on torchao's kernels: 0 is 64 -> 128, and the kernels take "
        "multiples of 128; keep it out with block_scaled_skip_modules",
    ):
        block_scaled.apply_torchao(nn.Sequential(nn.Linear(64, 128)), recipe, (), 0)
    with pytest.raises(
        PrecisionError, match="'mxfp8' on torchao's kernels: 1 is 64 -> 48, and the kernels take multiples of 32"
    ):
        block_scaled.apply_torchao(
            nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48)), BlockScaledRecipe("mxfp8"), (), 0
        )


def test_job_converts_reports_and_audits_torchao_modules(tmp_path: Path) -> None:
    t = trainer_module.Trainer(load_config([*BASE, *FP32, *MXFP8, "--job.dump_folder", str(tmp_path)]))
    converted = sorted(n for n, m in t.run.model.named_modules() if type(m).__name__ == "MXFP8Linear")
    assert len(converted) == 14 and all(n.startswith(("layers.1.", "layers.2.")) for n in converted)
    report = json.loads((tmp_path / "precision_report.json").read_text())["block_scaled"]
    assert report["kernels"] == "torchao" and not report["emulated"] and sorted(report["modules"]) == converted
    assert report["modules"]["layers.1.attention.wq"] == {
        "module": "MXFP8Linear",
        "scale_mode": "rceil",
        "wgrad": "mxfp8",
        "kernels": "emulated",
    }
    assert "output" in report["kept_out"] and "layers.0.attention.wq" in report["kept_out"]
    result = t.audit()
    assert result.ok, result.breaches
    old = t.run.model.layers["1"].attention.wq
    plain = nn.Linear(old.in_features, old.out_features, bias=False)
    plain.weight = old.weight
    t.run.model.layers["1"].attention.wq = plain
    breaches = t.audit().breaches
    assert [(b.what, b.seen) for b in breaches] == [
        ("layers.1.attention.wq: torchao block-scaled module", ["{'module': 'Linear'}"])
    ]


# The probe itself, before the autouse fixture replaces it.
KERNELS_MISSING = capability.block_scaled_kernels_missing


def _blackwell(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compute capability 10.0 device as far as the probe's capability check can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    monkeypatch.setattr(capability, "block_scaled_torchao_missing", lambda fmt: None)
    KERNELS_MISSING.cache_clear()


def test_the_block_scaled_probe_runs_one_step_and_reports_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Blackwell machine whose torchao MXFP8 CUDA op did not load (torchao only warns) is refused
    by the step's own error, in the probe's one line; the pre-flight (run_kernel False) runs none."""
    _blackwell(monkeypatch)
    steps = []

    def broken(fmt: str, device: str) -> None:
        steps.append((fmt, device))
        raise RuntimeError("torchao::mxfp8_quantize\nis not a registered op")

    monkeypatch.setattr(capability, "tiny_step", broken)
    assert KERNELS_MISSING("mxfp8", "cuda", False) is None and steps == []
    why = KERNELS_MISSING("mxfp8", "cuda")
    assert why == (
        "torchao's mxfp8 training step fails here (RuntimeError: torchao::mxfp8_quantize is not a registered op)"
    ), why
    assert steps == [("mxfp8", "cuda")]
    KERNELS_MISSING.cache_clear()


def test_the_probes_tiny_step_trains_on_torchaos_emulated_mxfp8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchao_kernels, "EMULATED_KERNELS", True)
    capability.tiny_step("mxfp8", "cpu")
