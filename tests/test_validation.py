"""Validation: the loss on a validation split under the run's precision plan and layout.

- The same weights (a seed checkpoint) give the same val_loss on every layout (fp32, 1e-6
  relative): single, DDP 2, FSDP 2, TP 2 (loss parallel), PP 2 (the schedule's eval mode),
  FSDP 2 x TP 2, CP 2 and CP 2 x FSDP 2 (windows split over the cp ranks). Each layout evaluates the
  same windows: validation.local_batch_size is the global evaluation batch over the data-parallel
  degree, for validation.steps batches.
- bf16 val_loss is within the precision tolerance of fp32 (and not equal: bf16 ran).
- Evaluating changes nothing in training: gradients right after an evaluation equal those without
  one (the autocast-cache trap of pytorch#65766), losses with and without validation are equal
  bit for bit, and a resume restores the validation position (steps != -1) bit for bit.
- tools/evaluate.py on an FSDP 2 checkpoint, run on one process, equals the in-run value.
- validation.sample_prompts: the same greedy continuations on one process, DDP 2, FSDP 2,
  TP 2 (sequence parallel: padded decode steps; loss parallel: vocab-sharded logits) and FSDP 2 x
  TP 2; during FSDP training every evaluation writes them to the log and samples.jsonl, and
  training stays bit for bit that of a run without validation.
- Bad input is one line, exit 2, before any process group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.support.launch import by_step, launch_worker, run_python
from tests.support.tolerances import STEP1_MIN, STEP1_TOL
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import DataError
from torchtitan_amp.tools.evaluate import evaluate
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.dist

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--training.gc_freq",
    "0",
]
FP32 = ["--mixed_precision.enabled", "false"]
BF16 = ["--mixed_precision.enabled", "true"]  # bf16 on every CPU kind: these are bf16's proofs
# Every layout evaluates VAL_BATCH windows per batch over all data-parallel ranks, VAL_STEPS times.
VAL_BATCH, VAL_STEPS = 4, 3
SHARD, REPLICATE = "--parallelism.data_parallel_shard_degree", "--parallelism.data_parallel_replicate_degree"
TP, PP = "--parallelism.tensor_parallel_degree", "--parallelism.pipeline_parallel_degree"
CP = "--parallelism.context_parallel_degree"
# name: (processes, data-parallel degree, overrides)
LAYOUTS = {
    "single": (1, 1, []),
    "ddp": (2, 2, [REPLICATE, "2", SHARD, "1"]),
    "fsdp": (2, 2, [SHARD, "2"]),
    "tp": (2, 1, [TP, "2", SHARD, "1"]),
    "pp": (2, 1, [PP, "2", SHARD, "1"]),
    "fsdp_tp": (4, 2, [SHARD, "2", TP, "2"]),
    # Context parallel: every evaluation window split over the cp ranks (head-tail chunks), which
    # add no data-parallel rank: cp 2 evaluates a dp-1 batch of VAL_BATCH windows.
    "cp": (2, 1, [CP, "2", SHARD, "1"]),
    "cp_fsdp": (4, 2, [CP, "2", SHARD, "2"]),
}
# The fsdp training job A: evaluations at steps 2 and 4, each VAL_STEPS batches continuing through
# the split, a checkpoint at step 2.
TRAIN_STEPS, VAL_FREQ = 4, 2
# Same weights and windows, different reduction order across layouts: fp32 rounding only.
LAYOUT_RTOL = 1e-6
# Greedy continuations of two prompts at every evaluation (8 tokens: cheap on every layout).
SAMPLE_PROMPTS = ("The cat", "def f")
SAMPLES = ["--validation.sample_prompts", ",".join(SAMPLE_PROMPTS), "--validation.sample_max_new_tokens", "8"]
SAMPLED_LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    """In-process Trainers: skip MFU's matmul benchmark (the workers skip it too)."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def val_args(layout: str) -> list[str]:
    dp = LAYOUTS[layout][1]
    return [
        "--validation.enable",
        "true",
        "--validation.steps",
        str(VAL_STEPS),
        "--validation.local_batch_size",
        str(VAL_BATCH // dp),
        *LAYOUTS[layout][2],
    ]


def eval_args(layout: str, precision: list[str], weights: Path, dump: Path) -> list[str]:
    samples = SAMPLES if layout in ("single", *SAMPLED_LAYOUTS) and precision == FP32 else []
    return [
        *BASE,
        *precision,
        *val_args(layout),
        *samples,
        "--checkpoint.initial_load_path",
        str(weights),
        "--job.dump_folder",
        str(dump),
    ]


def train_args(dump: Path, *extra: str, validation: bool = True) -> list[str]:
    val = [*val_args("fsdp"), "--validation.freq", str(VAL_FREQ), *SAMPLES] if validation else LAYOUTS["fsdp"][2]
    return [
        *BASE,
        *FP32,
        *val,
        "--training.steps",
        str(TRAIN_STEPS),
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


# ---------------------------------------------------------------------------------------------
# In-process: config and data errors, the autocast-cache trap, bitwise training


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--validation.freq", "0"], "'validation.freq' must be >= 1, got 0"),
        (["--validation.steps", "0"], "'validation.steps' must be -1 (the whole split) or >= 1, got 0"),
        (
            ["--validation.local_batch_size", "-1"],
            "'validation.local_batch_size' must be 0 (training's) or >= 1, got -1",
        ),
        (["--validation.seq_len", "1"], "'validation.seq_len' must be 0 (training's) or >= 2, got 1"),
    ],
)
def test_bad_validation_field_is_a_config_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config([*BASE, "--validation.enable", "true", *overrides])
    assert message in str(e.value)


