"""What the GPU checks (tests/gpu/, marker `gpu`) run under: the device, shapes and steps, each
check's time cap and the one overall budget, the optional packages some need, and the results
JSON rewritten atomically when each check starts and ends. Set by environment variables (pytest
reads a sub-folder's conftest too late for command-line options; scripts/gpu_run.sh sets them):

    GPU_CHECKS_DEVICE   cuda (default; every check is skipped without CUDA) or cpu (a trial run)
    GPU_CHECKS_TINY     1: small shapes (the CPU trial)
    GPU_CHECKS_STEPS    steps of each loss curve (default 30)
    GPU_CHECKS_BUDGET   seconds for all checks: each check's limit is cut to what is left, and one
                        is not started with under MIN_START_S left (default: no budget)
    GPU_CHECKS_LIMITS   NAME=S[,NAME=S]: a check's own limit (CUDA default: CUDA_LIMITS_S; CPU: none)
    GPU_CHECKS_SPEED    1: also run fp8_speed (two compiled 8B-shaped runs, 150 s) and flex (flex vs SDPA)
    GPU_CHECKS_JSON     write the results here: env, then per check its status ("passed",
                        "failed", "error", "timeout", "killed", "skipped", "running" while it runs,
                        "not run"), seconds, limit_s, compile_s and what it recorded
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Per-check caps on CUDA, from estimates (no GPU run yet): the debug model's steps take
# milliseconds there; compilation (bf16_compile in curves, the compiled speed runs), process and
# NCCL start-ups and Trainer builds (~1 s each) dominate. About twice each check's expected time:
# a handful of ops (cp_attention, block_scaled_kernels) 5 s; one Trainer and a step (probe) or
# two 3-step runs and decoding (generate) 10 s; two 4-step counted runs (syncs,
# block_scaled_syncs) 6 s, ep_syncs 8 s with its NCCL start-up; fault_tolerance's two group
# processes (a Python, torch and CUDA start-up each, side by side, then 2 x 12 steps) 15 s.
# The order the checks run in (tests/gpu/conftest.py sorts them): the cheap probes first, so
# that a short call still reaches them.
CUDA_LIMITS_S = {
    "kernels": 10.0,
    "fsdp_hook": 10.0,
    "probe": 10.0,
    "cp_attention": 5.0,
    "block_scaled_kernels": 5.0,
    "syncs": 6.0,
    "block_scaled_syncs": 6.0,
    "ep_syncs": 8.0,
    "generate": 10.0,
    "resume": 20.0,
    "moe": 15.0,
    "fault_tolerance": 15.0,
    "fp8": 30.0,
    "curves": 50.0,
    "fp8_speed": 150.0,
    # flex vs SDPA on the debug model at seq 8192 with packed documents: two compiles of
    # flex_attention (forward, backward) and 2 x 3 steps; an estimate, not yet run on a GPU.
    "flex": 40.0,
}
CHECKS = list(CUDA_LIMITS_S)
# What runs without GPU_CHECKS_SPEED=1: every check but the speed ones. Its caps sum to
# DEFAULT_BUDGET_S or less (tests/test_gpu_checks.py), scripts/gpu_run.sh's default budget.
SPEED_CHECKS = ("fp8_speed", "flex")  # run only with GPU_CHECKS_SPEED=1
DEFAULT_CHECKS = [name for name in CHECKS if name not in SPEED_CHECKS]
DEFAULT_BUDGET_S = 200.0
# A check is not started with less time than this left in the budget.
MIN_START_S = 5.0
# Checks that import an optional package: skipped (the others run) where it is not importable.
NEEDS = {"fp8": "torchao", "fp8_speed": "torchao", "block_scaled_kernels": "torchao", "fault_tolerance": "torchft"}


def parse_limits(text: str) -> dict[str, float]:
    """ "curves=60,fp8=30" -> {"curves": 60.0, "fp8": 30.0}; a bad item is a ValueError naming it."""
    limits = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, seconds = item.partition("=")
        if name not in CUDA_LIMITS_S:
            raise ValueError(f"GPU_CHECKS_LIMITS: unknown check {name!r}; choose from {', '.join(CHECKS)}")
        try:
            limits[name] = float(seconds)
        except ValueError:
            limits[name] = math.nan
        if not limits[name] > 0:
            raise ValueError(f"GPU_CHECKS_LIMITS: {item!r}: expected NAME=SECONDS with SECONDS > 0")
    return limits


@dataclass
class Settings:
    device: str = "cuda"
    tiny: bool = False
    steps: int = 30
    budget_s: float | None = None
    limits: dict[str, float] = field(default_factory=dict)
    speed: bool = False
    json: Path | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ[str] = os.environ) -> Settings:
        device = env.get("GPU_CHECKS_DEVICE", "cuda")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"GPU_CHECKS_DEVICE: {device!r}; choose from cuda, cpu")
        budget = env.get("GPU_CHECKS_BUDGET")
        return cls(
            device=device,
            tiny=env.get("GPU_CHECKS_TINY", "0") == "1",
            steps=int(env.get("GPU_CHECKS_STEPS", "30")),
            budget_s=float(budget) if budget else None,
            limits=parse_limits(env.get("GPU_CHECKS_LIMITS", "")),
            speed=env.get("GPU_CHECKS_SPEED") == "1",
            json=Path(env["GPU_CHECKS_JSON"]) if env.get("GPU_CHECKS_JSON") else None,
        )

    def args(self) -> argparse.Namespace:
        """What each check reads: a.device, a.tiny, a.steps."""
        return argparse.Namespace(device=self.device, tiny=self.tiny, steps=self.steps)

    def cap(self, name: str) -> float:
        """The check's own limit: GPU_CHECKS_LIMITS's, else CUDA_LIMITS_S on CUDA, else none (inf)."""
        return self.limits.get(name, CUDA_LIMITS_S[name] if self.device == "cuda" else math.inf)

    def why_skipped(self, name: str) -> str | None:
        """Why check `name` does not run here, or None."""
        if self.device == "cuda" and not torch.cuda.is_available():
            return "no CUDA device here (GPU_CHECKS_DEVICE=cpu GPU_CHECKS_TINY=1 runs a CPU trial)"
        if name in SPEED_CHECKS and not self.speed:
            return f"{name} runs with GPU_CHECKS_SPEED=1 only"
        return unavailable(name)


def unavailable(name: str) -> str | None:
    """Why check `name` cannot run in this Python (a package it imports is missing), or None."""
    package = NEEDS.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        return f'{package} is not importable: carry its wheels in .whl/ (docs/performance.md, "GPU checks")'
    return None


class Report:
    """The results so far, rewritten atomically whenever a check starts or ends, so that a timeout
    or kill loses at most the check it interrupted (left "running")."""

    def __init__(self, path: Path | None, env: dict[str, Any], names: list[str]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"env": env, "finished": False, "checks": {n: {"status": "not run"} for n in names}}

    def set(self, name: str, result: dict[str, Any]) -> None:
        self.data["checks"][name] = result
        self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling frames in this process so far."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    key = next((k for k in ("entire_frame_compile", "_compile.compile_inner") if k in metrics), None)
    return float(sum(metrics[key])) if key else 0.0


def environment(s: Settings) -> dict[str, Any]:
    """The versions, device and settings the results were measured with."""
    import importlib.metadata
    import platform

    cuda = s.device == "cuda" and torch.cuda.is_available()
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": torchao,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "tiny": s.tiny,
        "steps": s.steps,
        "time_budget_s": s.budget_s,
    }
