"""The checkpoint manager is driven by one table (checkpoint.parts.PARTS): a new state to save
and restore is one entry there, in DCP (resharded on load) or in the per-rank files, and
`checkpoint.exclude_from_loading` knows its name at once. One process, a tiny model, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.inputs import TINY
from torchtitan_amp.checkpoint import parts
from torchtitan_amp.config import load_config
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.train.trainer import Trainer


def _trainer(tmp_path: Path, *extra: str) -> Trainer:
    return Trainer(
        load_config(
            [
                *TINY,
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "2",
                "--no-mixed_precision.enabled",
                "--checkpoint.enable",
                "--checkpoint.interval",
                "1",
                "--job.dump_folder",
                str(tmp_path),
                *extra,
            ]
        )
    )


def test_a_new_state_is_one_table_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = {"tensor": torch.arange(4.0), "count": 41}
    restored: dict[str, object] = {}
    in_dcp = parts.StatePart(
        "probe_dcp",
        True,
        lambda m: {"t": source["tensor"].clone()},
        lambda m, sd: restored.__setitem__("dcp", sd["t"].clone()),
    )
    per_rank = parts.StatePart(
        "probe_rank",
        False,
        lambda m: {"count": source["count"]},
        lambda m, sd: restored.__setitem__("rank", sd["count"]),
    )
    monkeypatch.setattr(parts, "PARTS", parts.PARTS + (in_dcp, per_rank))

    first = _trainer(tmp_path, "--training.steps", "1")
    first.train()
    source.update(tensor=torch.zeros(4), count=0)  # the live values moved on; the checkpoint has the old
    resumed = _trainer(tmp_path, "--training.steps", "2")
    resumed.run.metrics.close()
    assert resumed.step == 1
    assert torch.equal(restored["dcp"], torch.arange(4.0)) and restored["rank"] == 41

    restored.clear()
    skipping = _trainer(tmp_path, "--training.steps", "2", "--checkpoint.exclude_from_loading", "probe_rank")
    skipping.run.metrics.close()
    assert "rank" not in restored and "dcp" in restored


def test_exclude_from_loading_names_come_from_the_table(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match="unknown state 'probe'; choose from: model, optimizer, lr_scheduler, "
        "scaler, diloco, train_state, dataloader, rng",
    ):
        _trainer(tmp_path, "--checkpoint.exclude_from_loading", "probe")
