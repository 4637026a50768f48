"""Fault tolerance with torchft on gloo: two replica groups of FSDP 2 (four ranks, two torchruns)
on debugmodel_tiny, a lighthouse in this process (and two one-rank groups: torchft alone
replicates). Group 1 dies hard at step 5, either between steps (its rank 0 exits after the step) or
during the step's cross-group all-reduce (its rank 0 is SIGKILLed inside it); torchrun ends the rest
of the group, and the test starts it again. Group 0 is never restarted.

What must hold: the survivor logs every step once and finishes, having discarded only the step the
kill interrupted (none between steps, one during the all-reduce); the restarted group heals from it
(copies its state over HTTP) and resumes at the survivor's step, not at step 1; at the end both
groups hold the same shard of every parameter, bit for bit; the loss falls.

DiLoCo (semi_sync_method = "diloco", a sync every SYNC_STEPS steps, bf16 pseudo-gradients): group 1
is killed inside the sync of step 5 (after the quorum, before its all-reduce). The survivor
discards that sync (back to the initial global weights: steps 1-5 lost, none retried), trains alone,
and the restarted group heals at one of its later syncs; STEPS is a multiple of SYNC_STEPS, so the
last step is a sync and both groups end on the same global weights.

One scenario (CHECKPOINTED) also saves checkpoints every CKPT_EVERY steps into one folder shared by
the groups, then restarts both groups from the first checkpoint written after the kill (a full
restart, as after losing every group): each loads the shared state and its own data position.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.inputs import TINY
from tests.support.launch import (
    ONE_THREAD,
    REPO,
    WORKERS,
    _env,
    _free_port,
    assert_loss_falls,
    read_metrics,
    run_command,
    torchrun_cmd,
)

pytestmark = pytest.mark.dist

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchtitan-amp[ft])")

STEPS, KILL_AT, SYNC_STEPS = 40, 5, 5
assert STEPS % SYNC_STEPS == 0 and KILL_AT % SYNC_STEPS == 0
# KILL_AT not a multiple of CKPT_EVERY: a save right before the kill would eat into the lighthouse's heartbeat
# timeout, which test_the_survivor_loses_only_the_interrupted_step measures.
CHECKPOINTED, CKPT_EVERY, RESTART_STEPS = "fsdp2_between_steps", 4, 2
RESUME_AT = (KILL_AT // CKPT_EVERY + 1) * CKPT_EVERY  # the first checkpoint after the kill
assert (RESUME_AT + RESTART_STEPS) % CKPT_EVERY, (
    "the restart's last save must not replace a checkpoint of the first run"
)
# Long enough for a restarted group to start on two busy cores (10-30 s) while the survivor paces.
TIMEOUT_S = 300


def _launch(
    out: Path, nproc: int, replica_id: int, lighthouse: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    args = [
        "--job.dump_folder",
        out,
        *TINY,
        "--training.steps",
        str(STEPS),
        "--fault_tolerance.enable",
        "true",
        "--fault_tolerance.group_size",
        "2",
        "--fault_tolerance.replica_id",
        str(replica_id),
        *extra,
    ]
    cmd = torchrun_cmd(nproc, WORKERS / "ft_group.py", out, *args)
    env = _env({"TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "FT_PACE_ALONE_S": "1", **(env or {})})
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cmd, env=env, stdout=open(out.parent / f"{out.name}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"a replica group did not finish within {TIMEOUT_S} s")


# Ranks per group, every group's extra arguments, how group 1 is killed at step KILL_AT, and the
# steps (DiLoCo: syncs) the survivor discards for it. One rank per group: no FSDP, torchft
# all-reduces the plain gradients (replicate only).
_BETWEEN = (("--debug.fault_inject_at_step", str(KILL_AT)), {}, 0)
_DURING = ((), {"FT_KILL_DURING_ALLREDUCE": str(KILL_AT)}, 1)
DILOCO = (
    "--fault_tolerance.semi_sync_method",
    "diloco",
    "--fault_tolerance.sync_steps",
    str(SYNC_STEPS),
    "--fault_tolerance.pseudo_gradient_dtype",
    "bfloat16",
)
_DURING_SYNC = ((), {"FT_KILL_DURING_ALLREDUCE": str(KILL_AT), "FT_KILL_AT_CALL": "1"}, 1)
KILLS = {
    "fsdp2_between_steps": (2, (), *_BETWEEN),
    "fsdp2_during_allreduce": (2, (), *_DURING),
    "one_rank_between_steps": (1, (), *_BETWEEN),
    "diloco_fsdp2_during_sync": (2, DILOCO, *_DURING_SYNC),
}


@pytest.fixture(scope="module", params=sorted(KILLS))
def killed(request, tmp_path_factory) -> tuple[Path, int, int, bool]:
    """(root, steps the survivor must discard, ranks per group, DiLoCo?): root/g0 the survivor,
    g1a group 1 until it dies at step KILL_AT, g1b group 1 restarted."""
    from torchft._torchft import LighthouseServer

    root = tmp_path_factory.mktemp(f"ft_{request.param}")
    nproc, common, args, env, discarded = KILLS[request.param]
    ckpt = _checkpoint_args(root) if request.param == CHECKPOINTED else ()
    # A dead group is left out of the quorum once it misses heartbeats for heartbeat_timeout_ms.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000, heartbeat_timeout_ms=3000)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        together = {"FT_START_TOGETHER": str(root / "start")}  # both in the first quorum
        survivor = _launch(root / "g0", nproc, 0, lighthouse.address(), *common, *ckpt, env=together)
        victim = _launch(root / "g1a", nproc, 1, lighthouse.address(), *common, *args, *ckpt, env={**env, **together})
        (root / "g1a.rc").write_text(str(_wait(victim, deadline)))
        restarted = _launch(root / "g1b", nproc, 1, lighthouse.address(), *common, *ckpt)
        (root / "g0.rc").write_text(str(_wait(survivor, deadline)))
        (root / "g1b.rc").write_text(str(_wait(restarted, deadline)))
    finally:
        lighthouse.shutdown()
    if ckpt:
        _restart_every_group(root, nproc, ckpt)
    return root, discarded, nproc, bool(common)


def _checkpoint_args(root: Path) -> tuple[str, ...]:
    # An absolute checkpoint folder: the groups' dump folders differ here, their checkpoints are shared.
    return (
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        str(CKPT_EVERY),
        "--checkpoint.folder",
        str(root / "ckpt"),
    )


def _restart_every_group(root: Path, nproc: int, ckpt: tuple[str, ...]) -> None:
    """Both groups start again from step-RESUME_AT (r0, r1), a checkpoint the survivor wrote after
    the kill, and train RESTART_STEPS steps; the lighthouse waits for both."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=3000, heartbeat_timeout_ms=3000)
    resume = ("--checkpoint.load_step", str(RESUME_AT), "--training.steps", str(RESUME_AT + RESTART_STEPS))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        groups = [_launch(root / f"r{g}", nproc, g, lighthouse.address(), *ckpt, *resume) for g in (0, 1)]
        for g, proc in enumerate(groups):
            (root / f"r{g}.rc").write_text(str(_wait(proc, deadline)))
    finally:
        lighthouse.shutdown()


