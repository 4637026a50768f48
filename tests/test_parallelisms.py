"""The layouts' proofs: every parallel layout trains the same loss curve as one process.

Every layout below sees the same 4 sequences per step: a data-parallel degree D runs
local_batch_size 4 / D (the loader deals one per-epoch permutation round-robin, so the ranks' union
is the single process's batch of 4; test_data_parallel_ranks_share_the_single_process_batch checks
that). All start from the same seed-initialised weights, so each curve is compared step by step
with the single-process run (debugmodel_tiny: dim 64, 4 blocks, 2 heads; seq 32, 5 steps, lr 2e-2
after 2 warm-up steps: the loss falls from 5.94 to 3.53 and the gradient norm, 1.0-1.7, is clipped
at most steps). The subject here is the layouts' arithmetic, not the model's size: the tiny model
keeps every layout's split (TP 2 splits its 2 heads, Interleaved1F1B gets a block per stage) at a
fifteenth of debugmodel's bf16 step cost where bf16 is emulated (AVX2-only CPUs).

Launches are the cost (~5 s of start-up each on 2 cores), so tests/workers/layouts.py trains many
layouts one after another in one launch: one launch each of 1, 2 and 4 processes (plus
one for compile, and an opt-in 8-process one), shared by all tests through `trained`. Measured on
this 2-core CPU, torch 2.13 (docs/parallelisms.md has the table); each test prints what it
measured (pytest -s shows it):

- fp32 (mixed_precision.enabled = false): max relative loss difference over 5 steps <= 1.7e-7
  on every layout (1e-4 allowed by the issue), grad norm <= 4.4e-7 (reduction order only).
- bf16 mixed precision: within the precision tests' whole-curve tolerances of the fp32 curve
  (|delta| max 1.8e-3 < CURVE_TOL, |mean| 5.6e-4 < CURVE_MEAN_TOL over 5 steps); step 1 differs from
  fp32 by 2e-5..3.1e-4 (bf16 ran) and from the same path's single layout by <= 5e-7 (with TP
  6e-6..9.3e-5: TP rounds in other places, bounded by SPLIT_MATMUL_STEP1_SIGMAS in tests/support/tolerances.py).
  Native bf16 and AVX2 emulation measured the same step-1 values on this model.
- AC (full, selective 2, op) and compile: bit-identical losses to the same run without AC;
  compiled blocks under bf16 autocast match eager bf16 to 2.1e-4 relative.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.support.inputs import write_short_documents
from tests.support.launch import launch_worker
from tests.support.machine import NO_COMPILER, c_compiler
from tests.support.tolerances import (
    CLIP_RTOL,
    CURVE_MEAN_TOL,
    CURVE_TOL,
    GATHERED_RTOL,
    GRAD_NORM_STEP1_RTOL,
    NORM_RTOL,
    SAME_FAMILY_STEP1_TOL,
    SPLIT_MATMUL_STEP1_SIGMAS,
    STEP1_MIN,
    STEP1_TOL,
    assert_step_sync_budget,
)
from tests.support.tolerances import bf16_rounding_sigma as rounding_sigma

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 5
N_LAYERS = 4  # debugmodel_tiny's blocks
GLOBAL_BATCH = 4
BASE = (
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.steps",
    str(STEPS),
    "--optimizer.lr",
    "2e-2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--training.seed",
    "0",
)
PRECISIONS = {
    "fp32": ("--mixed_precision.enabled", "false"),
    "bf16": (
        "--mixed_precision.enabled",
        "true",
        "--mixed_precision.param_dtype",
        "bfloat16",
        "--mixed_precision.reduce_dtype",
        "float32",
    ),
    # Loss-scaled fp16 for the gradient norm check only (FP16_NORM_LAYOUTS). At a scale of 1024 no
    # step of this model overflows (test_fp16_runs_were_loss_scaled), so every step's clip is
    # checked on unscaled gradients; a norm taken before unscale_ would be 1024x off.
    "fp16": (
        "--mixed_precision.enabled",
        "true",
        "--mixed_precision.param_dtype",
        "float16",
        "--mixed_precision.init_scale",
        "1024",
    ),
}
# The layouts whose fp16 norm and clipping test_precision_dist's fp16 scenario does not cover
# (it runs single, DDP, FSDP and TP with sequence parallel).
FP16_NORM_LAYOUTS = ("tp2_no_sp_no_loss_parallel", "pp2_1f1b", "fsdp2_tp2")

# The bound for fp32 layouts (relative, loss and grad norm, every step).
FP32_REL_TOL = 1e-4
# AC recomputes with the same kernels: measured bit-identical.
AC_REL_TOL = 1e-6
# Compiled vs eager blocks under bf16 autocast, 3 steps: measured 1.5e-4 natively, 2.1e-4 under
# AVX2 emulation (inductor fuses and rounds differently); an fp32 compiled run measured
# bit-identical to eager.
COMPILE_REL_TOL = 5e-4

SHARD = "--parallelism.data_parallel_shard_degree"
REPLICATE = "--parallelism.data_parallel_replicate_degree"
TP = "--parallelism.tensor_parallel_degree"
PP = "--parallelism.pipeline_parallel_degree"
SCHEDULE = "--parallelism.pipeline_parallel_schedule"


@dataclass(frozen=True)
class Layout:
    nproc: int
    overrides: tuple[str, ...]
    dp: int = 1  # data-parallel degree: local_batch_size = GLOBAL_BATCH / dp
    tp: bool = False

    @property
    def shards(self) -> bool:
        """dp_shard > 1: the bf16 run takes the FSDP precision path."""
        return SHARD in self.overrides and self.overrides[self.overrides.index(SHARD) + 1] != "1"

    def args(self, precision: str, *extra: str) -> list[str]:
        return [
            *BASE,
            *PRECISIONS[precision],
            "--training.local_batch_size",
            str(GLOBAL_BATCH // self.dp),
            *self.overrides,
            *extra,
        ]


LAYOUTS = {
    "fsdp2": Layout(2, (SHARD, "2"), dp=2),
    "ddp2": Layout(2, (REPLICATE, "2", SHARD, "1"), dp=2),
    "tp2": Layout(2, (TP, "2"), tp=True),
    "tp2_no_sp_no_loss_parallel": Layout(
        2,
        (TP, "2", "--parallelism.enable_sequence_parallel", "false", "--parallelism.disable_loss_parallel", "true"),
        tp=True,
    ),
    "pp2_gpipe": Layout(2, (PP, "2", SCHEDULE, "GPipe")),
    "pp2_1f1b": Layout(2, (PP, "2", SCHEDULE, "1F1B")),
    "pp2_interleaved1f1b": Layout(2, (PP, "2", SCHEDULE, "Interleaved1F1B")),
    "hsdp2x2": Layout(4, (REPLICATE, "2", SHARD, "2"), dp=4),
    "fsdp2_tp2": Layout(4, (SHARD, "2", TP, "2"), dp=2, tp=True),
    "pp2_ddp2": Layout(4, (PP, "2", REPLICATE, "2", SHARD, "1", SCHEDULE, "1F1B"), dp=2),
    "pp2_fsdp2": Layout(4, (PP, "2", SHARD, "2", SCHEDULE, "Interleaved1F1B"), dp=2),
    "pp2_tp2": Layout(4, (PP, "2", TP, "2", SCHEDULE, "1F1B"), tp=True),
}
SINGLE = Layout(1, ())
# The Qwen3 dense family's debug shape (models/qwen3/: per-head q/k RMSNorm, GQA 4 heads over 2, head_dim
# 32 on a 64-wide stream) on the layouts its parts meet: FSDP, TP (the q/k norms split by head), PP,
# FSDP x TP, context parallel (the q/k norms run on each rank's chunk before the keys are gathered).
QWEN3 = ("--model.name", "qwen3", "--model.flavor", "debugmodel")
QWEN3_LAYOUTS = {
    "fsdp2": LAYOUTS["fsdp2"],
    "tp2": LAYOUTS["tp2"],
    "pp2_1f1b": LAYOUTS["pp2_1f1b"],
    "cp2": Layout(2, ("--parallelism.context_parallel_degree", "2")),
    "fsdp2_tp2": LAYOUTS["fsdp2_tp2"],
}
# 8 processes on 2 cores cost ~1.5 min more: opt in with TORCHTITAN_AMP_TEST_8_RANKS=1.
LAYOUTS_8 = {
    "fsdp2_tp2_pp2": Layout(8, (SHARD, "2", TP, "2", PP, "2", SCHEDULE, "1F1B"), dp=2, tp=True),
    "hsdp2x2_tp2": Layout(8, (REPLICATE, "2", SHARD, "2", TP, "2"), dp=4, tp=True),
}

AC_MODES = {
    "full": ("--activation_checkpoint.mode", "full"),
    "selective2": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"),
    "op": ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"),
}
# (AC mode, layout, precision): fp32 on FSDP for all modes; bf16 on both precision paths.
AC_RUNS = [
    ("full", "fsdp2", "fp32"),
    ("selective2", "fsdp2", "fp32"),
    ("op", "fsdp2", "fp32"),
    ("op", "fsdp2", "bf16"),
    ("full", "ddp2", "bf16"),
]
# What each AC mode must have wrapped in debugmodel's 6 blocks.
AC_WRAPPED = {
    "full": [f"layers.{i}" for i in range(N_LAYERS)],
    "selective2": [f"layers.{i}" for i in range(0, N_LAYERS, 2)],
    "op": [f"layers.{i}" for i in range(N_LAYERS)],  # op-level SAC wraps a dense block whole, as torchtitan
}


# Block-scaled emulation (mixed_precision.block_scaled) on the layouts that split its GEMMs:
# run name -> (layout, recipe). "nvfp4" is NVIDIA's full recipe (2-D weights, RHT, SR),
# "nvfp4_rne" the same without stochastic rounding (its draws depend on the local shapes).
BLOCK_SCALED = {
    "mxfp8": ("--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.block_scaled_emulate", "true"),
    "nvfp4": ("--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.block_scaled_emulate", "true"),
    "nvfp4_rne": (
        "--mixed_precision.block_scaled",
        "nvfp4",
        "--mixed_precision.block_scaled_emulate",
        "true",
        "--mixed_precision.nvfp4_stochastic_rounding",
        "false",
    ),
}
BLOCK_SCALED_RUNS = {
    "ddp2": ("mxfp8",),
    "fsdp2": ("mxfp8", "nvfp4"),
    "tp2": ("mxfp8", "nvfp4_rne"),
    "pp2_1f1b": ("mxfp8",),
}


def _block_scaled_runs(nproc: int) -> list[dict]:
    if nproc == 1:
        return [{"name": f"single_{r}", "args": SINGLE.args("bf16", *BLOCK_SCALED[r])} for r in BLOCK_SCALED]
    return [
        {"name": f"{name}_{r}", "args": LAYOUTS[name].args("bf16", *BLOCK_SCALED[r])}
        for name, recipes in BLOCK_SCALED_RUNS.items()
        if LAYOUTS[name].nproc == nproc
        for r in recipes
    ]


def _runs_for(nproc: int, docs: Path = Path("docs.jsonl")) -> list[dict]:
    """nproc's runs; `docs` is the short-document corpus of the document-masking runs."""
    runs = _block_scaled_runs(nproc)
    if nproc == 1:
        runs += [{"name": f"single_{p}", "args": SINGLE.args(p)} for p in ("fp32", "bf16")]
        runs.append({"name": "qwen3_single_fp32", "args": SINGLE.args("fp32", *QWEN3)})
    runs += [
        {"name": f"qwen3_{name}_fp32", "args": layout.args("fp32", *QWEN3)}
        for name, layout in QWEN3_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    if nproc == 2:
        runs.append({"name": "qwen3_fsdp2_bf16", "args": LAYOUTS["fsdp2"].args("bf16", *QWEN3)})
    for name, layout in LAYOUTS.items():
        if layout.nproc == nproc:
            runs += [{"name": f"{name}_{p}", "args": layout.args(p)} for p in ("fp32", "bf16")]
            if name in FP16_NORM_LAYOUTS:
                runs.append({"name": f"{name}_fp16", "args": layout.args("fp16")})
    if nproc == 2:
        runs += [
            {"name": f"ac_{mode}_{name}_{p}", "args": LAYOUTS[name].args(p, *AC_MODES[mode])}
            for mode, name, p in AC_RUNS
        ]
    if nproc == 4:  # the other choice of when PP + FSDP reduces (parallelism.pipeline_fsdp_reduce)
        runs.append(
            {
                "name": "pp2_fsdp2_reduce_per_microbatch_fp32",
                "args": LAYOUTS["pp2_fsdp2"].args("fp32", "--parallelism.pipeline_fsdp_reduce", "per_microbatch"),
            }
        )
    if nproc == 8:
        runs += [{"name": f"{name}_fp32", "args": layout.args("fp32")} for name, layout in LAYOUTS_8.items()]
    masked = ("--training.dataset", f"path:{docs}", "--model.attn_mask_type", "block_causal")
    runs += [
        {"name": f"docmask_{name}_fp32", "args": layout.args("fp32", *masked)}
        for name, layout in {"single": SINGLE, **LAYOUTS}.items()
        if name in DOC_MASK_LAYOUTS and layout.nproc == nproc
    ]
    if nproc == 1:  # the same data without the mask: the mask must change the curve
        runs.append({"name": "docs_causal_single_fp32", "args": SINGLE.args("fp32", *masked[:2])})
    if nproc == 2:  # the mask through activation checkpointing's recompute (op-level SAC)
        runs.append(
            {"name": "docmask_ac_op_fsdp2_fp32", "args": LAYOUTS["fsdp2"].args("fp32", *masked, *AC_MODES["op"])}
        )
    return runs


# Document masking (model.attn_mask_type = "block_causal") in fp32 on these layouts, on a corpus of
# short documents (1-6 words: every 32-token window holds several); tests/test_attention_masks.py
# has the single-process proof that a masked window trains as its documents alone.
DOC_MASK_LAYOUTS = ("single", "fsdp2", "ddp2", "tp2", "pp2_1f1b", "fsdp2_tp2")


@dataclass
class Run:
    name: str
    folder: Path
    launch_output: str

    def _check_done(self) -> None:
        errors = sorted(self.folder.glob("error_rank*.txt"))
        if errors:
            pytest.fail(f"{self.name} raised:\n{errors[0].read_text()[-4000:]}")
        if not (self.folder / "wall_s.txt").is_file():
            pytest.fail(
                f"{self.name} did not finish (an earlier run in its launch failed?):\n{self.launch_output[-4000:]}"
            )

    @property
    def rows(self) -> list[dict]:
        self._check_done()
        rows = [json.loads(line) for line in (self.folder / "metrics.jsonl").read_text().splitlines() if line]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
        return rows

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    @property
    def grad_norms(self) -> list[float]:
        return [r["grad_norm"] for r in self.rows]

    @property
    def report(self) -> dict:
        self._check_done()
        return json.loads((self.folder / "precision_report.json").read_text())

    def ranks(self) -> list[dict]:
        self._check_done()
        return [json.loads(p.read_text()) for p in sorted(self.folder.glob("rank*.json"))]


class Launches:
    """Runs each process count's batch of layouts once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outputs: dict[str, str] = {}
        self.docs = write_short_documents(root / "docs.jsonl")

    def launch(self, nproc: int, runs: list[dict], key: str, timeout: float) -> None:
        # Set first: if the launch times out (pytest.fail), later tests report it instead of relaunching.
        self.outputs[key] = f"the {key} launch did not finish within {timeout} s"
        result = launch_worker("layouts", self.root / key, runs, nproc, timeout=timeout, check=False)
        self.outputs[key] = result.describe(6000)

    def run(self, name: str, nproc: int) -> Run:
        key = f"nproc{nproc}"
        if key not in self.outputs:
            self.launch(nproc, _runs_for(nproc, self.docs), key, timeout=600)
        return Run(name, self.root / key / name, self.outputs[key])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("layouts"))


def run_of(trained: Launches, name: str, precision: str) -> Run:
    nproc = 1 if name == "single" else {**LAYOUTS, **LAYOUTS_8}[name].nproc
    return trained.run(f"{name}_{precision}", nproc)


def bf16_rounding_sigma() -> float:
    """The loss's bf16 rounding noise for BASE's model and batch (support.bf16_rounding_sigma)."""
    return rounding_sigma(tuple(BASE), GLOBAL_BATCH)


def test_bf16_rounding_sigma_is_the_scale_of_bf16_noise() -> None:
    """The yardstick itself: of the order of bf16's measured step-1 effect (2e-4..8e-4 vs fp32)."""
    assert 5e-5 < bf16_rounding_sigma() < 1e-3, bf16_rounding_sigma()


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# The data the parity rests on


def test_data_parallel_ranks_share_the_single_process_batch() -> None:
    """D ranks with local batch B see, step by step, the windows of one process with batch D x B."""
    from torchtitan_amp.data import build_dataloader
    from torchtitan_amp.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("byte")

    def batches(batch: int, rank: int, world: int) -> list[torch.Tensor]:
        loader = iter(build_dataloader("pydoc", tokenizer, 32, batch, rank, world, seed=0))
        return [next(loader)[0] for _ in range(STEPS)]

    single = batches(GLOBAL_BATCH, 0, 1)
    for dp in (2, 4):
        per_rank = [batches(GLOBAL_BATCH // dp, r, dp) for r in range(dp)]
        for step in range(STEPS):
            union = sorted(map(tuple, torch.cat([b[step] for b in per_rank]).tolist()))
            assert union == sorted(map(tuple, single[step].tolist())), (dp, step)


# ---------------------------------------------------------------------------------------------
# fp32: every layout matches one process to 1e-4 (measured ~1e-7)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_loss_parity(trained: Launches, name: str) -> None:
    ref, run = run_of(trained, "single", "fp32"), run_of(trained, name, "fp32")
    loss_rel, norm_rel = max_rel(run.losses, ref.losses), max_rel(run.grad_norms, ref.grad_norms)
    print(f"\n[parity fp32] {name}: max rel loss diff {loss_rel:.2e}, grad norm {norm_rel:.2e} over {STEPS} steps")
    assert loss_rel < FP32_REL_TOL, (run.losses, ref.losses)
    assert norm_rel < FP32_REL_TOL, (run.grad_norms, ref.grad_norms)
    assert run.report["path"] == "full"
    # The curve is a real training curve, not a constant that trivially matches.
    assert ref.losses[-1] < ref.losses[0] - 2


@pytest.mark.parametrize("name", list(QWEN3_LAYOUTS))
def test_fp32_qwen3_loss_parity(trained: Launches, name: str) -> None:
    """The Qwen3 family on each layout against its one-process curve, fp32 (FP32_REL_TOL)."""
    ref = trained.run("qwen3_single_fp32", 1)
    run = trained.run(f"qwen3_{name}_fp32", QWEN3_LAYOUTS[name].nproc)
    loss_rel, norm_rel = max_rel(run.losses, ref.losses), max_rel(run.grad_norms, ref.grad_norms)
    print(f"\n[parity fp32] qwen3 {name}: max rel loss diff {loss_rel:.2e}, grad norm {norm_rel:.2e}")
    assert loss_rel < FP32_REL_TOL, (run.losses, ref.losses)
    assert norm_rel < FP32_REL_TOL, (run.grad_norms, ref.grad_norms)
    assert ref.losses[-1] < ref.losses[0] - 1


def test_bf16_qwen3_within_precision_tolerance(trained: Launches) -> None:
    """The Qwen3 family under bf16 FSDP (q/k norms in fp32 groups) within the whole-curve
    tolerances of its fp32 curve."""
    fp32, run = trained.run("qwen3_single_fp32", 1), trained.run("qwen3_fsdp2_bf16", 2)
    deltas = [a - b for a, b in zip(run.losses, fp32.losses)]
    print(f"\n[bf16] qwen3 fsdp2: vs fp32 max |d| {max(map(abs, deltas)):.2e}, mean {sum(deltas) / len(deltas):+.2e}")
    assert len(deltas) == STEPS and run.report["path"] == "fsdp"
    assert max(map(abs, deltas)) < CURVE_TOL and abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas


@pytest.mark.skipif(
    os.environ.get("TORCHTITAN_AMP_TEST_8_RANKS") != "1",
    reason="8-process layouts (3-D FSDP x TP x PP, HSDP x TP) are opt-in on a 2-core CPU: "
    "set TORCHTITAN_AMP_TEST_8_RANKS=1",
)
@pytest.mark.parametrize("name", list(LAYOUTS_8))
def test_fp32_loss_parity_8_ranks(trained: Launches, name: str) -> None:
    test_fp32_loss_parity(trained, name)


# ---------------------------------------------------------------------------------------------
# bf16 mixed precision: the precision tests' tolerances vs fp32, tighter within one precision path


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_loss_within_precision_tolerance(trained: Launches, name: str) -> None:
    layout = LAYOUTS[name]
    fp32, run = run_of(trained, "single", "fp32").losses, run_of(trained, name, "bf16")
    deltas = [a - b for a, b in zip(run.losses, fp32)]
    family = run_of(trained, "fsdp2" if layout.shards else "single", "bf16").losses
    same_path = abs(run.losses[0] - family[0])
    print(
        f"\n[parity bf16] {name}: vs fp32 max |d| {max(map(abs, deltas)):.2e} (max rel "
        f"{max_rel(run.losses, fp32):.2e}), mean d {sum(deltas) / len(deltas):+.2e}, step 1 d {deltas[0]:+.2e}; "
        f"step 1 vs same-path reference {same_path:.1e} ({same_path / bf16_rounding_sigma():.2f} sigma)"
    )
    assert len(deltas) == STEPS
    assert max(map(abs, deltas)) < CURVE_TOL, deltas
    assert abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas
    # bf16 really ran: step 1's difference from fp32 is a draw of N(0, ~sigma) (measured 2e-5 on
    # FSDP x TP, 0.1 sigma), so one step alone falls below STEP1_MIN by chance in ~4% of layouts x
    # CPUs; steps 1 and 2 both do in ~0.2%.
    assert abs(deltas[0]) < STEP1_TOL and STEP1_MIN < max(abs(deltas[0]), abs(deltas[1])), deltas[:2]
    tolerance = SPLIT_MATMUL_STEP1_SIGMAS * bf16_rounding_sigma() if layout.tp else SAME_FAMILY_STEP1_TOL
    assert same_path < tolerance, (run.losses, family, tolerance)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_precision_report_path(trained: Launches, name: str) -> None:
    report = run_of(trained, name, "bf16").report
    expected = "fsdp" if LAYOUTS[name].shards else "autocast"
    assert (report["path"], report["param_dtype"], report["reduce_dtype"]) == (expected, "bfloat16", "float32")
    assert report["autocast_dtype"] == ("bfloat16" if expected == "autocast" else None)


def test_single_process_bf16_path(trained: Launches) -> None:
    assert run_of(trained, "single", "bf16").report["path"] == "autocast"


# ---------------------------------------------------------------------------------------------
# Block-scaled emulation (MXFP8, NVFP4) on DDP, FSDP, TP and PP vs one process
#
# Step 1 runs the same weights on the same 4 sequences, so its loss shows whether each layout
# quantized the forward operands as one process does:
# - MXFP8 has no tensor scale and its 1x32 blocks run along K inside one token's row (forward,
#   dgrad) or, for wgrad, along 32 tokens = one sequence here: DDP and PP (ranks / microbatches
#   holding whole sequences) quantize every operand as one process does, and TP's shards split K
#   and N into whole blocks (block_scaled.check_tensor_parallel). What remains is bf16's
#   (fp32 sums split by rank, TP's per-rank partial outputs rounded to bf16 before the reduction):
#   the bf16 layouts' step-1 bounds.
# - NVFP4 under TP all-reduces each operand's tensor amax over the TP ranks: the same tensor
#   scale as one process, so (with RNE; SR's draws follow the local shapes) the same bound.
# - FSDP all-gathers the weights in bf16 and quantizes those (one process quantizes its fp32
#   master weights): a bf16 rounding before the block rounding, bounded like bf16 vs fp32 at step 1.
# - NVFP4 under DDP / FSDP takes each tensor scale over the rank's half of the batch (as a kernel
#   quantizing its local GEMM operand does) and SR draws over the local shapes: another
#   quantization of the same values, so the curves differ by NVFP4's own noise: bounded by
#   test_blockscaled_train's GAP (0.02, nvfp4's mean gap to bf16 on this model).
# Later steps amplify step-1 differences through AdamW and clipping: MXFP8 curves are held to the
# bf16 curve tolerance CURVE_TOL, NVFP4 curves to GAP.
NVFP4_CURVE_TOL = 0.02  # tests/test_blockscaled_train.py GAP


def _block_scaled_cases() -> list[tuple[str, str]]:
    return [(name, r) for name, recipes in BLOCK_SCALED_RUNS.items() for r in recipes]


@pytest.mark.parametrize("name, recipe", _block_scaled_cases())
def test_block_scaled_trains_as_one_process(trained: Launches, name: str, recipe: str) -> None:
    layout = LAYOUTS[name]
    run, ref = trained.run(f"{name}_{recipe}", layout.nproc), trained.run(f"single_{recipe}", 1)
    bf16 = run_of(trained, "single", "bf16").losses
    step1 = abs(run.losses[0] - ref.losses[0])
    curve = max(abs(a - b) for a, b in zip(run.losses, ref.losses))
    print(
        f"\n[block-scaled] {name} {recipe}: step 1 vs one process {step1:.1e}, curve max |d| {curve:.1e}; "
        f"one process's {recipe} vs bf16 at step 1 {ref.losses[0] - bf16[0]:+.1e}"
    )
    if recipe == "nvfp4" and layout.dp > 1:
        assert curve < NVFP4_CURVE_TOL, (run.losses, ref.losses)
    elif layout.shards:
        assert step1 < STEP1_TOL and curve < CURVE_TOL, (run.losses, ref.losses)
    else:
        step1_tol = SPLIT_MATMUL_STEP1_SIGMAS * bf16_rounding_sigma() if layout.tp else SAME_FAMILY_STEP1_TOL
        assert step1 < step1_tol, (run.losses, ref.losses, step1_tol)
        assert curve < (CURVE_TOL if recipe == "mxfp8" else NVFP4_CURVE_TOL), (run.losses, ref.losses)
    # The recipe ran: its step-1 loss is not bf16's (measured 1e-4..2e-4 apart; bf16's step-1 noise
    # between layouts is <= 1e-5 outside TP).
    assert abs(ref.losses[0] - bf16[0]) > SAME_FAMILY_STEP1_TOL, (ref.losses, bf16)
    section = run.report["block_scaled"]
    # Rank 0's report: under PP its stage holds block 1's 7 converted Linears, else blocks 1-2's 14.
    converted = 7 if name.startswith("pp") else 14
    assert (section["format"], section["emulated"], len(section["modules"])) == (recipe[:5], True, converted), section
    assert ref.losses[-1] < ref.losses[0] - 2


# ---------------------------------------------------------------------------------------------
# The mesh each rank saw on real 4-process runs


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout.nproc == 4])
def test_four_rank_mesh_coordinates_and_data_ranks(trained: Launches, name: str) -> None:
    ranks = run_of(trained, name, "fp32").ranks()
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    degrees = ranks[0]["degrees"]
    shape = [degrees[d] for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    for r in ranks:
        assert r["mesh_dim_names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"] and r["mesh_shape"] == shape
        # Row-major: rank = (((pp * R + rep) * S + shard) * C + cp) * T + tp.
        assert torch.tensor(r["coordinate"]).tolist() == [
            int(i) for i in torch.nonzero(torch.arange(4).reshape(shape) == r["rank"])[0]
        ]
        pp_i, rep_i, shard_i, cp_i, tp_i = r["coordinate"]
        assert r["dp_rank"] == rep_i * degrees["dp_shard"] + shard_i
        assert r["dp_world_size"] == r["dp_mesh_size"] == dp
    # Each data shard is held by exactly the pp x tp ranks sharing its dp coordinate.
    for d in range(dp):
        holders = [tuple(r["coordinate"][i] for i in (0, 4)) for r in ranks if r["dp_rank"] == d]
        assert sorted(holders) == sorted({(p, t) for p in range(shape[0]) for t in range(shape[4])})


# ---------------------------------------------------------------------------------------------
# Document masking: every layout masks at the same document boundaries


@pytest.mark.parametrize("name", [n for n in DOC_MASK_LAYOUTS if n != "single"])
def test_document_masking_matches_one_process(trained: Launches, name: str) -> None:
    nproc = LAYOUTS[name].nproc
    ref, run = trained.run("docmask_single_fp32", 1), trained.run(f"docmask_{name}_fp32", nproc)
    unmasked = trained.run("docs_causal_single_fp32", 1)
    loss_rel, norm_rel = max_rel(run.losses, ref.losses), max_rel(run.grad_norms, ref.grad_norms)
    print(
        f"\n[docmask fp32] {name}: max rel loss diff {loss_rel:.2e}, grad norm {norm_rel:.2e}; "
        f"the mask moves the single-process curve by {max_rel(unmasked.losses, ref.losses):.1e}"
    )
    assert loss_rel < FP32_REL_TOL and norm_rel < FP32_REL_TOL, (run.losses, ref.losses)
    # The runs really masked: without the mask the same data trains another curve.
    assert max_rel(unmasked.losses, ref.losses) > 10 * FP32_REL_TOL, (unmasked.losses, ref.losses)


def test_document_masking_survives_activation_checkpointing(trained: Launches) -> None:
    plain, ac = trained.run("docmask_fsdp2_fp32", 2), trained.run("docmask_ac_op_fsdp2_fp32", 2)
    assert max_rel(ac.losses, plain.losses) <= AC_REL_TOL and max_rel(ac.grad_norms, plain.grad_norms) <= AC_REL_TOL
    assert all(r["checkpoint_wrapped"] == AC_WRAPPED["op"] for r in ac.ranks())


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and compile change memory and speed, not the loss


@pytest.mark.parametrize("mode, name, precision", AC_RUNS)
def test_activation_checkpointing_keeps_the_loss(trained: Launches, mode: str, name: str, precision: str) -> None:
    plain, ac = run_of(trained, name, precision), trained.run(f"ac_{mode}_{name}_{precision}", LAYOUTS[name].nproc)
    loss_rel, norm_rel = max_rel(ac.losses, plain.losses), max_rel(ac.grad_norms, plain.grad_norms)
    print(f"\n[AC] {mode} on {name} {precision}: max rel loss diff {loss_rel:.1e}, grad norm {norm_rel:.1e}")
    assert loss_rel <= AC_REL_TOL and norm_rel <= AC_REL_TOL, (ac.losses, plain.losses)
    for rank in ac.ranks():
        assert rank["checkpoint_wrapped"] == AC_WRAPPED[mode]
    assert all(r["checkpoint_wrapped"] == [] for r in plain.ranks())


def test_pipeline_fsdp_reduce_per_microbatch_keeps_the_loss(trained: Launches) -> None:
    """Reduce-scattering each microbatch's gradient (and re-gathering the parameters) instead of
    accumulating them unsharded until the step's last microbatch changes only the order of the
    fp32 sums: the same curve to rounding."""
    per_step = run_of(trained, "pp2_fsdp2", "fp32")
    per_microbatch = trained.run("pp2_fsdp2_reduce_per_microbatch_fp32", 4)
    loss_rel = max_rel(per_microbatch.losses, per_step.losses)
    norm_rel = max_rel(per_microbatch.grad_norms, per_step.grad_norms)
    print(
        f"\n[PP + FSDP] per-microbatch vs per-step reduce, fp32: max rel loss diff {loss_rel:.1e}, "
        f"grad norm {norm_rel:.1e}"
    )
    assert loss_rel <= AC_REL_TOL and norm_rel <= AC_REL_TOL, (per_microbatch.losses, per_step.losses)


@pytest.mark.skipif(c_compiler() is None, reason=NO_COMPILER)
def test_compile_keeps_the_loss_under_bf16_autocast(trained: Launches) -> None:
    """Per-block compile with the autocast forward context inside the compiled region (~50 s: a
    cold inductor compile on 2 cores; 3 steps, compared with the eager run's first 3)."""
    steps = 3
    trained.launch(
        1,
        [
            {
                "name": "compile_bf16",
                "args": SINGLE.args("bf16", "--compile.enable", "true", "--training.steps", str(steps)),
            }
        ],
        "compile",
        timeout=600,
    )
    compiled = Run("compile_bf16", trained.root / "compile" / "compile_bf16", trained.outputs["compile"])
    eager, fp32 = run_of(trained, "single", "bf16").losses[:steps], run_of(trained, "single", "fp32").losses[:steps]
    rel = max(abs(a - b) / b for a, b in zip(compiled.losses, eager))
    print(
        f"\n[compile] bf16 compiled vs eager: max rel loss diff {rel:.1e} over {steps} steps; "
        f"step 1 vs fp32 {compiled.losses[0] - fp32[0]:+.1e}"
    )
    assert len(compiled.losses) == steps and rel < COMPILE_REL_TOL, (compiled.losses, eager)
    assert STEP1_MIN < abs(compiled.losses[0] - fp32[0]) < STEP1_TOL  # autocast ran inside the compiled blocks
    rank = compiled.ranks()[0]
    assert rank["compiled"] == [f"layers.{i}" for i in range(N_LAYERS)] and rank["dynamo_unique_graphs"] >= 1
    assert compiled.report["path"] == "autocast"
    check_norms(compiled)  # the compiled blocks' gradients: the norm and clipping


# ---------------------------------------------------------------------------------------------
# The gradient norm and clipping against an independent fp64 value
#
# tests/workers/norm_check.py wraps the trainer's clip_grad_norm_ in every run above: per rank and
# step it records the reported norm, an fp64 norm of every gradient element counted once over all
# ranks (at the first step also from the full gradients gathered with full_tensor()), and how far
# the clipped gradients are from g * max_norm / true. Every run's grad norms are 1.0-1.7
# (measured), so the default max_norm 1.0 clips at most steps (check_norms asserts it clipped at least once).

NORM_RUNS = [(run["name"], nproc) for nproc in (1, 2, 4) for run in _runs_for(nproc)]


def check_norms(run: Run) -> tuple[float, float]:
    """Every rank's every step: reported == fp64 norm to NORM_RTOL, clipped gradients ==
    g * max_norm / true to CLIP_RTOL, and clipping acted at least once. Returns the largest
    relative norm and clip errors seen."""
    rows, ranks = run.rows, run.ranks()
    norm_err = clip_err = 0.0
    for rank in ranks:
        records = rank["norm_check"]
        assert len(records) == len(rows), (rank["rank"], len(records), len(rows))
        # The replica counting of the per-step norm against the gathered full gradients.
        assert abs(records[0]["gathered"] - records[0]["true"]) < GATHERED_RTOL * records[0]["true"], records[0]
        assert all(rec["gathered"] is None for rec in records[1:])
        for step, rec in enumerate(records, start=1):
            rel = abs(rec["reported"] - rec["true"]) / rec["true"]
            assert rel < NORM_RTOL, (run.name, rank["rank"], step, rec)
            assert rec["max_norm"] == 1.0 and rec["clip_rel_err"] is not None, rec
            assert rec["clip_rel_err"] < CLIP_RTOL, (run.name, rank["rank"], step, rec)
            norm_err, clip_err = max(norm_err, rel), max(clip_err, rec["clip_rel_err"])
        assert any(rec["clipped"] for rec in records), (run.name, "max_norm never clipped", records)
    # The norm the metrics (and every parity test above) read is the one checked here.
    assert [rec["reported"] for rec in ranks[0]["norm_check"]] == [r["grad_norm"] for r in rows]
    return norm_err, clip_err


@pytest.mark.parametrize("name, nproc", NORM_RUNS)
def test_grad_norm_and_clipping_match_fp64_reference(trained: Launches, name: str, nproc: int) -> None:
    norm_err, clip_err = check_norms(trained.run(name, nproc))
    print(f"\n[norm check] {name}: reported vs fp64 norm max rel {norm_err:.1e}, clipped grads max rel {clip_err:.1e}")


# Block-scaled runs included: training's recipe reads no operand's finiteness (a NaN / inf block
# gets a NaN scale and reaches the step's one finiteness read).
SYNC_RUNS = NORM_RUNS


@pytest.mark.parametrize("name, nproc", SYNC_RUNS)
def test_a_step_reads_the_device_once_on_every_layout(trained: Launches, name: str, nproc: int) -> None:
    """Step 2's host syncs on every rank of every run (single, FSDP, DDP, HSDP, TP, PP schedules,
    2-D, AC modes, document masking, fp16, block-scaled): trainer.train_step's finiteness read alone, counted at
    the dispatcher (torchtitan_amp/observability/host_syncs.py); under fp16 that read is the loss scale after
    GradScaler.update (the fused optimizer takes found_inf on the device)."""
    assert_step_sync_budget(trained.run(name, nproc).ranks(), name)


@pytest.mark.parametrize("name", FP16_NORM_LAYOUTS)
def test_fp16_runs_were_loss_scaled(trained: Launches, name: str) -> None:
    """The fp16 runs of the norm check above really scaled their loss and stepped every step, and
    clipped unscaled gradients: the norm check compares the trainer with the gradients it was
    handed, so a clip before unscale_ would pass it, but not this comparison with the fp32 run's
    step-1 norm (same weights and data): a scaled norm is 1024x larger."""
    run, fp32 = run_of(trained, name, "fp16"), run_of(trained, name, "fp32")
    assert run.report["param_dtype"] == "float16" and run.report["grad_scaler"] != "none", run.report
    assert [(r["loss_scale"], r["skipped_steps"]) for r in run.rows] == [(1024.0, 0.0)] * STEPS, run.rows
    print(f"\n[fp16] {name}: step-1 grad norm vs fp32 {run.grad_norms[0] / fp32.grad_norms[0] - 1:+.1e}")
    # Measured 1.5e-5..3.5e-5; fp16 has 3 more mantissa bits than bf16, whose step-1 bound this is.
    assert abs(run.grad_norms[0] / fp32.grad_norms[0] - 1) < GRAD_NORM_STEP1_RTOL, (run.grad_norms, fp32.grad_norms)


@pytest.mark.skipif(
    os.environ.get("TORCHTITAN_AMP_TEST_8_RANKS") != "1",
    reason="8-process layouts are opt-in on a 2-core CPU: set TORCHTITAN_AMP_TEST_8_RANKS=1",
)
@pytest.mark.parametrize("name", list(LAYOUTS_8))
def test_grad_norm_and_clipping_match_fp64_reference_8_ranks(trained: Launches, name: str) -> None:
    check_norms(run_of(trained, name, "fp32"))
