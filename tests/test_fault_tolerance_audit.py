"""The precision audit under fault tolerance, in one process: a replica group's Trainer with
torchft's Manager replaced by a stand-in (the peer group holds the same values, the quorum is
immediate), so the audited step runs the loop's cross-group all-reduces (the one-rank buckets, or
DiLoCo's sync) through FaultTolerance.allreduce, where the audit records them. Each wire in
another dtype than the plan's is named, and a promised all-reduce that never ran too. The FSDP
hook path is the same call (FaultTolerance._allreduce_in_place), recorded here directly; the
launches with a real lighthouse are in test_fault_tolerance.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.standins import SameValuesManager, use_stand_in_manager
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.precision.audit import CrossGroupWires, check_cross_group
from torchtitan_amp.train import trainer as trainer_module
from torchtitan_amp.train.fault_tolerance import FaultTolerance

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--mixed_precision.enabled",
    "true",
    "--fault_tolerance.enable",
    "true",
    "--fault_tolerance.group_size",
    "2",
]
DILOCO = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"]


@pytest.fixture(autouse=True)
def _stand_in_manager(monkeypatch):
    use_stand_in_manager(monkeypatch)


def _trainer(tmp_path: Path, *extra: str) -> trainer_module.Trainer:
    return trainer_module.Trainer(load_config([*BASE, *extra, "--job.dump_folder", str(tmp_path)]))


@pytest.mark.parametrize(
    "extra, kind, wire",
    [
        ((), "gradients", {"float32": ["float32"]}),
        (
            ("--mixed_precision.enabled", "false", "--training.dtype", "bfloat16"),
            "gradients",
            {"bfloat16": ["bfloat16"]},
        ),
        (
            (*DILOCO, "--fault_tolerance.pseudo_gradient_dtype", "bfloat16"),
            "pseudo_gradient",
            {"float32": ["bfloat16"]},
        ),
    ],
)
def test_audit_records_and_passes_the_cross_group_allreduce(
    tmp_path: Path, extra: tuple[str, ...], kind: str, wire: dict[str, list[str]]
) -> None:
    result = _trainer(tmp_path, *extra).audit()
    assert result.ok, result.breaches
    saved = json.loads((tmp_path / "replica_0" / "precision_audit.json").read_text())
    assert saved["cross_group_allreduce"] == {kind: wire}
    name = {
        "gradients": "gradient all_reduce:replica_groups",
        "pseudo_gradient": "pseudo-gradient all_reduce:replica_groups",
    }[kind]
    assert set(saved["collectives"][name]) == {w for ws in wire.values() for w in ws}
    assert saved["collectives"][name][wire[next(iter(wire))][0]] > 0


def test_a_gradient_sent_in_another_dtype_is_named(tmp_path: Path) -> None:
    t = _trainer(tmp_path)
    real = t.run.ft.plan
    # The group sends fp32 gradients in bf16, where the plan promises their own dtype.
    t.run.ft.plan = SimpleNamespace(cross_group_dtype=lambda d: torch.bfloat16)
    assert real.cross_group_dtype(torch.float32) == torch.float32
    breaches = [str(b) for b in t.audit().breaches]
    assert breaches == ["gradient all_reduce:replica_groups of float32 values: promised float32, saw bfloat16"]


def test_a_pseudo_gradient_sent_in_another_dtype_is_named(tmp_path: Path) -> None:
    t = _trainer(tmp_path, *DILOCO)  # the plan: fp32 pseudo-gradients
    t.run.diloco.plan = dataclasses.replace(t.run.plan, pseudo_gradient_dtype=torch.bfloat16)
    breaches = [str(b) for b in t.audit().breaches]
    assert breaches == ["pseudo-gradient all_reduce:replica_groups of float32 values: promised float32, saw bfloat16"]


def _plan(*extra: str) -> PrecisionPlan:
    config = load_config([*BASE[-4:], *extra])
    return PrecisionPlan.from_config(config, ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)


def test_fsdp_hook_path_is_recorded_per_reduce_scatter_output() -> None:
    """FSDP's all-reduce hook hands each reduce-scatter output (in its reduce dtype) to
    _allreduce_in_place: recorded with that dtype, sent in cross_group_dtype of it."""
    plan = _plan("--mixed_precision.enabled", "true", "--mixed_precision.reduce_dtype", "bfloat16")
    manager = SameValuesManager()
    ft = FaultTolerance(load_config(BASE[-4:]).fault_tolerance, plan, manager=manager)
    wires = CrossGroupWires()
    with ft.recording(wires):
        ft._allreduce_in_place(torch.ones(8, dtype=torch.bfloat16))
        ft._allreduce_in_place(torch.ones(4))  # an fp32 module's gradients
    ft._allreduce_in_place(torch.ones(4))  # outside the block: not recorded
    assert manager.sent == [torch.bfloat16, torch.float32, torch.float32]
    assert wires.result() == {"gradients": {"bfloat16": ["bfloat16"], "float32": ["float32"]}}
    assert dict(wires.bytes["gradient all_reduce:replica_groups"]) == {"bfloat16": 16, "float32": 16}
    assert check_cross_group(wires.result(), plan, sends=True) == []


def test_missing_and_unexpected_cross_group_allreduces_are_named() -> None:
    every_step, diloco = _plan(), _plan(*DILOCO)
    assert [str(b) for b in check_cross_group({}, every_step, sends=True)] == [
        "gradient all_reduce:replica_groups: promised float32, saw none seen"
    ]
    assert check_cross_group({}, every_step, sends=False) == []
    assert [str(b) for b in check_cross_group({"gradients": {"float32": ["float32"]}}, diloco, sends=True)] == [
        "gradient all_reduce:replica_groups: promised none (semi_sync_method = 'diloco'), saw float32",
        "pseudo-gradient all_reduce:replica_groups: promised float32, saw none seen",
    ]
    off = PrecisionPlan.from_config(load_config([]), ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)
    assert [str(b) for b in check_cross_group({"pseudo_gradient": {"float32": ["float32"]}}, off, sends=True)] == [
        "pseudo-gradient all_reduce:replica_groups: promised none (fault_tolerance.enable = false), saw float32"
    ]
