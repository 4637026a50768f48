"""What the precision plan makes of the device: `mixed_precision.enabled = "auto"` on a CPU that
emulates bf16 (AVX2-only: ~50x slower than fp32) trains in fp32 and says so; an explicit bf16
there trains in bf16 with a warning quoting the measured slowdown; where bf16 is native, "auto"
is mixed precision. The "no native bf16" answer is forced here (a fake probe, or the
TORCHTITAN_AMP_LOWP_MATMUL variable) so every CPU kind runs the same assertions; one test checks
that the real measurement sees through the AVX2 emulation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.support.launch import REPO, run_python
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core import matmul_speed
from torchtitan_amp.core.matmul_speed import LOWP_ENV, LowPrecisionSpeed, low_precision_speed
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.precision import report as precision_report

pytestmark = pytest.mark.unit

SINGLE = ParallelDims(1, 1, 1, 1, 1)
FSDP = ParallelDims(1, 2, 1, 1, 2)
TINY_RUN = (
    "--model.flavor",
    "debugmodel",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "1",
    "--training.steps",
    "1",
)


def fake_probe(native: bool, calls: list | None = None):  # type: ignore[no-untyped-def]
    def probe(device_type: str, dtype: torch.dtype) -> LowPrecisionSpeed:
        if calls is not None:
            calls.append(dtype)
        gflops = 150.0 if native else 1.3
        return LowPrecisionSpeed(
            device_type, "AVX2" if not native else "AVX512", dtype, native, "measured", gflops, 74.7
        )

    return probe


def make_plan(*argv: str, native: bool, dims: ParallelDims = SINGLE, calls: list | None = None) -> PrecisionPlan:
    return PrecisionPlan.from_config(load_config(list(argv)), dims, "cpu", probe=fake_probe(native, calls))


def test_auto_on_a_cpu_without_native_bf16_trains_fp32_and_says_why() -> None:
    for dims in (SINGLE, FSDP):
        plan = make_plan(native=False, dims=dims)
        assert (plan.path, plan.param_dtype, plan.autocast_dtype) == ("full", torch.float32, None)
        assert plan.compute_dtypes == (torch.float32,) and plan.warnings == ()
        assert plan.decision == (
            "mixed_precision.enabled = auto -> fp32: bf16 matmul on this CPU (AVX2) is "
            "emulated: measured 1.3 vs 74.7 GFLOP/s in fp32 on one thread, 57x slower"
        )


def test_auto_where_bf16_is_native_is_mixed_precision() -> None:
    plan = make_plan(native=True)
    assert (plan.path, plan.autocast_dtype, plan.warnings) == ("autocast", torch.bfloat16, ())
    assert plan.compute_dtypes == (torch.bfloat16, torch.float32)
    assert plan.decision.startswith(
        "mixed_precision.enabled = auto -> bf16 mixed precision (autocast path): "
        "bf16 matmul on this CPU (AVX512) is native"
    )
    assert make_plan(native=True, dims=FSDP).path == "fsdp"


def test_explicit_bf16_on_an_emulating_cpu_is_honoured_with_a_warning() -> None:
    plan = make_plan("--mixed_precision.enabled", "true", native=False)
    assert (plan.path, plan.autocast_dtype) == ("autocast", torch.bfloat16)
    (warning,) = plan.warnings
    assert "measured 1.3 vs 74.7 GFLOP/s in fp32 on one thread, 57x slower" in warning
    assert "training in bfloat16 as configured anyway" in warning
    assert '--no-mixed_precision.enabled (or mixed_precision.enabled = "auto") trains in fp32' in warning
    assert plan.decision.startswith("mixed_precision.enabled = true -> bf16 mixed precision")


def test_explicit_pure_bf16_on_an_emulating_cpu_warns_with_its_own_flag() -> None:
    plan = make_plan("--training.dtype", "bfloat16", native=False)
    assert (plan.path, plan.storage_dtype) == ("full", torch.bfloat16)
    assert plan.decision.startswith("mixed_precision.enabled = auto -> pure bf16")
    assert "--training.dtype float32 trains in fp32 instead" in plan.warnings[0]


def test_naming_the_dtype_is_asking_for_it() -> None:
    """ "auto" decides only for users who named no dtype: an explicit param_dtype (or torchtitan's
    alias) is honoured on an emulating CPU, with the warning."""
    for argv in (("--mixed_precision.param_dtype", "bfloat16"), ("--training.mixed_precision_param", "bfloat16")):
        plan = make_plan(*argv, native=False)
        assert plan.path == "autocast" and len(plan.warnings) == 1, argv
        assert plan.decision.startswith("mixed_precision.enabled = auto, param_dtype = bfloat16 set -> bf16 mixed")
        enabled = precision_report.report(plan, torch.nn.Linear(2, 2))["mixed_precision_enabled"]
        assert enabled == "auto, param_dtype = bfloat16 set"


def test_fp16_is_checked_too_and_fp32_asks_nothing(tmp_path: Path) -> None:
    calls: list = []
    toml = tmp_path / "fp16.toml"
    toml.write_text('[mixed_precision]\nenabled = "auto"\n')
    config = load_config(["--job.config_file", str(toml)])
    config.mixed_precision.param_dtype = "float16"  # a default-like fp16, not set by the user
    plan = PrecisionPlan.from_config(config, SINGLE, "cpu", probe=fake_probe(False, calls))
    assert plan.path == "full" and calls == [torch.float16]
    plan = make_plan("--mixed_precision.param_dtype", "float16", native=False, calls=calls)
    assert plan.grad_scaler == "GradScaler" and "fp16 matmul" in plan.warnings[0]
    calls.clear()
    assert make_plan("--no-mixed_precision.enabled", native=False, calls=calls).decision == (
        "mixed_precision.enabled = false -> fp32"
    )
    assert make_plan("--mixed_precision.param_dtype", "float32", native=False, calls=calls).path == "full"
    assert calls == []


def test_report_records_the_setting_the_measurement_and_the_decision() -> None:
    plan = make_plan(native=False)
    report = precision_report.report(plan, torch.nn.Linear(2, 2))
    assert report["mixed_precision_enabled"] == "auto" and report["decision"] == plan.decision
    assert report["low_precision_matmul"] == {
        "device_type": "cpu",
        "capability": "AVX2",
        "dtype": "bfloat16",
        "native": False,
        "source": "measured",
        "gflops": 1.3,
        "fp32_gflops": 74.7,
    }
    assert report["compute_dtypes"] == ["float32"] and report["warnings"] == []


def test_environment_pins_the_answer_and_rejects_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOWP_ENV, "emulated")
    speed = low_precision_speed("cpu", torch.bfloat16)
    assert (speed.native, speed.source, speed.gflops) == (False, "env", None)
    assert speed.describe().endswith(f"is emulated ({LOWP_ENV} says so)")
    monkeypatch.setenv(LOWP_ENV, "Native")
    assert low_precision_speed("cpu", torch.bfloat16).native
    monkeypatch.setenv(LOWP_ENV, "fast")
    with pytest.raises(ConfigError, match=f"{LOWP_ENV}='fast' is not allowed; use 'native' or 'emulated'"):
        low_precision_speed("cpu", torch.bfloat16)
    # No GPU visible to ask (this CPU machine): assumed native, nothing is measured.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert low_precision_speed("cuda", torch.bfloat16).source == "assumed"


@pytest.mark.parametrize(
    ("enabled", "level", "expected"),
    [
        ("auto", logging.INFO, "precision: mixed_precision.enabled = auto -> fp32: bf16 matmul on this CPU"),
        ("true", logging.WARNING, "training in bfloat16 as configured anyway"),
    ],
)
def test_trainer_writes_the_decision_to_the_log_and_the_report(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    enabled: str,
    level: int,
    expected: str,
) -> None:
    from torchtitan_amp.train.trainer import Trainer

    monkeypatch.setenv(LOWP_ENV, "emulated")
    with caplog.at_level(logging.INFO, logger="torchtitan_amp"):
        trainer = Trainer(
            load_config([*TINY_RUN, "--job.dump_folder", str(tmp_path), "--mixed_precision.enabled", enabled])
        )
    lines = [r for r in caplog.records if r.getMessage().startswith("precision: mixed_precision.enabled")]
    assert len(lines) == 1
    matching = [r for r in caplog.records if expected in r.getMessage()]
    assert len(matching) == 1 and matching[0].levelno == level, [r.getMessage() for r in caplog.records]
    report = json.loads((tmp_path / "precision_report.json").read_text())
    assert report["path"] == ("full" if enabled == "auto" else "autocast")
    assert report["low_precision_matmul"]["source"] == "env" and report["mixed_precision_enabled"] == enabled
    trainer.run.metrics.close()


def test_dry_run_plans_for_the_gpus_it_sizes_not_this_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchtitan_amp.train import dry_run

    monkeypatch.setenv(LOWP_ENV, "emulated")
    resolved = dry_run.resolve(load_config(["--model.flavor", "debugmodel"]), world_size=2)
    assert resolved.plan.path == "fsdp" and resolved.plan.speed is None


@pytest.mark.parametrize(
    ("ratio", "native"),
    [
        (0.01, False),
        (0.03, False),  # AVX2: bf16 and fp16 emulated in software
        (0.22 / 1.5, False),
        (0.22, False),
        (0.30, False),
        (0.30 * 1.5, False),  # AVX512 without AVX512-BF16 (bf16 converted to fp32), 1.5x noise
        (2.0 / 1.5, True),
        (2.5, True),  # AVX512-BF16 / AMX
    ],
)
def test_every_rank_lands_on_the_same_side_of_the_native_threshold(
    monkeypatch: pytest.MonkeyPatch, ratio: float, native: bool
) -> None:
    """Each rank (and each torchft replica group) times the matmuls on its own, so the threshold
    must lie in a gap between the classes of CPUs, wide enough that timing noise on busy cores
    never splits a job: an AVX512 CPU without AVX512-BF16 measured bf16 at 0.22-0.30x fp32, rank
    by rank, and a threshold inside that range made one rank of an FSDP job all-gather bf16 while
    the other all-gathered fp32 (a gloo size mismatch)."""
    monkeypatch.delenv(LOWP_ENV, raising=False)
    monkeypatch.setattr(matmul_speed, "single_thread_rates", lambda dtype: (ratio * 100e9, 100e9))
    assert low_precision_speed("cpu", torch.bfloat16).native is native


def test_ranks_that_timed_the_cpu_differently_are_stopped_in_one_line() -> None:
    """The threshold's gap is the first guard; the second: the ranks of a job compare what each
    decided (through the rendezvous store, no collective) before any parameter is sharded, so a
    CPU whose timing straddles the threshold fails in one line instead of training two precisions."""
    import threading

    from torch.distributed import TCPStore

    from torchtitan_amp.core.errors import PrecisionError
    from torchtitan_amp.distributed.process_groups import values_by_rank

    plans = [make_plan(native=True, dims=FSDP), make_plan(native=False, dims=FSDP)]
    assert all(p.measured_here for p in plans)
    master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    stores = [master, TCPStore("127.0.0.1", master.port, world_size=2, is_master=False)]
    seen: list[list[str]] = [[], []]

    def rank(r: int) -> None:
        seen[r] = values_by_rank("precision", plans[r].what_trains, stores[r], r, 2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen[0] == seen[1] == [plans[0].what_trains, plans[1].what_trains]
    assert seen[0] == [
        "fsdp path, bf16 compute, fp32 storage, fp32 reduce",
        "full path, fp32 compute, fp32 storage, fp32 reduce",
    ]
    problem = plans[1].disagreement(seen[1])
    assert problem is not None and "\n" not in problem
    assert problem.startswith(
        "mixed_precision.enabled = auto: the ranks decided differently (rank 0: fsdp path, bf16 compute"
    )
    assert "rank 1: full path, fp32 compute" in problem and f"{LOWP_ENV}=native|emulated" in problem
    assert isinstance(PrecisionError(problem), ConfigError)
    assert plans[0].disagreement([plans[0].what_trains] * 4) is None
    # An explicit setting, or the environment's answer, is the same on every rank: nothing to compare.
    assert not make_plan("--mixed_precision.enabled", "true", native=True).measured_here


def test_the_measurement_sees_through_avx2_emulation() -> None:
    """With torch and oneDNN held to AVX2, bf16 matmul is emulated on any x86 CPU: the real
    measurement (one thread, fp32 and bf16 timed in turn) must call it so."""
    code = (
        "import torch; from torchtitan_amp.core.matmul_speed import low_precision_speed as s; "
        "r = s('cpu', torch.bfloat16); print(r.capability, r.native, r.slowdown)"
    )
    result = run_python(
        "-c", code, timeout=120, env={"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", LOWP_ENV: ""}
    )
    assert result.returncode == 0, result.describe()
    capability, native, slowdown = result.stdout.split()
    assert (capability, native) == ("AVX2", "False") and float(slowdown) > 1 / matmul_speed.NATIVE_MIN_RATIO, (
        result.stdout
    )


def test_the_readme_debug_run_follows_the_device() -> None:
    """train_configs/debug_model.toml (the README's first command) leaves the choice to "auto":
    fp32 where bf16 is emulated, bf16 mixed precision where it is native."""
    argv = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml")]
    assert make_plan(*argv, native=False).path == "full"
    assert make_plan(*argv, native=True, dims=FSDP).path == "fsdp"
    for toml in (REPO / "train_configs").glob("llama3_*.toml"):  # GPU jobs name their precision
        assert make_plan("--job.config_file", str(toml), native=False).warnings, toml


# ---------------------------------------------------------------------------------------------
# CUDA, with the device's name and capability faked: the peak table and native bf16


def fake_gpu(monkeypatch: pytest.MonkeyPatch, name: str, capability: tuple[int, int] = (9, 0)) -> None:
    """torch.cuda answering as `name` would; is_bf16_supported as torch's: including emulation,
    every GPU says yes; without, only compute capability 8.0+."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation or capability >= (8, 0)
    )


