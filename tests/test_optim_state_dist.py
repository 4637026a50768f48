"""Optimizer-state precision on every layout: bf16 AdamW moments on single, DDP 2,
FSDP 2, TP 2 and PP 2; pure bf16 with stochastic rounding keeping replicas identical; bitwise
resume of both; a checkpoint saved with fp32 moments resumed with bf16 ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import by_step, launch_worker
from tests.support.tolerances import CURVE_TOL

pytestmark = [pytest.mark.dist, pytest.mark.slow]


# The smallest flavor: the subjects are state dtypes and bitwise resume, not size, and these runs
# are bf16, which costs tens of times fp32 where a CPU emulates it.
BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.gc_freq",
    "0",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--training.steps",
    "4",
]
MIXED = ["--mixed_precision.enabled", "true"]
BF16_STATE = ["--optimizer.state_dtype", "bfloat16"]
PURE_SR = ["--training.dtype", "bfloat16", "--mixed_precision.enabled", "false", "--optimizer.stochastic_rounding"]
LAYOUTS = {
    "ddp2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "fsdp2": ["--parallelism.data_parallel_shard_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp2": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ],
}


def _ranks(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("optim_state")
    jobs = [
        {"name": f"{name}_bf16state", "args": [*BASE, *MIXED, *BF16_STATE, *args]} for name, args in LAYOUTS.items()
    ]
    jobs += [{"name": f"{name}_fp32state", "args": [*BASE, *MIXED, *args]} for name, args in LAYOUTS.items()]
    jobs += [{"name": f"{name}_sr", "args": [*BASE, *PURE_SR, *LAYOUTS[name]]} for name in ("ddp2", "tp2")]
    launch_worker("layouts", out, jobs, 2, timeout=900)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_moments_on_every_layout(layouts: Path, layout: str) -> None:
    """Every rank holds its moments in bf16 (FSDP/TP: its shards), the report says so, and the
    loss follows the same layout's fp32-moment run (4 steps: the moments' rounding, relative
    2**-9 per step, moves the loss far less than the bf16 compute already does)."""
    folder = layouts / f"{layout}_bf16state"
    for info in _ranks(folder):
        assert info["optimizer_state_dtypes"] == ["bfloat16"], (layout, info["rank"])
    ref = _ranks(layouts / f"{layout}_fp32state")
    assert all(info["optimizer_state_dtypes"] == ["float32"] for info in ref)
    report = json.loads((folder / "precision_report.json").read_text())
    assert report["optimizer"]["state_dtype"] == "bfloat16"
    assert report["bytes_per_param"]["trained_total"] == 12  # fp32 weights + grads, bf16 moments
    # The report lists every gradient collective of the rank (the dry run's numbers, which
    # test_dry_run checks against real traffic): TP's one is the 9 norm weights (2 per block, 4
    # blocks, the final norm) of dim 64, fp32, once.
    collectives = {name: sorted(by_dtype) for name, by_dtype in report["gradient_collectives"].items()}
    assert (
        collectives
        == {
            "ddp2": {"ddp_all_reduce": ["float32"]},
            "fsdp2": {"fsdp_reduce_scatter": ["float32"]},
            "tp2": {"tp_partial_grad_all_reduce": ["float32"]},
            "pp2": {},
        }[layout]
    )
    if layout == "tp2":
        assert report["gradient_collectives"]["tp_partial_grad_all_reduce"] == {"float32": 9 * 64 * 4}
    got, want = by_step(folder), by_step(layouts / f"{layout}_fp32state")
    assert sorted(got) == [1, 2, 3, 4]
    assert got[1]["loss"] == want[1]["loss"]  # the moments enter from the first update on
    assert max(abs(got[s]["loss"] - want[s]["loss"]) for s in got) < CURVE_TOL


@pytest.mark.parametrize("layout", ["ddp2", "tp2"])
def test_stochastic_rounding_keeps_replicas_identical(layouts: Path, layout: str) -> None:
    """DDP replicas, and TP's replicated norm weights, round with the same random bits: their
    bf16 weights stay bit-identical after 4 stochastically rounded updates. And the rounding was
    stochastic: the report says so, and updates below half a bf16 ulp, which round-to-nearest
    gives back as the old weight, moved weights (Adam moves a weight by about lr <= 3e-3 per step,
    under half the ulp of the norm weights, which start at 1.0: 2**-8 = 3.9e-3)."""
    folder = layouts / f"{layout}_sr"
    report = json.loads((folder / "precision_report.json").read_text())
    assert report["optimizer"]["weight_rounding"] == "stochastic", report["optimizer"]
    a, b = _ranks(folder)
    assert a["replicated_params_digest"] == b["replicated_params_digest"]
    assert sorted(by_step(folder)) == [1, 2, 3, 4]
    for info in (a, b):
        rounding = info["rounding"]
        assert rounding is not None and rounding["sub_half_ulp"] > 0, (layout, info["rank"], rounding)
        # Stochastic rounding moves such an element with probability |update| / ulp: some moved.
        assert rounding["moved"] > 0, (layout, info["rank"], rounding)
        old, target, new = (rounding["example"][k] for k in ("old", "target", "new"))
        # new is old's bf16 neighbour (|new - old| = 1 ulp): the update was under half of it.
        assert new != old and abs(target - old) < abs(new - old) / 2, rounding["example"]


def test_resume_is_bitwise_and_crosses_state_dtypes(tmp_path: Path) -> None:
    """FSDP 2 with bf16 moments, and DDP 2 pure bf16 with stochastic rounding and fp32 moments,
    resume bit for bit; a checkpoint with fp32 moments resumes with bf16 ones, converted with a
    log line (torchtitan refuses this)."""
    fsdp = [*BASE, *MIXED, *LAYOUTS["fsdp2"], "--checkpoint.enable", "--checkpoint.interval", "2"]
    ddp_sr = [
        *BASE,
        *PURE_SR,
        "--optimizer.state_dtype",
        "float32",
        *LAYOUTS["ddp2"],
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
    ]
    f = {k: tmp_path / k for k in ("bf16", "bf16_resumed", "sr", "sr_resumed", "fp32", "crossed")}

    def resume(src: str, dst: str) -> list[list[str]]:
        return [[str(f[src] / "checkpoint" / "step-2"), str(f[dst] / "checkpoint" / "step-2")]]

    result = launch_worker(
        "ckpt_jobs",
        tmp_path / "launch",
        [
            {"args": [*fsdp, *BF16_STATE, "--job.dump_folder", str(f["bf16"])]},
            {
                "args": [*fsdp, *BF16_STATE, "--job.dump_folder", str(f["bf16_resumed"])],
                "copy": resume("bf16", "bf16_resumed"),
            },
            {"args": [*ddp_sr, "--job.dump_folder", str(f["sr"])]},
            {"args": [*ddp_sr, "--job.dump_folder", str(f["sr_resumed"])], "copy": resume("sr", "sr_resumed")},
            {"args": [*fsdp, "--job.dump_folder", str(f["fp32"])]},
            {"args": [*fsdp, *BF16_STATE, "--job.dump_folder", str(f["crossed"])], "copy": resume("fp32", "crossed")},
        ],
        2,
        timeout=600,
    )
    for run in ("bf16", "sr"):
        original, resumed = by_step(f[run]), by_step(f[f"{run}_resumed"])
        assert sorted(resumed) == [3, 4], run
        for step in (3, 4):
            assert (resumed[step]["loss"], resumed[step]["grad_norm"]) == (
                original[step]["loss"],
                original[step]["grad_norm"],
            ), (run, step)
    assert (
        "was saved in float32; this run keeps it in bfloat16 (optimizer.state_dtype): converted on load"
        in result.stdout + result.stderr
    )
    crossed, fp32 = by_step(f["crossed"]), by_step(f["fp32"])
    assert sorted(crossed) == [3, 4]
    # Step 3's gradient is the fp32 run's (same weights); the moments it meets are rounded.
    assert crossed[3]["loss"] == fp32[3]["loss"]
    assert abs(crossed[4]["loss"] - fp32[4]["loss"]) < CURVE_TOL