def _outputs(root: Path, name: str) -> Path:
    """Where the launch `name` (g0, g1a, g1b, r0, r1) wrote its metrics: its group's replica_<id>
    subfolder of the dump folder."""
    return root / name / f"replica_{0 if name in ('g0', 'r0') else 1}"


def _log(root: Path, name: str) -> str:
    return (root / f"{name}.log").read_text()[-4000:]


def test_the_killed_group_died_and_the_others_finished(killed: tuple[Path, int, int, bool]) -> None:
    root = killed[0]
    assert (root / "g1a.rc").read_text() != "0", _log(root, "g1a")
    assert (root / "g0.rc").read_text() == "0", _log(root, "g0")
    assert (root / "g1b.rc").read_text() == "0", _log(root, "g1b")


def test_the_survivor_loses_only_the_interrupted_step(killed: tuple[Path, int, int, bool]) -> None:
    root, discarded, _, diloco = killed
    rows = read_metrics(_outputs(root, "g0"))
    # A discarded step is retried under the same number; a discarded DiLoCo sync is not retried
    # (its inner steps are undone, the count goes on): either way every step is logged once.
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # Between steps, the survivor's next quorum leaves the dead group out before any all-reduce.
    assert rows[-1]["ft_discarded"] == discarded, _log(root, "g0")
    assert (rows[-1]["ft_lost_s"] > 0) == (discarded > 0)
    if diloco:
        # The discarded sync undid steps 1..KILL_AT; the join (step 0) and every later sync committed.
        assert rows[-1]["ft_inner_steps_lost"] == KILL_AT
        assert rows[-1]["ft_syncs"] == 1 + STEPS // SYNC_STEPS - discarded
    else:
        # The step after the kill waits out the lighthouse's heartbeat timeout (3 s) in its quorum
        # (under DiLoCo the next quorum comes SYNC_STEPS paced steps later, after that timeout).
        assert max(r["ft_quorum_s"] for r in rows) >= 2.5
    assert any(r["ft_participants"] == 1 for r in rows), "the survivor never trained alone"
    assert rows[-1]["ft_participants"] == 2, "the restarted group never rejoined"
    assert_loss_falls(rows)