def test_every_peak_table_entry_is_reachable() -> None:
    """Substring matching in table order: an entry after one that is a substring of it (H20 before
    H200, L4 before L40S) would never be used."""
    for name, flops in matmul_speed._GPU_PEAK_BF16_FLOPS:
        assert matmul_speed.gpu_peak_flops(f"NVIDIA {name}") == flops, name


@pytest.mark.parametrize(
    ("device_name", "tflops"),
    [
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H20", 148),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA B300 SXM6 AC", 2250),
        ("NVIDIA B200", 2250),
        ("NVIDIA L4", 121),
        ("NVIDIA L40", 181),
        ("NVIDIA L40S", 362),
        ("NVIDIA A800-SXM4-80GB", 312),
        ("NVIDIA A800 80GB PCIe", 312),
        ("NVIDIA A100-SXM4-80GB", 312),
    ],
)
def test_mfu_peak_of_a_gpu_by_its_device_name(monkeypatch: pytest.MonkeyPatch, device_name: str, tflops: int) -> None:
    from torchtitan_amp.observability.metrics import peak_flops

    fake_gpu(monkeypatch, device_name)
    assert peak_flops(torch.device("cuda", 0), [torch.bfloat16, torch.float32]) == pytest.approx(tflops * 1e12)


def test_bf16_on_a_gpu_before_ampere_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.is_bf16_supported() says yes on a V100 (emulation); "auto" must train in fp32
    there as on an emulating CPU, and an explicit bf16 is honoured with the warning."""
    fake_gpu(monkeypatch, "Tesla V100-SXM2-16GB", (7, 0))
    speed = low_precision_speed("cuda", torch.bfloat16)
    assert (speed.native, speed.source) == (False, "capability")
    assert speed.describe() == (
        "bf16 matmul on this GPU (Tesla V100-SXM2-16GB, compute capability 7.0) is "
        "emulated (bf16 tensor cores need compute capability 8.0+)"
    )
    auto = PrecisionPlan.from_config(load_config([]), SINGLE, "cuda")
    assert auto.path == "full" and auto.decision.startswith("mixed_precision.enabled = auto -> fp32: bf16 matmul on")
    asked = PrecisionPlan.from_config(load_config(["--mixed_precision.enabled"]), SINGLE, "cuda")
    assert asked.path == "autocast" and "is emulated" in asked.warnings[0]
    assert low_precision_speed("cuda", torch.float16).native  # fp16 tensor cores since Volta


def test_bf16_on_ampere_and_later_is_native(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", (8, 0))
    speed = low_precision_speed("cuda", torch.bfloat16)
    assert (speed.native, speed.source) == (True, "capability")
    plan = PrecisionPlan.from_config(load_config([]), SINGLE, "cuda")
    assert plan.path == "autocast" and plan.warnings == ()
    assert plan.decision.endswith("bf16 matmul on this GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0) is native")


# ---------------------------------------------------------------------------------------------
# torchao: what lowbit/float8.py calls is checked by name (no upper version bound)


def test_a_torchao_lacking_what_fp8_uses_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses
    import enum
    import types

    from torchtitan_amp.precision.lowbit import capability

    class Recipe(enum.Enum):
        ROWWISE = "rowwise"

    @dataclasses.dataclass
    class Config:
        @staticmethod
        def from_recipe_name(name: str) -> Config:
            return Config()

    later = types.SimpleNamespace(
        Float8LinearConfig=Config, Float8LinearRecipeName=Recipe, convert_to_float8_training=object()
    )
    # A torchao that kept rowwise and dropped tensorwise and the FSDP fp8 all-gather:
    assert capability._lacking(later, ("rowwise",), all_gather=False) is None
    assert capability._lacking(later, ("tensorwise",), all_gather=False) == "torchao's 'tensorwise' float8 recipe"
    assert (
        capability._lacking(later, ("rowwise",), all_gather=True)
        == "torchao.float8.precompute_float8_dynamic_scale_for_fsdp"
    )
    later.precompute_float8_dynamic_scale_for_fsdp = object()
    assert capability._lacking(later, ("rowwise",), all_gather=True) == (
        "Float8LinearConfig.enable_fsdp_float8_all_gather (the FSDP fp8 all-gather)"
    )
    assert capability.fp8_torchao_missing() is None  # the installed torchao has everything
    monkeypatch.setattr(capability, "_lacking", lambda *args: "torchao's 'tensorwise' float8 recipe")
    monkeypatch.setattr(capability, "_version", lambda: "0.99.0")
    assert capability.fp8_torchao_missing("tensorwise", False) == (
        "fp8 training needs torchao's 'tensorwise' float8 recipe, which torchao 0.99.0 lacks; "
        "pip install 'torchao==0.18.0' (the version tested)"
    )
