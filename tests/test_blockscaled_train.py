"""Block-scaled training as a plan decision, single process on CPU (the emulated path: no device
here has MX / NVFP4 tensor cores, so `block_scaled_emulate = "auto"` refuses and every run below
asks for the emulation): config and plan refusals, the module swap keeping parameter names, the
report, the audit (a promised module run as a plain Linear is named), and the tiny model trained
in nvfp4 against bf16 with the recipe's RHT and SR switched off one at a time.

The training comparison: debugmodel_tiny (4 blocks; the edge blocks 0 and 3 and `output` stay
bf16, the 14 Linears of blocks 1-2 run nvfp4), seq_len 32, batch 2, lr 3e-3, `STEPS` steps from
training.seed 0 (SR draws from generators seeded by it: every run replays). Tolerance on the mean
|loss - bf16 loss| over the run: `GAP` = 0.02. Why that: the loss moves by 0.1-0.6 from one step to
the next (different batches), two bf16 paths of one model already differ by 1e-3 to 2e-3 over 30
steps (docs/mixed_precision.md), and NVFP4's e2m1 elements round each operand by up to 1/4 of its
value (RNE; 1/2 with SR) where bf16 rounds by 2^-9: a hundred times coarser per element, averaged
over the 64-256 long reductions. 0.02 is 0.6% of the loss at the end of the run and 3x what was
measured (0.0055 at 10 steps; 0.0054-0.0083 over 30 steps and three seeds); a quantizer off by a
scale factor or a transposed operand moves the loss by 0.1 and more within a few steps.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.support.launch import by_step
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.models.llama3.model import LLAMA3_FLAVORS
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.linear import BlockScaledLinear
from torchtitan_amp.train import build
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.unit

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
    "--mixed_precision.enabled",
    "true",
]
NVFP4 = ["--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.block_scaled_emulate", "true"]
MXFP8 = ["--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.block_scaled_emulate", "true"]
STEPS = 10
GAP = 0.02
SPREAD = 0.005  # the full recipe's gap varies by 0.0029 across seeds 0-2 (30 steps)
VARIANTS = {
    "bf16": [],
    "nvfp4": NVFP4,
    "nvfp4 no RHT": [*NVFP4, "--mixed_precision.nvfp4_rht", "false"],
    "nvfp4 no SR": [*NVFP4, "--mixed_precision.nvfp4_stochastic_rounding", "false"],
}


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _resolve(*extra: str, world: int = 1) -> job_mod.Job:
    return job_mod.resolve(load_config([*BASE, *extra]), world, "cpu")


def _trainer(tmp_path: Path, *extra: str) -> trainer_module.Trainer:
    return trainer_module.Trainer(load_config([*BASE, *extra, "--job.dump_folder", str(tmp_path)]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.fp8", "rowwise"],
            "'mixed_precision.block_scaled' = 'nvfp4' and 'mixed_precision.fp8' = 'rowwise' both convert the Linears",
        ),
        (
            ["--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.nvfp4_rht", "false"],
            "'mixed_precision.nvfp4_rht' = False belongs to the nvfp4 recipe",
        ),
        (
            [*NVFP4, "--mixed_precision.mxfp8_scale_mode", "floor"],
            "'mixed_precision.mxfp8_scale_mode' = 'floor' belongs to the mxfp8 recipe",
        ),
    ],
)
def test_config_refuses_block_scaled_with_fp8_and_options_of_the_other_format(extra, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(extra)


def test_mxfp8_rounds_its_block_scales_up_by_default() -> None:
    """rceil (torchao's MXFP8 training default, TransformerEngine, cuBLAS) unless asked for the OCP
    spec's floor rule, which lets a block's largest element reach 512 and clamps it to 448."""
    assert load_config([]).mixed_precision.mxfp8_scale_mode == "rceil"
    assert BlockScaledRecipe("mxfp8").mx_scale_mode == "rceil"
    recipe = _resolve(*MXFP8).plan.block_scaled
    assert recipe.mx_scale_mode == "rceil" and recipe.describe()["forward"].endswith("(rceil)")
    assert _resolve(*MXFP8, "--mixed_precision.mxfp8_scale_mode", "floor").plan.block_scaled.mx_scale_mode == "floor"


TP2 = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def test_tensor_parallel_splits_whole_blocks() -> None:
    """debugmodel_tiny under TP 2: every converted Linear's sharded dim splits into 32 per rank,
    whole mxfp8 blocks and nvfp4 blocks / 16x16 tiles: accepted, the plan unchanged."""
    for fmt in (MXFP8, NVFP4):
        assert _resolve(*fmt, *TP2, world=2).plan.block_scaled.format == fmt[1]


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (
            ["--mixed_precision.block_scaled", "nvfp4"],
            1,
            "error-free: 'mixed_precision.block_scaled' = 'nvfp4' needs block-scaled tensor cores: "
            "cpu has no MX / NVFP4 tensor cores; set mixed_precision.block_scaled_emulate = true to emulate "
            "(about 4-7x slower than bf16 on a 2-core AVX512 CPU)",
        ),
        # dim 96 over TP 2: the column-wise wq's 96 outputs split 48 per rank, not whole 32-blocks.
        (
            [*MXFP8, "--model.flavor", "blockscaled_dim96", *TP2],
            2,
            "'mixed_precision.block_scaled' = 'mxfp8' under parallelism.tensor_parallel_degree = 2: "
            "layers.1.attention.wq splits its out_features 96 into 48 per rank, not a multiple of the 32-element block",
        ),
        (
            [*NVFP4, "--mixed_precision.block_scaled_skip_modules", "outptu"],
            1,
            "'mixed_precision.block_scaled_skip_modules' entry 'outptu' matches no nn.Linear",
        ),
        (
            [*NVFP4, "--mixed_precision.block_scaled_edge_layers", "2"],
            1,
            "'mixed_precision.block_scaled' = 'nvfp4' converts no nn.Linear",
        ),
    ],
)
def test_what_cannot_hold_is_one_line_never_a_fallback(monkeypatch: pytest.MonkeyPatch, extra, world, message) -> None:
    # For this test only: other tests list the registry's flavors.
    monkeypatch.setitem(
        LLAMA3_FLAVORS, "blockscaled_dim96", dataclasses.replace(LLAMA3_FLAVORS["debugmodel_tiny"], dim=96)
    )
    with pytest.raises(PrecisionError) as e:
        _resolve(*extra, world=world)
    assert message.removeprefix("error-free: ") in str(e.value) and "\n" not in str(e.value)


def test_emulation_says_so_and_converts_blocks_1_2_keeping_parameter_names(tmp_path: Path) -> None:
    t = _trainer(tmp_path, *NVFP4)
    assert "nn.Linear in nvfp4, emulated" in t.run.plan.decision
    converted = sorted(n for n, m in t.run.model.named_modules() if isinstance(m, BlockScaledLinear))
    assert len(converted) == 14 and all(n.startswith(("layers.1.", "layers.2.")) for n in converted)
    plain = _trainer(tmp_path / "plain")
    # Checkpoints see the same state: same keys, shapes and dtypes (the swap keeps the Parameters).
    assert {k: (v.shape, v.dtype) for k, v in t.run.model.state_dict().items()} == {
        k: (v.shape, v.dtype) for k, v in plain.run.model.state_dict().items()
    }
    t.run.model.load_state_dict(plain.run.model.state_dict())
    report = json.loads((tmp_path / "precision_report.json").read_text())["block_scaled"]
    assert report["format"] == "nvfp4" and report["emulated"] and sorted(report["modules"]) == converted
    assert report["modules"]["layers.1.attention.wq"]["wgrad"] == "dy^T nvfp4 1x16 SR RHT16; x^T nvfp4 1x16 RHT16"
    assert "output" in report["kept_out"] and "layers.0.attention.wq" in report["kept_out"]


@pytest.mark.parametrize("extra", [NVFP4, MXFP8], ids=["nvfp4", "mxfp8"])
def test_audit_passes_and_names_a_promised_module_run_as_a_plain_linear(tmp_path: Path, extra) -> None:
    result = _trainer(tmp_path, *extra).audit()
    assert result.ok, result.breaches
    fmt = "float4_e2m1fn" if extra is NVFP4 else "float8_e4m3fn"
    assert {ops[0][0][0] for m, p in result.gemms.items() for ops in p.values()} == {fmt}
    assert len(result.gemms) == 14 and "output" not in result.gemms
    # The emulated GEMMs are fp32 mms; the Linears kept out ran in the plan's compute dtype.
    assert result.modules["layers.1.attention.wq"] == {"forward matmul": ["float32"]}
    assert result.modules["layers.0.attention.wq"] == result.modules["output"] == {"forward matmul": ["bfloat16"]}
    t = _trainer(tmp_path / "swapped", *extra)
    old = t.run.model.layers["1"].attention.wq
    plain = nn.Linear(old.in_features, old.out_features, bias=False)
    plain.weight = old.weight
    t.run.model.layers["1"].attention.wq = plain
    breaches = t.audit().breaches
    assert [(b.what, b.seen) for b in breaches] == [
        (f"layers.1.attention.wq: {p} GEMM", ["no block-scaled GEMM (ran as a plain matmul)"])
        for p in ("forward", "dgrad", "wgrad")
    ]


@pytest.fixture(scope="module")
def curves(tmp_path_factory) -> dict[str, list[float]]:
    root = tmp_path_factory.mktemp("blockscaled_train")
    out = {}
    threads = torch.get_num_threads()
    # One thread: the emulation is hundreds of small ops, each of which, on a shared 2-core
    # machine, would wait for its second thread (measured 4x the wall time under load).
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)
        for name, extra in VARIANTS.items():
            folder = root / name.replace(" ", "_")
            torch.manual_seed(0)
            _trainer(folder, "--training.steps", str(STEPS), *extra).train()
            losses = by_step(folder)
            out[name] = [losses[s]["loss"] for s in sorted(losses)]
    torch.set_num_threads(threads)
    return out


def _gap(curves: dict[str, list[float]], name: str) -> float:
    return sum(abs(a - b) for a, b in zip(curves[name], curves["bf16"])) / STEPS


def test_nvfp4_full_recipe_trains_within_the_gap_of_bf16(curves) -> None:
    gap = _gap(curves, "nvfp4")
    assert 0 < gap < GAP, (gap, curves)
    assert curves["nvfp4"][-1] < curves["nvfp4"][0] - 0.5  # it learns, as bf16 does


def test_rht_and_sr_switched_off_are_equal_within_the_seed_spread(curves) -> None:
    """Measured (one thread, seed 0, 10 steps): mean |gap| to bf16 full recipe 0.0055, RHT off
    0.0055, SR off 0.0032. Over 30 steps and seeds 0, 1, 2 (docs/numerics.md): full 0.0054 /
    0.0083 / 0.0068, RHT off 0.0058 / 0.0080 / 0.0067, SR off 0.0034 / 0.0077 / 0.0071: neither
    option off is measurably worse at this scale; RHT off is equal, SR off a little better, within
    the full recipe's own seed-to-seed spread (0.0029). RHT and SR target outliers and long-run bias, which a
    0.3M-parameter model trained for tens of steps does not show."""
    full = _gap(curves, "nvfp4")
    for name in ("nvfp4 no RHT", "nvfp4 no SR"):
        assert _gap(curves, name) < GAP and abs(_gap(curves, name) - full) < SPREAD, (name, _gap(curves, name), full)
    # Each option changes the numerics: the runs differ from each other.
    assert curves["nvfp4 no RHT"] != curves["nvfp4"] != curves["nvfp4 no SR"]


def test_resume_with_stochastic_rounding_is_bitwise(tmp_path: Path) -> None:
    """SR draws are seeded per step (block_scaled.seed_step): a run resumed at step 2 replays
    the uninterrupted one bit for bit, and the checkpoint holds the plain model's state."""
    ckpt = [*NVFP4, "--checkpoint.enable", "--checkpoint.interval", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _trainer(tmp_path / "straight", *ckpt, "--training.steps", "4").train()
        _trainer(tmp_path / "resumed", *ckpt, "--training.steps", "2").train()
        _trainer(tmp_path / "resumed", *ckpt, "--training.steps", "4").train()
    finally:
        torch.set_num_threads(threads)
    straight, resumed = by_step(tmp_path / "straight"), by_step(tmp_path / "resumed")
    assert [straight[s]["loss"] for s in sorted(straight)] == [resumed[s]["loss"] for s in sorted(resumed)]


# fp16 whose first scaled loss overflows: 2^40 x a loss of ~6 overflows fp16's 65504 in backward.
FP16_OVERFLOW = [
    "--mixed_precision.param_dtype",
    "float16",
    "--mixed_precision.init_scale",
    str(2.0**40),
    "--training.steps",
    "2",
]


def test_fp16_overflow_is_skipped_and_backed_off_as_in_plain_fp16(tmp_path: Path) -> None:
    """An inf in a block-scaled operand (the scaled gradient of an fp16 step that overflowed) is
    encoded as a NaN block scale and reaches the gradients, where the loss scaler finds it: the
    step is skipped and the scale backed off, as in plain fp16, never a refusal in backward."""
    seen = {}
    for name, extra in {"fp16": [], "mxfp8": MXFP8, "nvfp4": NVFP4}.items():
        t = _trainer(tmp_path / name, *FP16_OVERFLOW, *extra)
        before = {k: v.clone() for k, v in t.run.model.state_dict().items()}
        t.train()
        assert all(torch.equal(before[k], v) for k, v in t.run.model.state_dict().items()), name  # skipped
        seen[name] = [(r["loss_scale"], r["skipped_steps"]) for r in by_step(tmp_path / name).values()]
    assert seen["fp16"] == [(2.0**39, 1.0), (2.0**38, 2.0)], seen
    assert seen["mxfp8"] == seen["nvfp4"] == seen["fp16"], seen


def test_a_non_finite_activation_reaches_the_step_skip(tmp_path: Path) -> None:
    """training.skip_nonfinite_steps: an inf entering a block-scaled Linear makes the step's
    gradient norm non-finite, and the trainer skips that step (the quantizer does not stop the run)."""
    t = _trainer(tmp_path, *NVFP4, "--training.steps", "2", "--training.skip_nonfinite_steps")
    calls = []

    def inf_at_first_call(module, args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return (
            (
                args[0].masked_fill(
                    torch.zeros_like(args[0], dtype=torch.bool).index_fill_(-1, torch.tensor([3]), True), float("inf")
                ),
            )
            if len(calls) == 1
            else None
        )

    t.run.model.layers["1"].attention.wq.register_forward_pre_hook(inf_at_first_call)
    t.train()
    assert t.nonfinite_skipped == 1 and t.step == 2 and len(calls) == 2


def test_stochastic_rounding_draws_differ_between_ranks_and_replay_per_step() -> None:
    """seed_step keys each generator by (recipe seed, stream, step, rank): two data-parallel ranks
    rounding the same gradient draw independently, so their rounding errors are uncorrelated and
    the mean of their gradients halves the SR noise variance (with one key for all ranks a
    consistently signed gradient got the same errors on every rank: correlation 1 here). The same
    (step, rank) replays, which keeps resume bitwise; rank 0's key is the one-process key."""
    from torchtitan_amp.precision import block_scaled
    from torchtitan_amp.precision.lowbit import formats as bs

    lin = BlockScaledLinear(64, 32, recipe=BlockScaledRecipe.nvfp4_full(seed=0), sr_stream=3)
    g = torch.rand(256, 64, generator=torch.Generator().manual_seed(0)) + 0.1  # one sign throughout

    def rounding_error(step: int, rank: int) -> torch.Tensor:
        block_scaled.seed_step([lin], step, rank)
        values, s_t = bs.nvfp4_dequantized(g, generator=lin.generator)
        return (values * s_t - g).flatten().double()

    e0, e1 = rounding_error(5, 0), rounding_error(5, 1)
    assert torch.equal(rounding_error(5, 0), e0) and not torch.equal(rounding_error(6, 0), e0)
    # |correlation| of independent draws over n = 16384 elements: within 4 / sqrt(n) = 0.031
    corr = torch.corrcoef(torch.stack([e0, e1]))[0, 1].item()
    assert abs(corr) < 4 / e0.numel() ** 0.5, corr
    lin.generator.manual_seed((0 * 1_000_003 + 3) * 1_000_033 + 5)  # the key of a single process
    assert torch.equal(
        (bs.nvfp4_dequantized(g, generator=lin.generator)[0] * bs.nvfp4_tensor_scale(g.amax()) - g).flatten().double(),
        e0,
    )


@pytest.mark.parametrize(
    "layout, world, ranks",
    [
        (["--parallelism.data_parallel_shard_degree", "4"], 4, [0, 1, 2, 3]),
        # TP ranks quantize different shards (or, row-wise, one replicated dy): their own draws too
        (
            ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
            4,
            [0, 1, 2, 3],
        ),
        # pipeline stages hold different modules (own streams): stage 1 repeats stage 0's ranks
        (
            ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.pipeline_parallel_degree", "2"],
            4,
            [0, 1, 0, 1],
        ),
        (["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"], 2, [0, 1]),
    ],
)
def test_each_rank_rounding_its_own_values_gets_its_own_stochastic_rounding_key(layout, world, ranks) -> None:
    config = load_config([*BASE, *NVFP4, *layout])
    dims = job_mod.resolve(config, world, "cpu").dims
    assert [build.sr_rank(config, dims, r) for r in range(world)] == ranks
