"""Trackers: Weights & Biases beside TensorBoard. One in-process training run of
debugmodel_tiny (3 steps, fp32) with both enabled, offline because no login exists here (the
environment is emptied of W&B credentials and points at an empty netrc: nothing can reach the
network); every number is read back from the files the libraries wrote and compared with
metrics.jsonl.

wandb 0.31 has no Python reader for its run file any more (its internal DataStore moved to the Go
core), so `wandb_records` reads it: a LevelDB log (7-byte file header ':W&B' + magic + version,
32 KiB blocks of chunks with a 7-byte header: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST), each
record one wandb.proto Record message."""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.inputs import TINY
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core import environment
from torchtitan_amp.main import check_config
from torchtitan_amp.observability import trackers
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.dist

_BLOCK, _HEADER = 32768, 7
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> Iterator[object]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        parts += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(dump: Path) -> dict:
    """What the offline run(s) of a dump folder hold: per run file, its id, name, tags, notes,
    history rows (step -> {key: value}), config and the files saved with it."""
    runs = []
    for path in sorted(dump.glob("wandb/offline-run-*/run-*.wandb")):
        run: dict = {"history": {}, "config": {}, "files": [], "dir": path.parent}
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(id=rec.run.run_id, name=rec.run.display_name, tags=list(rec.run.tags), notes=rec.run.notes)
                run["config"].update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in rec.config.update})
            elif kind == "history":
                # A key with a "/" or a media value's fields come as nested_key parts.
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"][int(items["_step"])] = items
            elif kind == "files":
                run["files"] += [f.path for f in rec.files.files]
        runs.append(run)
    return runs


@pytest.fixture
def no_wandb_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No credentials, an empty netrc, W&B's own folders in tmp: offline by our rule alone."""
    for var in (
        "WANDB_MODE",
        "WANDB_API_KEY",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_BASE_URL",
        "WANDB_PROJECT",
        "WANDB_ENTITY",
        "WANDB_DIR",
        "WANDB_RUN_ID",
    ):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    for var, name in (
        ("WANDB_CONFIG_DIR", "wb_config"),
        ("WANDB_CACHE_DIR", "wb_cache"),
        ("WANDB_DATA_DIR", "wb_data"),
    ):
        monkeypatch.setenv(var, str(tmp_path / name))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtypes: 1e12)  # no matmul measurement


def test_wandb_and_tensorboard_hold_every_logged_step(tmp_path: Path, no_wandb_login: None) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert trackers.wandb_mode() == "offline"
    dump = tmp_path / "tiny_run"
    trainer = trainer_module.Trainer(
        load_config(
            [
                *TINY,
                "--training.steps",
                "3",
                "--training.seq_len",
                "16",
                "--training.local_batch_size",
                "2",
                "--no-mixed_precision.enabled",
                "--metrics.enable_tensorboard",
                "--metrics.enable_wandb",
                "--metrics.wandb_tags",
                "tiny,ci",
                "--job.description",
                "trackers test",
                "--job.dump_folder",
                str(dump),
            ]
        )
    )
    trainer.train()
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]

    (run,) = wandb_run(dump)
    assert run["id"] == (dump / trackers.WANDB_ID_FILE).read_text().strip()
    assert (run["name"], run["tags"], run["notes"]) == ("tiny_run", ["tiny", "ci"], "trackers test")
    # Every logged step's every metrics.jsonl value, bit for bit (both are JSON doubles).
    for row in rows:
        logged = run["history"][row["step"]]
        assert {k: logged[f"train/{k}"] for k in row if k != "step"} == {k: v for k, v in row.items() if k != "step"}
    # The job config as the run config, the precision report in it and as a file of the run.
    report = json.loads((dump / "precision_report.json").read_text())
    assert run["config"]["training"]["steps"] == 3 and run["config"]["metrics"]["enable_wandb"] is True
    assert run["config"]["precision_report"] == report and report["path"] == "full"
    assert "precision_report.json" in run["files"]
    assert json.loads((run["dir"] / "files" / "precision_report.json").read_text()) == report

    # TensorBoard, written alongside: the same losses (stored as float32) and the config text.
    events = EventAccumulator(str(dump / "tb"), size_guidance={"tensors": 0}).Reload()
    tb_loss = {e.step: e.value for e in events.Scalars("train/loss")}
    assert tb_loss == {r["step"]: float(np.float32(r["loss"])) for r in rows}
    assert {"config", "files/precision_report.json"} <= {
        t.rsplit("/text_summary", 1)[0] for t in events.Tags()["tensors"]
    }


