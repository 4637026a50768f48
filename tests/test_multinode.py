"""Launching several processes: two torchrun agents on loopback form one 2-"node" job through c10d
rendezvous, as scripts/multinode_trainer.slurm does across hosts, and train with FSDP across
them; what the user sees when a launch fails: a config that cannot run on the world size is one
`error:` line and exit code 2 from run_llama_train.sh and from torchtitan_amp.launch before
torchrun starts (tests/test_config.py has the configs), and a rank that fails inside the job is
one `error:` line from that rank, naming the log file that holds torchrun's report."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.inputs import TINY
from tests.support.launch import REPO, _env, read_metrics, run_command
from tests.test_config import DEBUG_CONFIG, WORLD_SIZE_ERRORS

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_rendezvous_trains_with_fsdp(tmp_path: Path) -> None:
    port = _free_port()
    dump = tmp_path / "out"
    cmd = lambda node_rank: [  # noqa: E731
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "1",
        "--node_rank",
        str(node_rank),
        "--rdzv_id",
        "test-job",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "train.py",
        "--job.config_file",
        "train_configs/debug_model.toml",
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        "3",
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--mixed_precision.enabled",
        "true",
    ]
    env = _env(None)  # the repo on PYTHONPATH, no RANK / MASTER_* inherited from an outer launch
    agents = [
        subprocess.Popen(cmd(i), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in (0, 1)
    ]
    outputs = []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=240)
        finally:
            agent.kill()
        outputs.append(out)
        assert agent.returncode == 0, out[-3000:]
    assert "world size 2" in outputs[0]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    report = json.loads((dump / "precision_report.json").read_text())
    assert report["path"] == "fsdp"


def _launcher(nproc: int, *args: str | Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchtitan_amp.launch",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--local-ranks-filter",
        "0",
        "train.py",
        *map(str, args),
    ]


def _script(nproc: int, *args: str | Path) -> tuple[list[str], dict[str, str]]:
    return ["bash", str(REPO / "run_llama_train.sh"), *map(str, args)], {"NGPU": str(nproc), "PYTHON": sys.executable}


def _one_error_line(result) -> str:
    """The error line of a failed launch, after checking that it is all the terminal got of torchrun."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.describe()
    for noise in ("Traceback", "ChildFailedError", "OMP_NUM_THREADS", "set_vital"):
        assert noise not in result.output, result.describe()
    return errors[0]


# Every world-size error through the launcher; the script only execs it, so two of them (the
# commands users type first) go through run_llama_train.sh as well. Each launch costs ~3 s of
# importing torch; tests/test_config.py checks every message in process.
_LAUNCHES = [("launch", *case) for case in WORLD_SIZE_ERRORS] + [
    ("run_llama_train.sh", *case) for case in WORLD_SIZE_ERRORS[:2]
]


@pytest.mark.parametrize("how, world_size, argv, expected", _LAUNCHES)
def test_world_size_errors_are_one_line_before_torchrun_starts(
    how: str, world_size: int, argv: list[str], expected: str
) -> None:
    if how == "launch":
        result = run_command(_launcher(world_size, *DEBUG_CONFIG, *argv), timeout=120)
    else:
        cmd, env = _script(world_size, *argv)
        result = run_command(cmd, env={**env, "CONFIG_FILE": DEBUG_CONFIG[1]}, timeout=120)
    assert result.returncode == 2, result.describe()
    assert result.stdout == "" and result.stderr.count("\n") == 1, result.describe()
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.describe()


def _log_named_by(line: str) -> Path:
    match = re.search(r"torchrun's report: (\S+)\)$", line)
    assert match, line
    return Path(match[1])


def test_a_rank_that_fails_inside_the_job_is_one_line_naming_the_log(tmp_path: Path) -> None:
    # Rank 1 exits hard after step 1; only rank 0 is shown (LOG_RANK=0). The config passes the
    # pre-flight silently, and rank 0's start-up lines show the job ran.
    cmd, env = _script(
        2,
        "--job.dump_folder",
        tmp_path / "out",
        *TINY,
        "--training.steps",
        "3",
        "--debug.fault_inject_at_step",
        "1",
        "--debug.fault_inject_rank",
        "1",
    )
    result = run_command(cmd, env={**env, "CONFIG_FILE": DEBUG_CONFIG[1]}, timeout=240)
    assert result.returncode == 1, result.describe()
    line = _one_error_line(result)
    assert line.startswith("error: rank 1 exited with code 1: fault injection: rank 1 exits hard after step 1")
    assert "[rank0]" in result.stdout and "training 3 steps" in result.stdout and "[rank1]" not in result.output
    log = _log_named_by(line).read_text()
    assert "[rank1]:fault injection" in log and "Root Cause (first observed failure)" in log
    assert "OMP_NUM_THREADS" in log  # torchrun's banner: in the log, not on the terminal


def test_a_data_error_found_by_every_rank_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_tokens"
    result = run_command(
        _launcher(2, *DEBUG_CONFIG, "--training.dataset", f"tokens:{missing}", "--job.dump_folder", tmp_path / "out"),
        timeout=240,
    )
    assert result.returncode == 2, result.describe()
    line = _one_error_line(result)
    assert re.match(rf"error: rank [01]: token folder {re.escape(str(missing))} does not exist", line), line
    log = _log_named_by(line).read_text()
    assert "]:error: token folder" in log and "Root Cause (first observed failure)" in log
