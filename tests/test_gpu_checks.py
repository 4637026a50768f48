"""The GPU checks (tests/gpu/, marker `gpu`) and scripts/gpu_run.sh run on CPU, so that their one
GPU call is not their first run: the checks with tiny shapes, `-m gpu` collecting them in their
order and skipping them without CUDA, the results JSON after each check under limits and the
budget, the carried wheels, and the non-tiny fp8 speed step's configuration (parsed, not run)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import signal
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu import settings
from tests.gpu import test_device_ops as device_ops
from tests.gpu import test_training as training
from tests.support.launch import REPO, run_command
from torchtitan_amp.config import load_config
from torchtitan_amp.models.llama3 import model as llama
from torchtitan_amp.train import build as train_build

pytestmark = pytest.mark.dist

GPU_RUN = str(REPO / "scripts" / "gpu_run.sh")


def statuses(path: Path) -> dict[str, str]:
    return {name: r["status"] for name, r in json.loads(path.read_text())["checks"].items()}


def run_gpu_checks(tmp_path: Path, env: dict[str, str], *paths: str) -> tuple[Any, dict[str, Any]]:
    """`pytest -m gpu` in its own process with the GPU_CHECKS_* settings `env`; its results JSON."""
    out = tmp_path / "gpu_checks.json"
    result = run_command(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            *(paths or ("tests/gpu",)),
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--junitxml",
            str(tmp_path / "gpu_checks.xml"),
        ],
        timeout=900,
        env={"OMP_NUM_THREADS": "2", "GPU_CHECKS_JSON": str(out), **env},
    )
    return result, json.loads(out.read_text())


def test_gpu_checks_trial_run_on_cpu(tmp_path: Path) -> None:
    # 2 steps per curve: the trial proves the checks run; GPU_CHECKS_TINY's shape is the smallest flavor.
    result, results = run_gpu_checks(
        tmp_path, {"GPU_CHECKS_DEVICE": "cpu", "GPU_CHECKS_TINY": "1", "GPU_CHECKS_STEPS": "2", "GPU_CHECKS_SPEED": "1"}
    )
    assert result.returncode == 0, result.describe()
    # Every check passed, in CHECKS' order (cheap first) whatever order the files hold them in.
    assert results["finished"] and list(results["checks"]) == settings.CHECKS
    assert {n: r["status"] for n, r in results["checks"].items()} == dict.fromkeys(settings.CHECKS, "passed")
    assert all(r["compile_s"] >= 0 for r in results["checks"].values())
    # The junit XML carries each check's recorded numbers too.
    recorded = {
        case.get("name"): json.loads(prop.get("value"))
        for case in ET.parse(tmp_path / "gpu_checks.xml").iter("testcase")
        for prop in case.iter("property")
        if prop.get("name") == "recorded"
    }
    assert recorded["test_generate"] == {
        k: v for k, v in results["checks"]["generate"].items() if k not in ("status", "seconds", "limit_s", "compile_s")
    }
    kernels = results["checks"]["kernels"]
    assert kernels["sdpa"]["pinned_runs_predicted_op"] and kernels["fp8_rowwise_scaled_mm"] == "ran", kernels
    assert results["checks"]["fsdp_hook"]["bitwise_equal"] is True
    probe = results["checks"]["probe"]
    assert probe["linear_out"] == {"bfloat16": probe["linear_out"]["bfloat16"]}
    assert any(op.startswith("mm:") for op in probe["forward_ops"])
    assert any("attention" in op for op in probe["backward_ops"])
    resume = results["checks"]["resume"]
    assert resume["deterministic"] is True
    # Saved at step 3, which logs nothing (every 2nd step logs): the logged steps after it match.
    assert sorted(map(int, resume["uninterrupted"])) == [1, 2, 4, 6]
    assert resume["resumed"] == {k: v for k, v in resume["uninterrupted"].items() if int(k) > 3}
    assert resume["save"]["bytes"] > 0 and resume["save"]["save_s"] > 0, resume["save"]
    assert results["checks"]["fp8_speed"]["compile"] is False  # CPU: eager
    moe = results["checks"]["moe"]
    assert moe["router"]["router_dtype"] == "float32" and moe["expert_ops"]["bf16"], moe
    # torch 2.11-2.13 have torch.mm(out_dtype=) on CUDA only: the gate stays an fp32 matmul here.
    assert moe["mm_bf16_in_fp32_out"]["ran"] is False, moe["mm_bf16_in_fp32_out"]
    cp_attention = results["checks"]["cp_attention"]  # CPU: its kernel, its masks by design
    assert {r["kernel_predicted"] for r in cp_attention.values() if isinstance(r, dict)} == {"cpu_flash"}, cp_attention
    assert cp_attention["float32_hd32"]["grouped_kv"] and not cp_attention["bfloat16_hd32"]["grouped_kv"]
    syncs = results["checks"]["syncs"]  # step 2 of each: the finiteness read alone
    for name in ("dense", "moe"):
        assert syncs[name]["steps"]["2"]["syncs"] == {"_local_scalar_dense": 1}, syncs[name]
        assert syncs[name]["steps"]["2"]["cuda_sync_warnings"] is None  # CUDA's own report: on CUDA only
    for name in ("mxfp8", "nvfp4"):  # emulated block-scaled: the finiteness read alone
        assert results["checks"]["block_scaled_syncs"][name]["steps"]["2"]["syncs"] == {"_local_scalar_dense": 1}
    ep = results["checks"]["ep_syncs"]  # plus one read of the split sizes per EP layer forward
    assert ep["backend"] == "gloo" and ep["ep_layers"] == 3 and ep["ep"]["budget"] == 4, ep["summary"]
    assert ep["ep"]["steps"]["2"]["syncs"] == {"_local_scalar_dense": 1, "tolist": 3}, ep["ep"]["steps"]["2"]
    ft = results["checks"]["fault_tolerance"]
    assert ft["lighthouse"].startswith("http://127.0.0.1:") and ft["exit_codes"] == [0, 0], ft
    summary = ft["summary"]
    assert summary["participants"] == [2] and summary["discarded"] == 0, summary
    assert summary["train_step_syncs"] == {"fault_tolerance": [1], "without": [1]}, summary
    assert summary["timed_steps_per_group"] == 4 and all(v > 0 for v in summary["step_s_median"].values())
    assert summary["quorum_s"]["median"] >= 0 and len(summary["quorum_s"]["first_step"]) == 2
    generated = results["checks"]["generate"]
    assert generated["fp32"]["greedy_matches_full_forward"], generated
    assert generated["fp32"]["max_abs_logit_diff"] <= training.GENERATE_ATOL, generated


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device runs the checks")
def test_minus_m_gpu_collects_the_checks_in_order_and_skips_them_without_cuda(tmp_path: Path) -> None:
    """`pytest -m gpu` selects the checks alone (another module's tests are deselected), sorts them
    cheap first, skips every one here (no CUDA) and records each in the JSON."""
    result, results = run_gpu_checks(tmp_path, {}, "tests/gpu", "tests/test_gpu_readiness.py")
    assert result.returncode == 0, result.describe()
    assert f"{len(settings.CHECKS)} skipped" in result.output and " deselected" in result.output, result.output
    assert results["finished"] and list(results["checks"]) == settings.CHECKS
    assert {r["error"] for r in results["checks"].values()} == {settings.Settings().why_skipped("probe")}
    assert statuses(tmp_path / "gpu_checks.json") == dict.fromkeys(settings.CHECKS, "skipped")


def test_a_spent_time_budget_leaves_checks_not_run(tmp_path: Path) -> None:
    result, results = run_gpu_checks(
        tmp_path, {"GPU_CHECKS_DEVICE": "cpu", "GPU_CHECKS_BUDGET": "1"}, "tests/gpu/test_training.py"
    )
    assert result.returncode == 0, result.describe()
    checks = results["checks"]
    assert checks.pop("fp8_speed")["status"] == "skipped"  # without GPU_CHECKS_SPEED=1
    assert {n: (r["status"], r["error"]) for n, r in checks.items()} == dict.fromkeys(
        checks, ("not run", "1 s left of the time budget")
    )


def test_a_missing_optional_package_skips_only_the_checks_that_import_it(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = settings.importlib.util.find_spec
    monkeypatch.setattr(
        settings.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("torchao", "torchft") else find_spec(name, *a),
    )
    why = {
        n: settings.Settings(device="cpu", speed=True).why_skipped(n)
        for n in ("probe", "block_scaled_kernels", "fault_tolerance", "fp8")
    }
    assert why["probe"] is None
    assert "torchao is not importable" in why["fp8"] and "torchao is not importable" in why["block_scaled_kernels"]
    assert "torchft is not importable" in why["fault_tolerance"]


def _script_default(name: str) -> str:
    import re

    # The last default in the script: the GPU one (the CPU smoke's comes first).
    return re.findall(r"\$\{" + name + r":-([^}]*)\}", (REPO / "scripts" / "gpu_run.sh").read_text())[-1]


def test_the_default_selection_fits_its_budget_and_the_call_fits_five_minutes() -> None:
    """The caps of the checks run without GPU_CHECKS_SPEED add up to no more than the budget
    gpu_run.sh gives them (its timeout less the 20 s margin), the cheap probes run before the
    compiled ones, and the checks plus the MFU benchmark take at most 300 s by their own limits."""
    caps = settings.CUDA_LIMITS_S
    default = [n for n in settings.CHECKS if n not in settings.SPEED_CHECKS]
    for name in settings.SPEED_CHECKS:
        assert "GPU_CHECKS_SPEED=1" in str(settings.Settings(device="cpu").why_skipped(name))
    assert default == settings.DEFAULT_CHECKS and set(caps) == set(settings.CHECKS)
    assert sum(caps[n] for n in default) <= settings.DEFAULT_BUDGET_S, sum(caps[n] for n in default)
    timeout, mfu = float(_script_default("GPU_CHECKS_TIMEOUT")), float(_script_default("GPU_MFU_TIMEOUT"))
    assert timeout - 20 >= settings.DEFAULT_BUDGET_S and timeout + mfu <= 300
    order = list(settings.CHECKS)
    assert order.index("kernels") < order.index("block_scaled_kernels") < order.index("curves")
    assert _script_default("GPU_RUN_NEEDS") == "torchdata pytest"  # torchao missing stops no run


def test_block_scaled_kernels_sum_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bound assumes fp32 sums: cuBLAS's reduced-precision bf16 reduction is off while it runs
    and as it was after."""
    import torch

    from tests.gpu import test_block_scaled_kernels as gcb

    seen, pair = [], gcb._block_scaled_pair

    def spy(*args: Any) -> Any:
        seen.append(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
        return pair(*args)

    monkeypatch.setattr(gcb, "_block_scaled_pair", spy)
    matmul = torch.backends.cuda.matmul
    before, matmul.allow_bf16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction, True
    try:
        gcb.block_scaled_kernels("cpu", {})
        assert seen and not any(seen) and matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("value", ["curves", "curves=0", "curves=soon", "nope=3"])
def test_bad_check_limits_are_usage_errors(value: str) -> None:
    with pytest.raises(ValueError, match="GPU_CHECKS_LIMITS"):
        settings.Settings.from_env({"GPU_CHECKS_LIMITS": value})
    assert settings.Settings.from_env({"GPU_CHECKS_LIMITS": "curves=60, fp8=0.5"}).limits == {"curves": 60, "fp8": 0.5}


# ---------------------------------------------------------------------------------------------
# What the checks compute


def test_fp16_curve_is_compared_step_aligned_past_skipped_steps() -> None:
    """A GradScaler skip at step 1 leaves the fp16 run one update behind from step 2 on: its loss
    at step s is held to fp32's over steps s-1..s, not to fp32's at s alone."""
    fp32 = {1: 5.0, 2: 4.0, 3: 3.5, 4: 3.2}
    fp16 = {1: 5.0, 2: 5.0, 3: 4.001, 4: 3.5}
    recs = {1: {"skipped_steps": 1.0}, 2: {"skipped_steps": 1.0}, 3: {"skipped_steps": 1.0}, 4: {}}
    behind = training.skipped_before(recs)
    assert behind == {1: 0, 2: 1, 3: 1, 4: 1}
    assert training.aligned_diff(fp32, fp16, behind) == pytest.approx(0.001)
    assert training.aligned_diff(fp32, fp16, {}) == pytest.approx(1.0)  # without the alignment
    assert training.aligned_diff(fp32, {**fp16, 4: 3.0}, behind) == pytest.approx(0.2)  # below the band
    assert training.aligned_diff(fp32, {**fp16, 3: float("inf")}, behind) == float("inf")


def test_the_generate_check_fails_a_cache_that_loses_positions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generate check's comparison can fail: decode steps rotated as if at position 0."""
    from torchtitan_amp.models.kv_cache import KVCache

    monkeypatch.setattr(train_build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(KVCache, "rotary_rows", lambda self, cos, sin: (cos, sin))
    a = argparse.Namespace(device="cpu", tiny=True, steps=3)
    out: dict[str, Any] = {}
    assert training.check_generate(a, tmp_path, out) is False
    assert out["fp32"]["max_abs_logit_diff"] > 100 * training.GENERATE_ATOL, out


def test_the_cp_attention_check_fails_where_a_mask_is_made_against_the_prediction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Told that CPU's lower-right attention makes no mask (as CUDA's kernels do not), the check
    sees the masks this CPU builds and fails."""
    from torchtitan_amp.core import rules

    a = argparse.Namespace(device="cpu", tiny=True)
    assert device_ops.check_cp_attention(a, tmp_path, {}) is True
    monkeypatch.setattr(rules, "materialises_causal_mask", lambda *args: False)
    out: dict[str, Any] = {}
    assert device_ops.check_cp_attention(a, tmp_path, out) is False
    assert out["float32_hd32"]["chunk_shaped_tensors"] and out["float32_hd32"]["expected_op_ran"], out


def test_the_ep_syncs_check_fails_a_dispatch_that_reads_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ep_syncs runs the EP dispatch (a 1-rank gloo group here) and holds it to its budget: one
    more host read per layer forward fails it."""
    import torch

    from tests.gpu import test_syncs as gpu_check_syncs
    from torchtitan_amp.distributed.expert_parallel import ExpertParallel

    monkeypatch.setattr(train_build, "peak_flops", lambda device, dtype: 1e12)
    exchange = ExpertParallel.exchange_counts

    def reads_twice(self: ExpertParallel, rows: int, send: torch.Tensor) -> Any:
        send.sum().item()
        return exchange(self, rows, send)

    monkeypatch.setattr(ExpertParallel, "exchange_counts", reads_twice)
    monkeypatch.setattr(gpu_check_syncs, "COUNTED_RUN_STEPS", 2)  # step 2 alone is counted
    a = argparse.Namespace(device="cpu", tiny=True, steps=2)
    out: dict[str, Any] = {}
    assert gpu_check_syncs.check_ep_syncs(a, tmp_path, out) is False
    assert out["summary"]["train_step_syncs"] == [7], out["summary"]  # 1 + 3 layers x 2 reads
    assert not torch.distributed.is_initialized()  # the group is gone for later checks


def test_fault_tolerance_waits_are_bounded() -> None:
    """The groups' wait: a failed group ends it at once (its peer would only wait out the quorum
    timeout), a hanging one at the deadline; either way nothing is left running."""
    import subprocess

    from tests.gpu.test_ft_groups import _wait_all

    def start(*cmd: str) -> subprocess.Popen:
        return subprocess.Popen(list(cmd), start_new_session=True)

    for procs, deadline in (([start("sleep", "30"), start("false")], 30.0), ([start("sleep", "30")], 0.5)):
        begin = time.monotonic()
        _wait_all(procs, deadline)
        assert time.monotonic() - begin < 10 and all(p.returncode is not None for p in procs)
        assert procs[0].returncode == -signal.SIGKILL


def test_the_8b_speed_step_configures_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_speed's non-tiny runs: the flavor it registers is accepted, compiled in bf16 and fp8."""
    monkeypatch.setitem(llama.LLAMA3_FLAVORS, training.SPEED_FLAVOR, llama.LLAMA3_FLAVORS["llama3_8b"])
    a = argparse.Namespace(tiny=False, device="cuda", steps=30)
    configs = {name: load_config(args) for name, args in training.speed_configs(a, tmp_path).items()}
    assert set(configs) == {"bf16", "fp8"}
    for name, config in configs.items():
        assert (config.model.flavor, config.training.seq_len, config.training.local_batch_size) == (
            "llama3_8b_2l",
            2048,
            2,
        )
        assert config.compile.enable and config.training.device == "cuda"
        assert config.mixed_precision.param_dtype == "bfloat16"
        assert config.mixed_precision.fp8 == ("tensorwise" if name == "fp8" else "none")
    shape = llama.build_model_args("llama3_8b_2l", 258, 2048)
    assert (shape.n_layers, shape.dim, shape.kv_heads) == (2, 4096, 8)


# ---------------------------------------------------------------------------------------------
# scripts/gpu_run.sh on CPU


def fake_wheel(folder: Path, name: str) -> Path:
    """A minimal valid wheel of an importable package `name`."""
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n".encode(),
        f"{name}-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for path, data in files.items()
    )
    files[f"{name}-0.1.dist-info/RECORD"] = (record + f"{name}-0.1.dist-info/RECORD,,\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
    return path


def gpu_run_env(tmp_path: Path, needs: str) -> dict[str, str]:
    return {
        "GPU_RUN_CPU_SMOKE": "1",
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "GPU_RUN_WHEELS": str(tmp_path / "whl"),
        "GPU_RUN_SITE": str(tmp_path / "site"),
        "GPU_RUN_NEEDS": needs,
        "OMP_NUM_THREADS": "2",
    }


def test_gpu_run_cpu_smoke(tmp_path: Path) -> None:
    """The one device call's script on CPU: a carried wheel of a missing package installed, the
    checks' JSON kept across a check stopped by its limit, the MFU benchmark's tiny run."""
    fake_wheel(tmp_path / "whl", "tta_smoke_pkg")
    (tmp_path / "whl" / "torchdata-0.11.0-py3-none-any.whl").write_bytes(b"installed already: not opened")
    result = run_command(
        ["bash", GPU_RUN, "-k", "probe or curves"],
        timeout=240,
        env={**gpu_run_env(tmp_path, "torchdata tta_smoke_pkg"), "GPU_CHECKS_LIMITS": "curves=1"},
    )
    out = tmp_path / "out"
    assert result.returncode == 1, result.describe()
    assert (tmp_path / "site" / "tta_smoke_pkg" / "__init__.py").is_file()
    log = (out / "gpu_run.log").read_text()
    assert f"installing carried wheels into {tmp_path / 'site'}: tta_smoke_pkg-0.1-py3-none-any.whl\n" in log
    assert "gpu_checks exit 1, gpu_mfu exit 0" in log
    results = json.loads((out / "gpu_checks.json").read_text())
    assert statuses(out / "gpu_checks.json") == {"probe": "passed", "curves": "timeout"}, log[-3000:]
    assert results["finished"] and results["env"]["time_budget_s"] == 220
    assert results["checks"]["curves"]["error"] == "stopped after its 1 s limit", results["checks"]["curves"]
    assert results["checks"]["curves"]["seconds"] < 10 and (out / "gpu_checks.xml").is_file()
    mfu = json.loads((out / "gpu_mfu.json").read_text())
    assert [(r["config"], r["compile"]) for r in mfu["results"]] == [("autocast", False)]
    assert "error" not in mfu["results"][0]


def test_gpu_run_can_skip_the_mfu_benchmark(tmp_path: Path) -> None:
    """A rerun of the checks alone: GPU_RUN_MFU=0 (0 cannot be a timeout, which means none)."""
    result = run_command(
        ["bash", GPU_RUN, "-k", "kernels and not block"],
        timeout=240,
        env={**gpu_run_env(tmp_path, "torchdata"), "GPU_RUN_MFU": "0"},
    )
    assert result.returncode == 0, result.describe()
    log = (tmp_path / "out" / "gpu_run.log").read_text()
    assert "gpu_mfu skipped (GPU_RUN_MFU=0)" in log and "gpu_checks exit 0, gpu_mfu exit 0" in log
    assert not (tmp_path / "out" / "gpu_mfu.json").exists()
    assert statuses(tmp_path / "out" / "gpu_checks.json") == {"kernels": "passed"}


def test_gpu_run_refuses_a_missing_package_without_a_wheel(tmp_path: Path) -> None:
    result = run_command(["bash", GPU_RUN], timeout=60, env=gpu_run_env(tmp_path, "torchdata tta_absent_pkg"))
    assert result.returncode == 2, result.describe()
    assert result.output.strip().splitlines() == [
        f"error: tta_absent_pkg missing and no wheel for it carried in {tmp_path / 'whl'}/ "
        '(docs/performance.md, "GPU checks", says how)'
    ]
    assert not (tmp_path / "out" / "gpu_checks.json").exists()