def test_the_restarted_group_heals_at_the_survivors_step(killed: tuple[Path, int, int, bool]) -> None:
    rows = read_metrics(_outputs(killed[0], "g1b"))
    assert rows[0]["step"] > KILL_AT, "the restarted group started over instead of healing"
    if killed[3]:  # it joined at one of the survivor's syncs and trained on from the step after
        assert (rows[0]["step"] - 1) % SYNC_STEPS == 0
    assert rows[-1]["step"] == STEPS
    assert rows[-1]["ft_heals"] == 1
    assert rows[-1]["ft_heal_s"] < 30


def test_both_groups_hold_identical_weights(killed: tuple[Path, int, int, bool]) -> None:
    for rank in range(killed[2]):
        survivor = json.loads((killed[0] / "g0" / f"rank{rank}.json").read_text())
        healed = json.loads((killed[0] / "g1b" / f"rank{rank}.json").read_text())
        assert survivor["step"] == healed["step"] == STEPS
        assert survivor["shards"] == healed["shards"], f"rank {rank}'s shards differ after healing"
        # The healed group took the survivor's counters and data position: both read their shares
        # of the same steps of the global order, to the end.
        assert survivor["tokens_seen"] == healed["tokens_seen"]
        assert survivor["data_position"] == healed["data_position"]


def _checkpointed(killed: tuple[Path, int, int, bool]) -> Path:
    root = killed[0]
    if not root.name.startswith(f"ft_{CHECKPOINTED}"):
        pytest.skip(f"checkpoints are saved in the {CHECKPOINTED} scenario only")
    return root


def test_every_checkpoint_written_around_the_kill_is_complete(killed: tuple[Path, int, int, bool]) -> None:
    """One group wrote each shared step-N (the quorum's first); every group its own files at the
    steps it trained; no save was left half-written, by the killed group or the healed one."""
    from torchtitan_amp.checkpoint import inspect_checkpoint, verify_checksums

    ckpt = _checkpointed(killed) / "ckpt"
    saved = list(range(CKPT_EVERY, STEPS + 1, CKPT_EVERY)) + [RESUME_AT + RESTART_STEPS]
    for step in saved:
        info = inspect_checkpoint(ckpt / f"step-{step}")
        assert info.kind == "full" and info.meta["replica_group"] in (0, 1)
        assert verify_checksums(info.path, info.meta) is None
    own = {g: sorted(int(p.name.removeprefix("step-")) for p in (ckpt / f"ft-replica-{g}").iterdir()) for g in (0, 1)}
    assert own[0] == sorted(saved)
    # Group 1 saved before it was killed, then from its heal on (the steps between depend on its restart).
    assert CKPT_EVERY in own[1] and STEPS in own[1] and RESUME_AT + RESTART_STEPS in own[1]
    for g, steps in own.items():
        for step in steps:
            assert inspect_checkpoint(ckpt / f"ft-replica-{g}" / f"step-{step}").kind == "replica"
    assert not list(ckpt.rglob("*.tmp")), "a save was left half-written"