def test_a_second_run_in_the_same_folder_appends_to_the_same_wandb_run(tmp_path: Path, no_wandb_login: None) -> None:
    """The W&B run id lives in the dump folder: a resumed (or restarted) run there logs to the same
    W&B run, as metrics.jsonl and TensorBoard append in the same folder. log_text lands too."""
    for first in (1, 3):
        # W&B names a run's folder by the second it started in and the id: a second run within the
        # same second would write into the first one's folder.
        time.sleep(1.0 - time.time() % 1.0 + 0.01)
        t = trackers.WandbTracker(tmp_path, project="p", entity="", name="", tags=(), notes="")
        t.log_scalars(first, {"loss": 5.0})
        t.log_scalars(first + 1, {"loss": 4.0})
        t.log_text(first + 1, "samples", "a <b> & c")
        t.close()
    first_run, second = wandb_run(tmp_path)
    assert first_run["id"] == second["id"] == (tmp_path / trackers.WANDB_ID_FILE).read_text().strip()
    assert sorted(first_run["history"]) == [1, 2] and sorted(second["history"]) == [3, 4]
    assert second["history"][4]["train/loss"] == 4.0 and second["history"][4]["samples/_type"] == "html-file"
    html = next((second["dir"] / "files").rglob("*.html")).read_text()
    assert "a &lt;b&gt; &amp; c" in html


@pytest.mark.parametrize(
    ("env", "netrc", "mode"),
    [
        ({}, "", "offline"),
        ({"WANDB_API_KEY": "x" * 40}, "", "online"),
        ({}, "machine api.wandb.ai login user password " + "k" * 40, "online"),
        ({}, "machine other.host login user password k", "offline"),
        ({"WANDB_BASE_URL": "https://wandb.example.org"}, "machine wandb.example.org login u password k", "online"),
        ({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x" * 40}, "", "disabled"),  # W&B's own switch wins
        ({}, "machine api.wandb.ai login", "offline"),  # a netrc without a password is no login
    ],
)
def test_wandb_mode_is_offline_without_a_login(
    env: dict[str, str], netrc: str, mode: str, tmp_path: Path, no_wandb_login: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "netrc").write_text(netrc + "\n")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert trackers.wandb_mode() == mode


def test_bad_metrics_config_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        (
            "--metrics.wandb_project",
            "team/run",
        ): "'metrics.wandb_project' = 'team/run': at most 128 characters, none of",
        ("--metrics.wandb_tags", "ok," + "t" * 65): "'metrics.wandb_tags': each tag must be 1-64 characters",
    }
    for args, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(list(args))
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
        assert check_config(list(args)) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    # Without the package, enabling W&B is refused with the install command before anything is
    # built: by the config check train.py and check_config run, and by job.resolve (any Trainer).
    # The config itself is valid: wandb being installed is a property of the environment.
    monkeypatch.setattr(environment.importlib.util, "find_spec", lambda name: None)
    missing = "'metrics.enable_wandb' needs the wandb package, which is not installed: pip install wandb"
    config = load_config(["--metrics.enable_wandb", *TINY])
    assert check_config(["--metrics.enable_wandb"]) == 2
    assert capsys.readouterr().err == f"error: {missing}\n"
    with pytest.raises(ConfigError, match=f"^{re.escape(missing)}$"):
        job_mod.resolve(config, 1, "cpu")
    assert check_config([]) == 0  # disabled, the package is not needed
