"""fp8 training through torchao: decided by the precision plan, refused in one line
where it cannot hold, trained and resumed for real. torch 2.13 runs torch._scaled_mm on CPU, so
the fp8 path itself runs here (slowly); what only a GPU shows (speed, nccl fp8 all-gather) is in
tests/gpu/test_training.py's `fp8` check. The audit of fp8 steps is in test_audit.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.test_training import FP8_TOLERANCE
from tests.support.launch import by_step, launch_worker
from tests.support.machine import cpu_scaled_mm_takes_rowwise_scales
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.lowbit import capability
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = [pytest.mark.dist, pytest.mark.oldest_torch]

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
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--mixed_precision.enabled",
    "true",
]
FP8 = ["--mixed_precision.fp8", "tensorwise"]
SHARD = "--parallelism.data_parallel_shard_degree"


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _resolve(*extra: str, world: int = 1, dry_run: bool = False) -> job_mod.Job:
    return job_mod.resolve(load_config([*BASE, *extra]), world, "cpu", dry_run=dry_run)


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (
            [*FP8, "--mixed_precision.fp8_all_gather", "true", SHARD, "2"],
            2,
            "'mixed_precision.fp8_all_gather' needs CUDA/nccl: gloo (cpu) cannot all-gather float8 tensors",
        ),
        (
            ["--mixed_precision.fp8", "rowwise", "--mixed_precision.fp8_all_gather", "true", SHARD, "2"],
            2,
            "'mixed_precision.fp8_all_gather' needs fp8 = 'tensorwise' on the FSDP path",
        ),
        (
            ["--mixed_precision.fp8_all_gather", "true"],
            1,
            "'mixed_precision.fp8_all_gather' needs mixed_precision.fp8 = 'tensorwise'",
        ),
        (
            [*FP8, "--mixed_precision.fp8_skip_modules", "outptu"],
            1,
            "'mixed_precision.fp8_skip_modules' entry 'outptu' matches no nn.Linear of the model",
        ),
    ],
)
def test_fp8_settings_that_cannot_hold_are_one_line_errors(extra: list[str], world: int, message: str) -> None:
    with pytest.raises(PrecisionError) as e:
        _resolve(*extra, world=world)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_fp8_without_torchao_or_device_support_is_an_error_never_a_fallback(monkeypatch) -> None:
    monkeypatch.setattr(
        capability,
        "fp8_torchao_missing",
        lambda recipe=None, all_gather=None: (
            "fp8 training needs torchao (No module named 'torchao'); " + capability.INSTALL
        ),
    )
    with pytest.raises(
        PrecisionError,
        match=r"'mixed_precision.fp8' = 'tensorwise': fp8 training needs torchao .*"
        r"pip install 'torchao>=0.18'",
    ):
        _resolve(*FP8)
    monkeypatch.setattr(capability, "fp8_torchao_missing", lambda recipe=None, all_gather=None: None)
    monkeypatch.setattr(capability, "fp8_matmul_unsupported", lambda *args: "torch._scaled_mm fails on cpu: no kernel")
    with pytest.raises(PrecisionError, match="'mixed_precision.fp8' = 'tensorwise': torch._scaled_mm fails on cpu"):
        _resolve(*FP8)
    # A dry run sizes other machines: neither this machine's torchao nor its device is asked.
    assert _resolve(*FP8, dry_run=True).plan.fp8 == "tensorwise"


def test_this_cpu_runs_fp8_matmuls() -> None:
    """What makes the CPU tests below possible; if a torch drops CPU _scaled_mm they must say so."""
    assert capability.fp8_matmul_unsupported("cpu") is None


def _scaled_mm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    import torch

    calls, original = [], torch._scaled_mm

    def spy(a, b, *, scale_a, scale_b, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((tuple(scale_a.shape), tuple(scale_b.shape)))
        return original(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    capability.fp8_matmul_unsupported.cache_clear()
    monkeypatch.setattr(capability, "fp8_matmul_unsupported", capability.fp8_matmul_unsupported)  # cleared again after
    return calls


def test_the_fp8_probe_runs_the_recipes_own_scale_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """rowwise: one scale per row of the left operand and per column of the right one, as torchao
    hands them; tensorwise: scalars. The probe's verdict is torch's own (rowwise runs on torch
    2.13's CPU, not on 2.11's, which the probe must then refuse)."""
    rowwise_runs = cpu_scaled_mm_takes_rowwise_scales()
    calls = _scaled_mm_calls(monkeypatch)
    rowwise = capability.fp8_matmul_unsupported("cpu", "rowwise")
    assert rowwise is None if rowwise_runs else rowwise.startswith("torch._scaled_mm (rowwise scales) fails on cpu")
    assert capability.fp8_matmul_unsupported("cpu", "tensorwise") is None
    assert calls == [((16, 1), (1, 16)), ((), ())]
    capability.fp8_matmul_unsupported.cache_clear()


def test_preflight_runs_no_fp8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's pre-flight (before torchrun) checks fp8 by capability only: a kernel there
    would open a CUDA context on cuda:0 that nothing uses; the ranks' own resolve runs it."""
    from torchtitan_amp.train import preflight

    rowwise_runs = cpu_scaled_mm_takes_rowwise_scales()
    calls = _scaled_mm_calls(monkeypatch)
    monkeypatch.setattr(capability, "fp8_torchao_missing", lambda recipe=None, all_gather=None: None)
    assert preflight.check(1, [*BASE, "--mixed_precision.fp8", "rowwise"]) == 0
    assert calls == []
    if rowwise_runs:
        _resolve("--mixed_precision.fp8", "rowwise")  # a rank
    else:  # the rank's probe refuses what this torch's CPU kernel lacks, in one line
        with pytest.raises(PrecisionError, match=r"rowwise scales\) fails on cpu"):
            _resolve("--mixed_precision.fp8", "rowwise")
    assert calls == [((16, 1), (1, 16))]
    capability.fp8_matmul_unsupported.cache_clear()


