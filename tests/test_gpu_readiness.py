"""Defects that only CUDA would show, proven on CPU with monkeypatched device queries:
the device is set before anything can allocate on cuda:0, determinism configures cuBLAS and cuDNN,
and selective AC saves every attention kernel and TP collective that CUDA can dispatch."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.inputs import TINY
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed import activation_checkpoint, process_groups
from torchtitan_amp.train import build, trainer


class _StopBeforePlan(Exception):
    pass


def test_trainer_sets_the_gpu_and_determinism_before_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's probes (fp8, low-precision speed) run CUDA matmuls: before the fix they ran
    before `distributed.init` set the device, so every local rank opened a context on cuda:0, and
    cuBLAS's workspace was fixed before CUBLAS_WORKSPACE_CONFIG could be set."""
    events: list[str] = []
    monkeypatch.setattr(process_groups, "choose_device", lambda requested, local_rank: torch.device("cuda", local_rank))
    monkeypatch.setattr(process_groups, "choose_backend", lambda requested, device: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(f"set_device {device}"))
    monkeypatch.setattr(process_groups, "set_determinism", lambda on: events.append(f"determinism {on}"))

    def resolve_job(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("plan")
        raise _StopBeforePlan

    monkeypatch.setattr(build, "resolve_job", resolve_job)
    with pytest.raises(_StopBeforePlan):
        trainer.Trainer(load_config([*TINY, "--training.deterministic", "true"]))
    assert events == ["set_device cuda:3", "determinism True", "plan"]


@pytest.fixture
def restore_determinism():  # type: ignore[no-untyped-def]
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    if saved[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[3]


@pytest.mark.usefixtures("restore_determinism")
def test_determinism_configures_cublas_and_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.backends.cudnn.benchmark = True
    process_groups.set_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


@pytest.mark.usefixtures("restore_determinism")
def test_determinism_keeps_the_users_workspace_and_off_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(False)
    process_groups.set_determinism(False)
    assert not torch.are_deterministic_algorithms_enabled()
    process_groups.set_determinism(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize(
    "op",
    [
        "_scaled_dot_product_cudnn_attention",  # first in torch's priority on sm90 with recent cuDNN
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ],
)
def test_selective_ac_saves_every_sdpa_kernel(op: str) -> None:
    assert getattr(torch.ops.aten, op).default in activation_checkpoint.SAC_SAVE_LIST


def test_selective_ac_saves_tp_collectives() -> None:
    """Recomputing a TP reduce-scatter in backward would repeat the collective (torchtitan saves it)."""
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in activation_checkpoint.SAC_SAVE_LIST
    assert torch.ops._c10d_functional.all_reduce.default in activation_checkpoint.SAC_SAVE_LIST
