"""Resuming on another layout (docs/checkpointing.md): a checkpoint continues on another
data-parallel degree with exactly the windows the straight run would have used next, and in fp32
with losses equal to the straight run's up to reduction order (FSDP 4 -> FSDP 2, FSDP 2 -> one
process, DDP 2 -> FSDP 2 x TP 2, PP 2 -> FSDP 2), the validation position too; at the same degree
(FSDP 3, uneven shards of the tiny model) bit for bit.

Five launches (tests/workers/ckpt_jobs.py, several jobs each): straight runs record every rank's
input rows (a digest per row), the resumed runs continue from their step-2 checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import by_step, launch_worker
from torchtitan_amp.data import build_dataloader
from torchtitan_amp.data.prepare import PrepareConfig, prepare
from torchtitan_amp.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.dist

STEPS, RESUME_FROM, GLOBAL = 4, 2, 8
BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    str(STEPS),
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--checkpoint.enable",
    "--checkpoint.interval",
    str(RESUME_FROM),
    "--mixed_precision.enabled",
    "false",
]
FSDP = "--parallelism.data_parallel_shard_degree"
LAYOUTS = {  # name: (processes, data-parallel degree, arguments)
    "fsdp4": (4, 4, [FSDP, "4"]),
    "fsdp3": (3, 3, [FSDP, "3"]),
    "fsdp2": (2, 2, [FSDP, "2"]),
    "ddp2": (2, 2, ["--parallelism.data_parallel_replicate_degree", "2", FSDP, "1"]),
    "fsdp2_tp2": (4, 2, [FSDP, "2", "--parallelism.tensor_parallel_degree", "2"]),
    "single": (1, 1, []),
    "pp2": (2, 1, ["--parallelism.pipeline_parallel_degree", "2"]),
}
# fp32, same windows per step, another reduction order (and, for TP, another matmul split).
LOSS_RTOL = 1e-6


def _tokens_dataset(root: Path) -> str:
    """A prepared tokens: folder whose window count is not a multiple of 4 or 8, with global batch
    3 (samples 16..23) straddling the end of epoch 0: the resumed runs' first step."""
    (root / "words").mkdir(parents=True)
    (root / "words" / "a.txt").write_text(" ".join(f"w{i:05d}" for i in range(110)))
    prepare(PrepareConfig(inputs=[str(root / "words")], output=root / "tok", progress=False))
    dataset = f"tokens:{root / 'tok'}"
    windows = build_dataloader(dataset, ByteTokenizer(), 32, 1, 0, 1, 0).num_windows_per_epoch
    assert 16 < windows < 24 and windows % 4, windows
    return dataset