def test_fp8_trains_close_to_bf16_and_reports_its_modules(tmp_path: Path) -> None:
    steps = ["--training.steps", "5"]
    for name, extra in (("bf16", []), ("fp8", FP8)):
        trainer_module.Trainer(load_config([*BASE, *steps, *extra, "--job.dump_folder", str(tmp_path / name)])).train()
    bf16, f8 = by_step(tmp_path / "bf16"), by_step(tmp_path / "fp8")
    diffs = [abs(f8[s]["loss"] - bf16[s]["loss"]) for s in bf16]
    # fp8 ran (the curves differ) and stays within the GPU check's tolerance of bf16.
    assert 0 < max(diffs) < FP8_TOLERANCE, diffs
    report = json.loads((tmp_path / "fp8" / "precision_report.json").read_text())
    assert report["fp8"] == "tensorwise" and len(report["fp8_modules"]) == 4 * 7  # 4 blocks of 7 Linears
    assert "output" not in report["fp8_modules"]
    assert "nn.Linear in fp8 (tensorwise)" in report["decision"]
    groups = {g["module_type"].rsplit(".", 1)[-1]: g for g in report["param_groups"]}
    assert groups["Float8Linear"]["compute_dtype"] == "float8_e4m3fn"
    assert groups["Linear"]["compute_dtype"] == "bfloat16"  # the output head, kept out


def test_fsdp_fp8_resume_is_bitwise_and_tp_fp8_trains_alike(tmp_path: Path) -> None:
    """torchao's dynamic scaling keeps no fp8 state: the checkpoint's fp32 weights and AdamW
    state are all a resume needs, and it reproduces the uninterrupted run bit for bit. TP 2 (plain
    TP styles around Float8Linear: the matmuls in fp8, the activations gathered in bf16) trains
    within fp8's tolerance of FSDP 2 on the same data."""
    a, b, tp = tmp_path / "a", tmp_path / "b", tmp_path / "tp"
    args = [*BASE, *FP8, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]
    launch_worker(
        "ckpt_jobs",
        tmp_path / "launch",
        [
            {"args": [*args, SHARD, "2", "--job.dump_folder", str(a)]},
            {
                "args": [*args, SHARD, "2", "--job.dump_folder", str(b)],
                "copy": [[str(a / "checkpoint" / "step-2"), str(b / "checkpoint" / "step-2")]],
            },
            # Global batch 4 as FSDP's 2 x 2: the same sequences per step.
            {
                "args": [
                    *BASE,
                    *FP8,
                    "--training.steps",
                    "4",
                    "--training.local_batch_size",
                    "4",
                    "--parallelism.tensor_parallel_degree",
                    "2",
                    SHARD,
                    "1",
                    "--job.dump_folder",
                    str(tp),
                ]
            },
        ],
        2,
        timeout=300,
    )
    ra, rb, rtp = by_step(a), by_step(b), by_step(tp)
    assert sorted(rb) == [3, 4]
    for step in (3, 4):
        assert (rb[step]["loss"], rb[step]["grad_norm"]) == (ra[step]["loss"], ra[step]["grad_norm"]), step
    diffs = [abs(rtp[s]["loss"] - ra[s]["loss"]) for s in range(1, 5)]
    assert max(diffs) < FP8_TOLERANCE, diffs