def test_layout_checks_of_validation() -> None:
    longer = load_config([*BASE, "--validation.enable", "true", "--validation.seq_len", "64"])
    with pytest.raises(ConfigError, match="'validation.seq_len' = 64 exceeds training.seq_len = 32"):
        job_mod.resolve(longer, 1, "cpu")
    # PP: 2 microbatches of 1 (training.local_batch_size 2); an evaluation batch of 3 cannot split.
    pp = load_config([*BASE, "--validation.enable", "true", "--validation.local_batch_size", "3", PP, "2", SHARD, "1"])
    with pytest.raises(ConfigError, match="'validation.local_batch_size' = 3 must be a multiple of the pipeline's 2"):
        job_mod.resolve(pp, 2, "cpu")
    assert job_mod.resolve(load_config(BASE), 1, "cpu").validation is None
    # CP: an evaluation window is cut into 2 x cp chunks like a training one (30 is not 4 x 7.5).
    cp = load_config([*BASE, "--validation.enable", "true", "--validation.seq_len", "30", CP, "2", SHARD, "1"])
    with pytest.raises(
        ConfigError,
        match=r"^'validation.seq_len' = 30 must be divisible by 2 x "
        r"context_parallel_degree = 4 \(each cp rank holds two",
    ):
        job_mod.resolve(cp, 2, "cpu")
    assert (
        job_mod.resolve(
            load_config([*BASE, "--validation.enable", "true", "--validation.seq_len", "28", CP, "2", SHARD, "1"]),
            2,
            "cpu",
        ).validation.seq_len
        == 28
    )


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["missing", "empty_dir", "shorter_than_a_window", "shorter_than_a_batch"])
def test_bad_validation_dataset_is_a_data_error_before_any_process_group(case: str, tmp_path: Path) -> None:
    dataset, message = {
        "missing": (tmp_path / "nope", "does not exist"),
        "empty_dir": ((tmp_path / "empty").mkdir() or tmp_path / "empty", "has no .txt, .md or .jsonl files"),
        "shorter_than_a_window": (_write(tmp_path / "short.txt", "tiny"), "needs at least"),
        # 5 windows of 33 tokens (bytes), fewer than a batch of 8.
        "shorter_than_a_batch": (
            _write(tmp_path / "five.txt", "x" * 170),
            "has 5 windows of seq_len 32 + 1 tokens per data-parallel rank",
        ),
    }[case]
    args = [
        *BASE,
        "--validation.enable",
        "true",
        "--validation.dataset",
        f"path:{dataset}",
        "--validation.local_batch_size",
        "8",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    with pytest.raises(DataError) as e:
        trainer_module.Trainer(load_config(args))
    assert str(e.value).startswith(f"'validation.dataset' = 'path:{dataset}'") and message in str(e.value)
    assert not torch.distributed.is_initialized()


def test_gradients_after_an_evaluation_equal_those_without_one(tmp_path: Path) -> None:
    """pytorch#65766: weights cast under no_grad inside an autocast region and reused by a later
    grad-enabled forward of the same region get no gradients. Each evaluation forward runs in an
    outermost region of its own, so the train step right after an evaluation must produce exactly
    the gradients of a train step without one; and every module is back in train mode."""
    args = [*BASE, *BF16, "--validation.enable", "true", "--validation.steps", "2"]
    runs = {}
    for name, evaluate_first in (("with_eval", True), ("without_eval", False)):
        t = trainer_module.Trainer(load_config([*args, "--job.dump_folder", str(tmp_path / name)]))
        assert t.run.plan.path == "autocast"
        with torch.random.fork_rng(devices=[]):
            batch = next(iter(t.run.dataloader))
        if evaluate_first:
            assert math.isfinite(t.run.validator.run()["val_loss"])
            assert all(m.training for m in t.run.model.modules())
        loss, grad_norm, _ = t.train_step(iter([batch]))
        runs[name] = (float(loss), float(grad_norm), {n: p.grad.clone() for n, p in t.run.model.named_parameters()})
        t.run.metrics.close()
    (loss_a, norm_a, grads_a), (loss_b, norm_b, grads_b) = runs["with_eval"], runs["without_eval"]
    assert (loss_a, norm_a) == (loss_b, norm_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # Every weight got a gradient, including the Linear weights autocast casts to bf16.
    assert all(g.abs().sum() > 0 for n, g in grads_a.items() if n.endswith("weight"))


def test_training_is_bitwise_equal_with_and_without_validation_single(tmp_path: Path) -> None:
    steps = ["--training.steps", "4"]
    for name, extra in (
        ("with", ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]),
        ("without", []),
    ):
        t = trainer_module.Trainer(
            load_config([*BASE, *BF16, *steps, *extra, "--job.dump_folder", str(tmp_path / name)])
        )
        t.train()
    with_val, without = by_step(tmp_path / "with"), by_step(tmp_path / "without")
    assert sorted(with_val) == sorted(without) == [1, 2, 3, 4]
    assert [k for k in with_val[2] if k.startswith("val_")] == ["val_loss", "val_ppl", "val_tokens", "val_time_s"]
    assert "val_loss" not in with_val[1] and "val_loss" in with_val[4]
    for step in with_val:
        assert (with_val[step]["loss"], with_val[step]["grad_norm"]) == (
            without[step]["loss"],
            without[step]["grad_norm"],
        )


# ---------------------------------------------------------------------------------------------
# Every layout, one seed: three launches shared by the tests below


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """name -> evaluate() result: '<layout>_fp32' / '<layout>_bf16' of the seed checkpoint, 'ckpt_on_1'
    of training job A's step-2 checkpoint on one process; plus the training dump folders."""
    import torchtitan_amp.train.build as train_build
    import torchtitan_amp.train.trainer as tm

    root = tmp_path_factory.mktemp("validation")
    train_build.peak_flops = lambda device, dtype: 1e12  # module scope: the autouse patch is per test
    seed_dump = root / "seed"
    tm.Trainer(
        load_config(
            [
                *BASE,
                *FP32,
                "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint",
                "--job.dump_folder",
                str(seed_dump),
            ]
        )
    ).train()
    seed = seed_dump / "checkpoint" / "step-0"
    out: dict[str, dict] = {"dumps": {k: str(root / k) for k in "abc"}}
    a, b, c = (root / k for k in "abc")
    two = [
        {
            "evaluate": str(root / f"{layout}_fp32.json"),
            "args": eval_args(layout, FP32, seed, root / f"e_{layout}_fp32"),
        }
        for layout in ("ddp", "fsdp", "tp", "pp", "cp")
    ]
    two.append({"evaluate": str(root / "fsdp_bf16.json"), "args": eval_args("fsdp", BF16, seed, root / "e_fsdp_bf16")})
    two += [
        {"args": train_args(a)},
        {"args": train_args(c, validation=False)},
        {"args": train_args(b), "copy": [[str(a / "checkpoint" / "step-2"), str(b / "checkpoint" / "step-2")]]},
    ]
    launch_worker("ckpt_jobs", root / "launch2", two, 2, timeout=400)
    launch_worker(
        "ckpt_jobs",
        root / "launch4",
        [
            {"evaluate": str(root / f"{layout}_fp32.json"), "args": eval_args(layout, FP32, seed, root / f"e_{layout}")}
            for layout in ("fsdp_tp", "cp_fsdp")
        ],
        4,
    )
    for name in ("ddp_fp32", "fsdp_fp32", "tp_fp32", "pp_fp32", "cp_fp32", "fsdp_bf16", "fsdp_tp_fp32", "cp_fsdp_fp32"):
        out[name] = json.loads((root / f"{name}.json").read_text())
    for name, precision in (("single_fp32", FP32), ("single_bf16", BF16)):
        out[name] = evaluate(eval_args("single", precision, seed, root / f"e_{name}"))
    out["ckpt_on_1"] = evaluate(
        [
            *BASE,
            *FP32,
            *val_args("single"),
            "--checkpoint.folder",
            str(a / "checkpoint"),
            "--checkpoint.load_step",
            "2",
            "--job.dump_folder",
            str(root / "e_ckpt"),
        ]
    )
    return out


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp", "pp", "fsdp_tp", "cp", "cp_fsdp"])
def test_same_weights_same_val_loss_on_every_layout(evaluated: dict, layout: str) -> None:
    ref, got = evaluated["single_fp32"], evaluated[f"{layout}_fp32"]
    print(
        f"\n[val_loss] {layout}: {got['val_loss']!r} vs single {ref['val_loss']!r}, "
        f"rel {abs(got['val_loss'] - ref['val_loss']) / ref['val_loss']:.1e}"
    )
    assert got["val_tokens"] == ref["val_tokens"] == VAL_BATCH * VAL_STEPS * 32
    assert got["step"] == 0 and got["world_size"] == LAYOUTS[layout][0]
    assert abs(got["val_loss"] - ref["val_loss"]) <= LAYOUT_RTOL * ref["val_loss"], (got, ref)
    assert got["val_ppl"] == pytest.approx(math.exp(got["val_loss"]))


@pytest.mark.parametrize("layout", ["single", "fsdp"])
def test_bf16_val_loss_within_precision_tolerance_of_fp32(evaluated: dict, layout: str) -> None:
    bf16, fp32 = evaluated[f"{layout}_bf16"], evaluated["single_fp32"]
    assert bf16["precision_path"] == ("autocast" if layout == "single" else "fsdp")
    assert STEP1_MIN < abs(bf16["val_loss"] - fp32["val_loss"]) < STEP1_TOL, (bf16, fp32)


def test_fsdp_training_is_bitwise_equal_with_and_without_validation(evaluated: dict) -> None:
    a, c = by_step(Path(evaluated["dumps"]["a"])), by_step(Path(evaluated["dumps"]["c"]))
    assert sorted(a) == sorted(c) == list(range(1, TRAIN_STEPS + 1))
    assert [s for s in a if "val_loss" in a[s]] == [2, 4] and not any("val_loss" in r for r in c.values())
    for step in a:
        assert (a[step]["loss"], a[step]["grad_norm"]) == (c[step]["loss"], c[step]["grad_norm"]), step


@pytest.mark.parametrize("layout", SAMPLED_LAYOUTS)
def test_sample_prompts_give_the_same_tokens_on_every_layout(evaluated: dict, layout: str) -> None:
    ref, got = evaluated["single_fp32"]["samples"], evaluated[f"{layout}_fp32"]["samples"]
    assert [s["prompt"] for s in ref] == list(SAMPLE_PROMPTS)
    assert all(len(s["tokens"]) == 8 or s["stop"] == "eos" for s in ref)
    assert got == ref


def test_sample_prompts_during_training_go_to_samples_jsonl(evaluated: dict) -> None:
    """FSDP 2 job A: both prompts at each evaluation (steps 2 and 4), written once (rank 0; the
    same MetricsLogger.log_samples call logs them, tests/test_generation.py); its training
    is bit for bit that of job C without validation (test above). Job B, resumed from A's step 2
    with the same weights at step 4, continues the prompts with the same tokens."""
    rows = [json.loads(line) for line in (Path(evaluated["dumps"]["a"]) / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (2, 4) for p in SAMPLE_PROMPTS]
    assert all(r["stop"] in ("eos", "length") and 1 <= len(r["tokens"]) <= 8 for r in rows)
    resumed = [json.loads(line) for line in (Path(evaluated["dumps"]["b"]) / "samples.jsonl").read_text().splitlines()]
    assert [r for r in resumed if r["step"] == 4] == rows[2:]
    assert not (Path(evaluated["dumps"]["c"]) / "samples.jsonl").exists()


def test_resume_restores_the_validation_position(evaluated: dict) -> None:
    """Job B resumed from A's step-2 checkpoint: its step-4 evaluation continues where A's step-2
    one stopped (validation.steps != -1), so it equals A's bit for bit; restarting the split would
    evaluate other windows."""
    a, b = by_step(Path(evaluated["dumps"]["a"])), by_step(Path(evaluated["dumps"]["b"]))
    for step in (3, 4):
        assert (b[step]["loss"], b[step]["grad_norm"]) == (a[step]["loss"], a[step]["grad_norm"]), step
    assert b[4]["val_loss"] == a[4]["val_loss"] and b[4]["val_tokens"] == a[4]["val_tokens"]
    assert a[4]["val_loss"] != a[2]["val_loss"]


def test_evaluating_an_fsdp_checkpoint_on_one_process_equals_the_in_run_value(evaluated: dict) -> None:
    in_run = by_step(Path(evaluated["dumps"]["a"]))[2]
    got = evaluated["ckpt_on_1"]
    assert got["step"] == 2 and got["world_size"] == 1 and got["checkpoint"].endswith("step-2")
    assert got["val_tokens"] == in_run["val_tokens"]
    assert abs(got["val_loss"] - in_run["val_loss"]) <= LAYOUT_RTOL * in_run["val_loss"], (got, in_run)


def test_evaluate_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    r = run_python(
        "-m",
        "torchtitan_amp.tools.evaluate",
        "--output",
        str(tmp_path / "e.json"),
        *BASE,
        "--checkpoint.folder",
        str(tmp_path / "none"),
        "--job.dump_folder",
        str(tmp_path / "run"),
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.describe()
    assert f"no checkpoint to evaluate in {tmp_path / 'none'}" in errors[0]
    assert not (tmp_path / "e.json").exists() and not (tmp_path / "run").exists()


def test_held_out_split_from_the_prepare_step(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The prepare step meets validation: `prepare --validation-fraction` writes a held-out split that
    `validation.dataset = "tokens:<folder>:validation"` evaluates, next to `tokens:<folder>` training."""
    from torchtitan_amp.data.prepare import PrepareConfig, prepare

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (5 + i % 7)}) + "\n"
            for i in range(120)
        )
    )
    out = tmp_path / "tokens"
    prepare(PrepareConfig(inputs=[str(corpus)], output=out, progress=False, validation_fraction=0.25, split_seed=3))
    args = [
        *BASE,
        *FP32,
        "--training.dataset",
        f"tokens:{out}",
        "--training.steps",
        "2",
        "--validation.enable",
        "true",
        "--validation.dataset",
        f"tokens:{out}:validation",
        "--validation.freq",
        "2",
        "--validation.steps",
        "-1",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    with caplog.at_level("WARNING", logger="torchtitan_amp"):
        t = trainer_module.Trainer(load_config(args))
        t.train()
    assert not any("evaluating on the training data" in r.message for r in caplog.records)
    record = by_step(tmp_path / "run")[2]
    held_windows = t.run.validator.loader.num_windows_per_epoch
    assert record["val_tokens"] == held_windows // 2 * 2 * 32 and math.isfinite(record["val_loss"])
