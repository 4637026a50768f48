"""DiLoCo's state in checkpoints (checkpoint/parts.py's "diloco" part), in one process: a replica
group's Trainer with torchft's Manager replaced by a stand-in (the peer group holds the same values)
trains 4 steps syncing every 2 and saving at each sync; a restart from step 2 ends bit for bit where
the straight run did (weights, fp32 global weights, outer momentum, sync count, AdamW moments).
Pure bf16 weights: the fp32 global weights hold bits the model does not, so a restart that rebuilt
them from the model would differ, as the run excluding the part shows. The launches with a real
lighthouse are in test_fault_tolerance.py (none saves under DiLoCo: a launch costs ~35 s). With
one group, the group's own files (which hold its inner optimizer state under DiLoCo) and the shared
checkpoint hold the same moments; that each group gets its own back needs two groups."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.support.standins import use_stand_in_manager
from torchtitan_amp.config import load_config
from torchtitan_amp.train import trainer as trainer_module

COMMON = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--training.steps",
    "4",
    "--training.dtype",
    "bfloat16",
    "--mixed_precision.enabled",
    "false",
    "--fault_tolerance.enable",
    "true",
    "--fault_tolerance.group_size",
    "2",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "2",
]
ARGS = [*COMMON, "--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"]


@pytest.fixture(autouse=True)
def _stand_in_manager(monkeypatch):
    use_stand_in_manager(monkeypatch)


def _train(folder: Path, *extra: str) -> trainer_module.Trainer:
    trainer = trainer_module.Trainer(load_config([*ARGS, *extra, "--job.dump_folder", str(folder)]))
    trainer.train()
    return trainer


def _state(t: trainer_module.Trainer) -> dict[str, torch.Tensor]:
    def local(x: torch.Tensor) -> torch.Tensor:
        return (x.to_local() if isinstance(x, DTensor) else x).detach().clone()

    out = {f"model.{n}": local(p) for n, p in t.run.model.named_parameters()}
    out |= {f"global.{i}": g.clone() for i, g in enumerate(t.run.diloco.global_weights)}
    out |= {f"momentum.{i}": m.clone() for i, m in enumerate(t.run.diloco.momentum)}
    out |= {
        f"adam.{i}.{k}": local(v)
        for i, p in enumerate(t.run.params)
        for k, v in t.run.optimizer.state[p].items()
        if isinstance(v, torch.Tensor)
    }
    out["syncs"] = torch.tensor(t.run.diloco.syncs)
    return out


def test_a_restart_from_a_sync_checkpoint_continues_bitwise(tmp_path: Path) -> None:
    straight = _train(tmp_path / "straight")
    want = _state(straight)
    assert straight.run.diloco.syncs == 3 and {g.dtype for g in straight.run.diloco.global_weights} == {torch.float32}
    assert any(torch.count_nonzero(m) for m in straight.run.diloco.momentum)
    # Each group's own files hold its inner optimizer state (DCP) beside its rank files.
    assert (tmp_path / "straight" / "checkpoint" / "ft-replica-0" / "step-2" / ".metadata").is_file()
    for name, extra in (("restart", ()), ("without_diloco", ("--checkpoint.exclude_from_loading", "diloco"))):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "straight", folder)
        for step_4 in folder.rglob("step-4"):  # the shared checkpoint and the group's own files
            shutil.rmtree(step_4)
        got = _state(_train(folder, *extra))
        assert set(got) == set(want)
        same = [k for k in want if torch.equal(got[k], want[k])]
        if name == "restart":
            assert same == list(want), f"differs: {[k for k in want if k not in same][:5]}"
        else:  # global weights rebuilt from the bf16 model, momentum from 0: a different run
            assert [k for k in want if k.startswith("model.") and k not in same]
            assert [k for k in want if k.startswith("global.") and k not in same]


def test_a_checkpoint_without_diloco_state_is_refused_in_one_line(tmp_path: Path) -> None:
    from torchtitan_amp.core.errors import CheckpointError

    every_step = [*COMMON, "--training.steps", "2", "--job.dump_folder", str(tmp_path)]  # gradients every step
    trainer_module.Trainer(load_config(every_step)).train()
    with pytest.raises(
        CheckpointError,
        match=r"step-2 has no DiLoCo state \(saved without fault_tolerance."
        r"semi_sync_method = 'diloco'\); add 'diloco' to checkpoint.exclude",
    ) as e:
        trainer_module.Trainer(load_config([*ARGS, "--job.dump_folder", str(tmp_path)]))
    assert "\n" not in str(e.value)
