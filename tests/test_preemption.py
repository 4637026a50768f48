"""Pre-emption whose deadline is the sender's, not torchrun's (torchtitan_amp/launch.py): a stop
signal to the launcher reaches the ranks, which finish a step longer than torchrun's shutdown
grace, save, and exit 0 with the launcher; the SLURM script's trap delivers SLURM's warning the
same way (srun, scontrol and hostname stubbed: no cluster here); and the deadline arithmetic of
checkpoint.preemption_warning_s.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_amp import dry_run, launch
from torchtitan_amp.checkpoint import scan_folder
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.run_control import DeadlineCheck

from tests.support import ONE_THREAD, REPO, WORKERS, _env, read_metrics, run_command, torchrun_cmd

STEPS = 5
ARGS = [
    "--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel_h64",
    "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3", "--mixed_precision.enabled", "false",
    "--parallelism.data_parallel_shard_degree", "2",
    # No interval saves: the only checkpoint of an interrupted run is the pre-emption's.
    "--checkpoint.enable", "--checkpoint.interval", "1000",
]
# Fields of a metrics.jsonl record that a resumed run must reproduce exactly.
EXACT = ("loss", "grad_norm", "lr", "epoch")
GRACE_S, STEP_DELAY_S = 1, 3  # torchrun's SIGKILL grace for the test, shorter than one step


def _complete_steps(folder: Path) -> dict[int, str]:
    return {s: info.kind for s, info in scan_folder(folder)[0].items()}


def _by_step(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}


def _wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before it could be signalled"
        if any(r["step"] >= step for r in read_metrics(dump)):
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} not reached in {timeout} s")


def _signal_and_wait(cmd: list[str], dump: Path, log: Path, sig: signal.Signals, *, env: dict[str, str],
                     after_step: int = 2, group: bool = False) -> tuple[int, str]:
    """Start cmd in its own session, send `sig` to it (to its whole process group with `group`, as
    a terminal's Ctrl-C does) once step `after_step` is logged, return its exit code and output;
    kill everything it started if it hangs."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(env), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            _wait_for_step(dump, after_step, proc)
            (os.killpg if group else os.kill)(proc.pid, sig)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                _kill_tree(proc.pid)
                proc.wait()
    return proc.returncode, log.read_text()


def _kill_tree(root: int) -> None:
    # The launcher runs torchrun in a session of its own, so a killpg of ours would miss it.
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo, tree = [root], []
    while todo:
        tree.append(pid := todo.pop())
        todo += children.get(pid, [])
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigterm_to_launcher_saves_after_a_step_longer_than_torchruns_grace_and_resumes_bitwise(tmp_path):
    reference, dump = tmp_path / "reference", tmp_path / "job"
    steps = ["--training.steps", str(STEPS)]
    result = run_command(torchrun_cmd(2, "train.py", *ARGS, *steps, "--job.dump_folder", reference),
                         timeout=240, env=ONE_THREAD)
    assert result.returncode == 0, result.describe()

    # Each step sleeps STEP_DELAY_S, and torchrun's agent would SIGKILL its ranks GRACE_S after a
    # signal reached it: only a signal that bypasses the agent leaves time for the step and save.
    cmd = [sys.executable, "-m", "torchtitan_amp.launch", "--standalone", "--nproc_per_node=2",
           f"--shutdown-timeout={GRACE_S}", str(WORKERS / "slow_steps.py"), str(STEP_DELAY_S),
           *ARGS, *steps, "--job.dump_folder", str(dump)]
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGTERM, env=ONE_THREAD)
    assert code == 0, out[-4000:]
    assert "launch: SIGTERM: asking 2 rank(s) to finish the step" in out
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert _complete_steps(dump / "checkpoint") == {stopped_at: "full"} and stopped_at < STEPS, out[-4000:]

    result = run_command(torchrun_cmd(2, "train.py", *ARGS, *steps, "--job.dump_folder", dump),
                         timeout=240, env=ONE_THREAD)
    assert result.returncode == 0, result.describe()
    assert f"step-{stopped_at} (" in result.stdout  # it resumed from the pre-emption's checkpoint
    got, want = _by_step(dump), _by_step(reference)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in EXACT:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


def test_ctrl_c_to_the_launchers_process_group_saves_and_exits_0(tmp_path):
    # A terminal sends SIGINT to its whole foreground process group; were the ranks in it, they
    # would die of KeyboardInterrupt instead of saving.
    dump = tmp_path / "job"
    cmd = [sys.executable, "-m", "torchtitan_amp.launch", "--standalone", "--nproc_per_node=2", "train.py",
           *ARGS, "--training.steps", "1000", "--job.dump_folder", str(dump)]
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGINT, env=ONE_THREAD, group=True)
    assert code == 0, out[-4000:]
    assert "launch: SIGINT: asking 2 rank(s) to finish the step" in out
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert _complete_steps(dump / "checkpoint") == {stopped_at: "full"}, out[-4000:]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_slurm_script_passes_the_warning_signal_to_the_ranks_which_save_and_exit_0(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", 'echo node1\n')
    _stub(bin_dir, "hostname", 'echo 127.0.0.1\n')
    # srun on one node: drop its options and become the task, as slurmstepd would run it. srun's
    # own forwarding of SIGTERM to its tasks is SLURM's and cannot be run here.
    _stub(bin_dir, "srun", 'while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\n'
                           'exec "$@"\n')
    dump = tmp_path / "job"
    env = {**ONE_THREAD, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1",
           "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "2", "RDZV_PORT": str(_free_port()),
           "CONFIG_FILE": "train_configs/debug_model.toml", "PREEMPT_WARNING_S": "90"}
    cmd = ["bash", str(REPO / "scripts" / "multinode_trainer.slurm"), *ARGS[2:], "--training.steps", "1000",
           "--job.dump_folder", str(dump)]
    # What `#SBATCH --signal=B:USR1@N` does N seconds before the time limit: SIGUSR1 to the batch shell.
    code, out = _signal_and_wait(cmd, dump, tmp_path / "log.txt", signal.SIGUSR1, env=env)
    assert code == 0, out[-4000:]
    assert "SIGUSR1: asking ranks to checkpoint and exit (deadline in 90 s)" in out
    assert "launch: SIGTERM: asking 2 rank(s)" in out
    assert "pre-emption: 90 s warning" in out  # PREEMPT_WARNING_S became checkpoint.preemption_warning_s
    stopped_at = max(r["step"] for r in read_metrics(dump))
    assert _complete_steps(dump / "checkpoint") == {stopped_at: "full"}, out[-4000:]
    # The deadline arithmetic starts from the dry run's per-rank checkpoint size: it is what each
    # rank wrote, to DCP's overhead (0.8% here), plus, on the rank DCP picks for them, the pickled
    # non-tensor entries (per-parameter optimizer settings, LR schedule: ~1.2 MB, 3.9% of this
    # tiny model's share, a vanishing fraction of a real one's).
    config = load_config([*ARGS, "--job.dump_folder", str(tmp_path / "dry")])
    for rank in (0, 1):
        estimate = dry_run.run(config, world_size=2, rank=rank, write=False)["memory"]["checkpoint"]
        written = (dump / "checkpoint" / f"step-{stopped_at}" / f"__{rank}_0.distcp").stat().st_size
        assert estimate <= written <= 1.05 * estimate, (rank, estimate, written)


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