def test_a_full_restart_resumes_every_group_where_it_was(killed: tuple[Path, int, int, bool]) -> None:
    """Both groups restarted from step-RESUME_AT, written after the kill: the survivor's first step
    after it is the one it took then, bit for bit (same weights, same data); the groups train in
    step and end identical."""
    root = _checkpointed(killed)
    assert (root / "r0.rc").read_text() == "0", _log(root, "r0")
    assert (root / "r1.rc").read_text() == "0", _log(root, "r1")
    resumed = list(range(RESUME_AT + 1, RESUME_AT + RESTART_STEPS + 1))
    rows = {g: read_metrics(_outputs(root, f"r{g}")) for g in (0, 1)}
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == resumed
    before = {r["step"]: r["loss"] for r in read_metrics(_outputs(root, "g0"))}
    assert rows[0][0]["loss"] == before[RESUME_AT + 1]
    assert rows[1][-1]["ft_participants"] == 2 and rows[1][-1]["ft_heals"] == 0
    for rank in range(killed[2]):
        r0, r1 = (json.loads((root / f"r{g}" / f"rank{rank}.json").read_text()) for g in (0, 1))
        assert r0["shards"] == r1["shards"] and r0["data_position"] == r1["data_position"]


def test_precision_report_states_the_cross_group_dtype(killed: tuple[Path, int, int, bool]) -> None:
    report = json.loads((_outputs(killed[0], "g0") / "precision_report.json").read_text())
    ft = report["fault_tolerance"]
    assert ft["replica_groups"] == 2
    if not killed[3]:
        assert ft["cross_group_allreduce_dtypes"] == sorted({g["reduce_dtype"] for g in report["param_groups"]})
        return
    # DiLoCo: the bf16 pseudo-gradient of this rank's shard of every trained parameter, once per sync.
    assert ft["cross_group_allreduce_dtypes"] == ["bfloat16"] and ft["global_weights_dtype"] == "float32"
    trained = sum(g["num_params"] for g in report["param_groups"] if g["trained"])
    assert ft["bytes_per_sync"]["group"] == 2 * trained
    # Rank 0 of FSDP 2 holds the larger half of each dim-0 split.
    assert trained <= ft["bytes_per_sync"]["this_rank"] < ft["bytes_per_sync"]["group"]


def test_slurm_script_starts_the_lighthouse_and_a_group_per_node(tmp_path: Path) -> None:
    """scripts/fault_tolerance.slurm on one node with srun stubbed (it drops its options and runs
    the task, as slurmstepd would): the lighthouse comes up on the first node and the node's
    replica group trains against it, in its own dump folder."""
    import os
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (
        ("scontrol", "echo node1\n"),
        ("hostname", "echo 127.0.0.1\n"),
        ("srun", 'while [[ $# -gt 0 && $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\nexec "$@"\n'),
    ):
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    dump = tmp_path / "ft"
    env = {
        **ONE_THREAD,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4243",
        "GPUS_PER_NODE": "2",
        "LIGHTHOUSE_PORT": str(_free_port()),
        "FT_PROCESS_GROUP": "gloo",
        "DUMP_FOLDER": str(dump),
        "CONFIG_FILE": "train_configs/debug_model.toml",
    }
    result = run_command(
        ["bash", str(REPO / "scripts" / "fault_tolerance.slurm"), *TINY, "--training.steps", "3"], timeout=180, env=env
    )
    assert result.returncode == 0, result.describe()
    assert "lighthouse listening on" in result.output
    rows = read_metrics(dump / "replica_0")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["ft_participants"] == 1
