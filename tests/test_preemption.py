"""Pre-emption, in process: which processes the launcher (torchtitan_amp/launch.py) signals, its
exit codes and usage, and the deadline check of checkpoint.preemption_warning_s. The launches
(SIGTERM past torchrun's grace with a bitwise resume, Ctrl-C, the SLURM script's trap) are in
tests/test_checkpoint.py, among the multi-process tests.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from torchtitan_amp import launch
from torchtitan_amp.checkpoint.preemption import DeadlineCheck
from torchtitan_amp.config import ConfigError, load_config


def _fake_proc(root: Path, pid: int, ppid: int, comm: str, environ: bytes) -> None:
    folder = root / str(pid)
    folder.mkdir()
    (folder / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (folder / "environ").write_bytes(environ)


def test_launcher_signals_only_the_agents_workers(tmp_path):
    _fake_proc(tmp_path, 10, 1, "python", b"A=1\0")  # the agent
    _fake_proc(tmp_path, 11, 10, "python) S 99 (x", b"LOCAL_RANK=0\0TORCHELASTIC_RUN_ID=none\0")
    _fake_proc(tmp_path, 12, 10, "python", b"TORCHELASTIC_RUN_ID=none\0LOCAL_RANK=1\0")
    _fake_proc(tmp_path, 13, 10, "helper", b"A=1\0")  # a child that is no worker
    _fake_proc(tmp_path, 14, 11, "python", b"TORCHELASTIC_RUN_ID=none\0")  # a worker's child
    assert launch.worker_pids(10, tmp_path) == [11, 12]


def test_launcher_exit_codes_and_usage(capsys):
    assert launch.exit_code(0) == 0 and launch.exit_code(1) == 1
    assert launch.exit_code(-signal.SIGKILL) == 137
    assert launch.main([]) == 2
    assert capsys.readouterr().err.startswith("error: no arguments: give torchrun's options")
    assert launch.main(["--help"]) == 0
    assert "SIGTERM to the training ranks only" in capsys.readouterr().out


def test_deadline_check_warns_once_per_basis_when_step_and_save_do_not_fit():
    check = DeadlineCheck(120)
    assert check.problem(10.0, 100.0, "measured") is None
    problem = check.problem(30.0, 100.0, "measured")
    assert problem and "step 30.0 s + save 100.0 s exceed checkpoint.preemption_warning_s = 120 s" in problem
    assert check.problem(30.0, 100.0, "measured") is None  # said once
    assert check.problem(0.0, 130.0, "start-up estimate:") is not None
    assert DeadlineCheck(0).problem(1e9, 1e9, "measured") is None  # 0: the warning is not known


def test_negative_preemption_warning_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'checkpoint.preemption_warning_s' must be >= 0 \(0: unknown\), got -1"):
        load_config(["--checkpoint.preemption_warning_s", "-1"])
