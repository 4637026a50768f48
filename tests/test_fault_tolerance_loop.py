"""The training loop under per-step fault tolerance, in one process: a replica group's Trainer with
torchft's Manager replaced by stand-ins (tests/support/standins.py's SameValuesManager) that fail to commit,
or heal this group from a live one at its first quorum. What must hold: a group that keeps failing
to commit still obeys a stop signal (saves the last committed step and exits), and a group that
healed gets the steady-state collective timeouts after its first step, as a fresh one does. The
launches with a real lighthouse are in test_fault_tolerance.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.standins import SameValuesManager
from torchtitan_amp.config import load_config
from torchtitan_amp.train import build
from torchtitan_amp.train import trainer as trainer_module
from torchtitan_amp.train.fault_tolerance import FaultTolerance

ARGS = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--mixed_precision.enabled",
    "false",
    "--fault_tolerance.enable",
    "true",
    "--fault_tolerance.group_size",
    "2",
]


def _trainer(monkeypatch, manager: SameValuesManager, folder: Path, *extra: str) -> trainer_module.Trainer:
    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    monkeypatch.setattr(
        build.fault_tolerance,
        "build",
        lambda config, plan, *device: FaultTolerance(config.fault_tolerance, plan, manager=manager),
    )
    return trainer_module.Trainer(load_config([*ARGS, *extra, "--job.dump_folder", str(folder)]))


class _FailsFromStep2(SameValuesManager):
    """Commits step 1, then never again (a peer keeps failing): a stop signal arrives during the
    second failed try; after 6 failed tries the group must long have stopped."""

    def __init__(self) -> None:
        super().__init__()
        self.tries = 0

    def should_commit(self) -> bool:
        from torchtitan_amp.checkpoint import preemption

        self.tries += 1
        if self.tries == 3:
            preemption._stop_signal = "SIGTERM"
        if self.tries > 6:
            raise RuntimeError("the group kept training after a stop signal")
        return self.tries == 1


def test_a_group_that_keeps_failing_to_commit_obeys_a_stop_signal(monkeypatch, tmp_path: Path) -> None:
    from torchtitan_amp.checkpoint import preemption

    monkeypatch.setattr(preemption, "_stop_signal", None)
    manager = _FailsFromStep2()
    trainer = _trainer(
        monkeypatch,
        manager,
        tmp_path,
        "--training.steps",
        "10",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "100",
    )
    trainer.train()
    assert manager.tries == 3, "the stop was not seen at the discarded step it arrived in"
    assert trainer.step == 1 and trainer.run.ft.discarded == 2
    # The forced save holds the last committed step.
    assert (tmp_path / "replica_0").is_dir() and (tmp_path / "checkpoint" / "step-1").is_dir()


class _HealsAtFirstQuorum(SameValuesManager):
    """The first quorum finds this group behind a live group at step 7: it loads that group's state
    (here its own, with the live group's counters), as torchft's Manager does in start_quorum."""

    def __init__(self) -> None:
        super().__init__()
        self.fns: dict[str, tuple] = {}
        self.quorums = 0

    def register_state_dict_fn(self, key, load, state_dict) -> None:
        self.fns[key] = (load, state_dict)

    def start_quorum(self) -> None:
        self.quorums += 1
        if self.quorums == 1:
            load, state_dict = self.fns["training"]
            live = dict(state_dict())
            live["step"] = 7
            load(live)


def test_a_healed_group_switches_to_the_steady_state_timeouts(monkeypatch, tmp_path: Path) -> None:
    calls: list[float] = []
    monkeypatch.setattr(trainer_module.process_groups, "set_timeouts", lambda timeout_s, dims: calls.append(timeout_s))
    trainer = _trainer(
        monkeypatch, _HealsAtFirstQuorum(), tmp_path, "--training.steps", "10", "--comm.timeout_seconds", "123"
    )
    trainer.train()
    assert trainer.run.ft.heals == 1 and trainer.step == 10
    assert calls == [123], "the healed group kept the start-up timeouts"


def test_one_process_without_torchrun_is_a_replica_group(monkeypatch, tmp_path: Path) -> None:
    """`python train.py --fault_tolerance.enable true ...` (no torchrun, so no MASTER_ADDR): the
    process is a one-rank group with a store of its own, against a real lighthouse."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    from tests.support.launch import read_metrics

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(build, "peak_flops", lambda device, dtype: 1e12)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        args = [
            *ARGS,
            "--fault_tolerance.group_size",
            "1",
            "--fault_tolerance.lighthouse",
            lighthouse.address(),
            "--training.steps",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ]
        trainer = trainer_module.Trainer(load_config(args))
        trainer.train()
    finally:
        lighthouse.shutdown()
    rows = read_metrics(tmp_path / "replica_0")
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["ft_participants"] == 1
