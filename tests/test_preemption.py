"""The launcher (torchtitan_amp/launch.py), in process: which processes it signals, its exit codes
and usage, what it shows of torchrun's output (torchtitan_amp/observability/rank_output.py), and
the deadline check of checkpoint.preemption_warning_s. The pre-emption launches (SIGTERM past
torchrun's grace with a bitwise resume, Ctrl-C, the SLURM script's trap) are in
tests/test_checkpoint.py, among the multi-process tests; the launches that fail on purpose
(config errors before torchrun, a failing rank) in tests/test_multinode.py.
"""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest

from torchtitan_amp import launch
from torchtitan_amp.checkpoint.preemption import DeadlineCheck
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.observability.rank_output import RankOutput


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


# What torchrun's agent writes when rank 1 fails first and rank 0 is stopped: the ranks' tee'd lines,
# its banner, its traceback of ChildFailedError and its failure table (abridged).
AGENT_OUTPUT = [
    (True, "*****************************************"),
    (True, "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, ..."),
    (False, "[rank0]:21:13:34 [rank0] INFO training 3 steps on cpu (gloo), world size 2"),
    (False, "[rank1]:21:13:34 [rank1] INFO training 3 steps on cpu (gloo), world size 2"),
    (True, "[rank1]:error: token folder /data/x does not exist"),
    (True, "[rank0]:received SIGTERM: will save a checkpoint after this step and exit"),
    (True, "[rank0]:[rank0]: Traceback (most recent call last):"),
    (True, "[rank0]:[rank0]: RuntimeError: Connection closed by peer"),
    (True, "[rank0]:error: token folder /data/x does not exist"),
    (True, "Traceback (most recent call last):"),
    (True, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "),
    (True, "Failures:"),
    (True, "[1]:"),
    (True, "  rank      : 0 (local_rank: 0)"),
    (True, "  exitcode  : -15 (pid: 11)"),
    (True, "Root Cause (first observed failure):"),
    (True, "[0]:"),
    (True, "  rank      : 1 (local_rank: 1)"),
    (True, "  exitcode  : 2 (pid: 12)"),
]


def _routed(lines: list[tuple[bool, str]], **options) -> tuple[RankOutput, str, str, str]:
    log, out, err = io.StringIO(), io.StringIO(), io.StringIO()
    output = RankOutput(log, Path("/logs/launch.log"), stdout=out, stderr=err, **options)
    for is_err, line in lines:
        output.route(line + "\n", is_err)
    return output, out.getvalue(), err.getvalue(), log.getvalue()


def test_a_failed_job_is_one_error_line_from_the_first_failing_rank():
    output, out, err, log = _routed(AGENT_OUTPUT, ranks={0})
    # Rank 0's lines, except its traceback of the lost peer; nothing of rank 1's, nor of torchrun's.
    assert out == "[rank0]:21:13:34 [rank0] INFO training 3 steps on cpu (gloo), world size 2\n"
    assert err == "[rank0]:received SIGTERM: will save a checkpoint after this step and exit\n"
    assert log.splitlines() == [line for _, line in AGENT_OUTPUT]  # everything, in order
    assert output.summary(1) == (
        "error: rank 1: token folder /data/x does not exist (every rank's output and "
        "torchrun's report: /logs/launch.log)",
        2,
    )
    assert output.summary(0) is None


def test_a_crash_without_an_error_line_names_the_root_cause_rank_and_its_last_line():
    lines = [(is_err, line) for is_err, line in AGENT_OUTPUT if "error: token" not in line]
    lines.insert(4, (True, "[rank1]:fault injection: rank 1 exits hard after step 1"))
    output, *_ = _routed(lines, ranks={0})
    assert output.summary(1) == (
        "error: rank 1 exited with code 2: fault injection: rank 1 exits hard after step 1 "
        "(every rank's output and torchrun's report: /logs/launch.log)",
        2,
    )
    # No table either (torchrun rejected its options): its own last line.
    output, out, err, _ = _routed(
        [(True, "usage: torchrun [-h] ..."), (True, "torchrun: error: unrecognized arguments: -x")]
    )
    assert (out, err) == ("", "")
    assert output.summary(2)[0].startswith(
        "error: torchrun exited with code 2: torchrun: error: unrecognized arguments"
    )


def test_verbose_shows_torchruns_own_output_and_the_tracebacks_of_the_shown_ranks():
    _, out, err, _ = _routed(AGENT_OUTPUT, ranks={0}, verbose=True)
    assert "ChildFailedError" in err and "[rank0]:[rank0]: Traceback" in err and "OMP_NUM_THREADS" in err
    assert "[rank1]" not in out + err and "error:" not in err  # other ranks stay filtered; one error line


def test_the_launcher_filters_ranks_itself_from_every_rank_teed():
    assert launch.option_value(["--log-dir=/x", "a"], ("--log-dir",)) == ("/x", ["a"])
    assert launch.option_value(["--tee", "3", "a"], ("--tee",)) == ("3", ["a"])
    argv = ["--standalone", "--local-ranks-filter", "0,1", "train.py", "--x.y", "1"]
    assert launch.output_options(argv) == (["--tee", "3", "--standalone", "train.py", "--x.y", "1"], {0, 1}, False)
    assert launch.output_options(["--tee", "3", "train.py"]) == (["--tee", "3", "train.py"], None, False)
    # Output the launcher cannot attribute to a rank (redirected or tee'd otherwise) is all shown.
    assert launch.output_options(["--redirects", "3", "train.py"])[2] is True
    with pytest.raises(ValueError, match="local ranks separated by commas"):
        launch.output_options(["--local-ranks-filter", "one", "train.py"])