def _validated(name: str) -> list[str]:
    """Validation every 2 steps, each evaluation continuing through the split (steps = 1) with a
    global batch of 4 sequences whatever the data-parallel degree: its position must carry over."""
    dp = LAYOUTS[name.split(":")[0]][1]
    return [
        "--validation.enable",
        "--validation.freq",
        "2",
        "--validation.steps",
        "1",
        "--validation.local_batch_size",
        str(4 // dp),
    ]


def _job(
    name: str,
    root: Path,
    dataset: str,
    *,
    workers: int = 0,
    resume_from: str | None = None,
    global_batch: int = GLOBAL,
    validate: bool = False,
) -> dict:
    args = [
        *BASE,
        *LAYOUTS[name.split(":")[0]][2],
        *(_validated(name) if validate else []),
        "--training.dataset",
        dataset,
        "--training.global_batch_size",
        str(global_batch),
        "--training.dataloader_num_workers",
        str(workers),
        "--job.dump_folder",
        str(root / name),
    ]
    job = {"args": args, "record_batches": str(root / f"{name}.rows.json")}
    if resume_from is not None:
        src = root / resume_from / "checkpoint" / f"step-{RESUME_FROM}"
        job["copy"] = [[str(src), str(root / name / "checkpoint" / f"step-{RESUME_FROM}")]]
    return job


def _steps(root: Path, name: str, first_step: int, global_batch: int = GLOBAL) -> dict[int, list[str]]:
    """Step -> the windows (row digests, sorted) the data-parallel ranks trained on in it. A list, not
    a set: a step that straddles two epochs may hold one window twice."""
    per_dp_rank = dict(json.loads((root / f"{name}.rows.json").read_text()))  # TP ranks share one
    rows_per_rank = global_batch // LAYOUTS[name.split(":")[0]][1]
    out: dict[int, list[str]] = {}
    for rows in per_dp_rank.values():
        for i in range(0, len(rows), rows_per_rank):
            out.setdefault(first_step + i // rows_per_rank, []).extend(rows[i : i + rows_per_rank])
    return {step: sorted(rows) for step, rows in out.items()}


@pytest.fixture(scope="module")
def elastic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    tokens = _tokens_dataset(root)
    launch_worker(
        "ckpt_jobs",
        root,
        [_job("ddp2", root, tokens), _job("fsdp2", root, "pydoc", validate=True), _job("pp2", root, tokens)],
        2,
    )
    launch_worker(
        "ckpt_jobs",
        root,
        [
            _job("fsdp4", root, tokens, workers=2),
            _job("fsdp2_tp2:from_ddp2", root, tokens, workers=2, resume_from="ddp2"),
        ],
        4,
    )
    out = launch_worker(
        "ckpt_jobs",
        root,
        [
            _job("fsdp2:from_fsdp4", root, tokens, resume_from="fsdp4"),
            _job("fsdp2:from_pp2", root, tokens, resume_from="pp2"),
        ],
        2,
    )
    (root / "from_fsdp4.log").write_text(out.output)
    launch_worker("ckpt_jobs", root, [_job("single:from_fsdp2", root, "pydoc", resume_from="fsdp2", validate=True)], 1)
    launch_worker(
        "ckpt_jobs",
        root,
        [
            _job("fsdp3", root, "pydoc", global_batch=6),
            _job("fsdp3:again", root, "pydoc", global_batch=6, resume_from="fsdp3"),
        ],
        3,
    )
    return root


@pytest.mark.parametrize(
    ("resumed", "straight"),
    [
        ("fsdp2:from_fsdp4", "fsdp4"),
        ("single:from_fsdp2", "fsdp2"),
        ("fsdp2_tp2:from_ddp2", "ddp2"),
        ("fsdp2:from_pp2", "pp2"),
    ],
)
def test_resume_on_another_layout_continues_the_straight_runs_windows(
    elastic: Path, resumed: str, straight: str
) -> None:
    want, got = _steps(elastic, straight, 1), _steps(elastic, resumed, RESUME_FROM + 1)
    assert sorted(want) == list(range(1, STEPS + 1)) and all(len(w) == GLOBAL for w in want.values())
    assert got == {s: want[s] for s in range(RESUME_FROM + 1, STEPS + 1)}
    a, b = by_step(elastic / straight), by_step(elastic / resumed)
    assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1))
    for step in b:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=LOSS_RTOL, abs=0), step
        assert b[step]["lr"] == a[step]["lr"]
        if LAYOUTS[resumed.split(":")[0]][1] == LAYOUTS[straight][1]:
            # The logged epoch is rank 0's loader's: where a global batch straddles two epochs, a rank
            # of another dp degree may not have reached the second yet (same windows, see above).
            assert b[step]["epoch"] == a[step]["epoch"]


def test_validation_position_carries_over_to_another_degree(elastic: Path) -> None:
    """FSDP 2 evaluates at steps 2 and 4, each reading the next validation batch; resumed on one
    process from step 2, the step-4 evaluation reads the same (second) batch: the same val_loss up
    to reduction order. Re-reading the first batch would give the step-2 value instead."""
    a, b = by_step(elastic / "fsdp2"), by_step(elastic / "single:from_fsdp2")
    assert b[4]["val_loss"] == pytest.approx(a[4]["val_loss"], rel=LOSS_RTOL, abs=0)
    assert b[4]["val_tokens"] == a[4]["val_tokens"] == 4 * 32
    assert abs(a[4]["val_loss"] - a[2]["val_loss"]) > 100 * LOSS_RTOL * a[2]["val_loss"]  # another batch


def test_rng_not_carried_across_world_sizes_is_said_once(elastic: Path) -> None:
    # The data note is an info line (tests/test_data.py checks its text; the workers log warnings only).
    log = (elastic / "from_fsdp4.log").read_text()
    assert log.count("RNG states not restored") == 1 and "saved by 4 ranks, this run has 2" in log


def test_uneven_fsdp3_resumes_bit_for_bit(elastic: Path) -> None:
    a, b = by_step(elastic / "fsdp3"), by_step(elastic / "fsdp3:again")
    assert sorted(b) == list(range(RESUME_FROM + 1, STEPS + 1))
    for step in b:
        for key in ("loss", "grad_norm", "lr", "epoch"):
            assert b[step][key] == a[step][key], (step, key)
    want, got = _steps(elastic, "fsdp3", 1, 6), _steps(elastic, "fsdp3:again", RESUME_FROM + 1, 6)
    assert got == {s: want[s] for s in range(RESUME_FROM + 1, STEPS + 1)}
