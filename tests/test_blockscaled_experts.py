"""Block-scaled grouped experts (mixed_precision.block_scaled_experts), single process on CPU.

The grouped GEMM is the per-expert Linear's: for each format, forward, dgrad and wgrad of
block_scaled_grouped_mm equal, bit for bit, a loop over experts of block_scaled_linear with weight
w[e]^T on that expert's token group (one group empty, the others not multiples of the block, so
wgrad's token-dim blocks are padded per group). Then the trainer on a tiny MoE model: the report
and the audit name the experts' GEMMs, the audit names an expert run as a plain grouped matmul, and
mxfp8 with experts trains within `GAP` of bf16. Under expert parallel: tests/test_moe_dist.py.

The training comparison: debugmodel_moe (4 blocks, the first dense; the edge blocks 0 and 3 and
`output` stay bf16, so blocks 1-2 run their attention Linears, shared expert and the 8 routed
experts in mxfp8), seq_len 32, batch 2, lr 3e-3, `STEPS` steps from training.seed 0. Tolerance on
the mean |loss - bf16 loss|: `GAP` = 0.02, as for the dense nvfp4 run (tests/test_blockscaled_train.py):
MXFP8's e4m3 elements round each operand by up to 2^-4 of its value where bf16 rounds by 2^-9,
about 30x coarser per element and averaged over 64-128 long reductions. Measured (10 steps, one
thread, AVX512 and AVX2 alike): 0.0015 with the experts, 0.0015 with the Linears alone. Layout
errors (a transposed operand, a block across two experts' tokens) are the bit-equality tests' to
catch; this one checks that the converted model trains.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import by_step
from torchtitan_amp.config import ConfigError, load_config
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.models.moe.moe import GroupedExperts
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.grouped import BlockScaledExperts, block_scaled_grouped_mm
from torchtitan_amp.precision.lowbit.linear import block_scaled_linear
from torchtitan_amp.train import job as job_mod
from torchtitan_amp.train import trainer as trainer_module

pytestmark = pytest.mark.unit

RECIPES = {
    "mxfp8 floor": BlockScaledRecipe("mxfp8", mx_scale_mode="floor"),
    "mxfp8 rceil": BlockScaledRecipe("mxfp8"),
    "nvfp4 2d rht": BlockScaledRecipe("nvfp4", weight_2d=True, rht=True, seed=3),
    "nvfp4 1x16": BlockScaledRecipe("nvfp4"),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_gemm_is_the_loop_of_per_expert_linears_bit_for_bit(name: str) -> None:
    recipe = RECIPES[name]
    torch.manual_seed(0)
    sizes, k, n = [5, 0, 37, 16], 64, 96  # an empty expert; groups not multiples of 16 or 32
    x = torch.randn(sum(sizes), k, dtype=torch.bfloat16) * 3
    w = torch.randn(len(sizes), k, n, dtype=torch.float32) * 0.05
    dy = torch.randn(sum(sizes), n, dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = block_scaled_grouped_mm(xg, wg, sizes, recipe)
    y.backward(dy)
    for e, (xe, dye) in enumerate(zip(x.split(sizes), dy.split(sizes))):
        if not sizes[e]:
            assert torch.equal(wg.grad[e], torch.zeros(k, n))
            continue
        xl, wl = xe.clone().requires_grad_(), w[e].t().contiguous().requires_grad_()
        yl = block_scaled_linear(xl, wl, None, recipe)
        yl.backward(dye)
        rows = slice(sum(sizes[:e]), sum(sizes[: e + 1]))
        assert torch.equal(y[rows], yl), (e, "forward")
        assert torch.equal(xg.grad[rows], xl.grad), (e, "dgrad")
        assert torch.equal(wg.grad[e], wl.grad.t()), (e, "wgrad")
    assert y.dtype == xg.grad.dtype == torch.bfloat16 and wg.grad.dtype == torch.float32


def test_wgrad_blocks_do_not_straddle_token_groups() -> None:
    """Two experts' groups of 16 tokens share one 32-token block if quantized together: an outlier
    in expert 0's tokens would then set the scale of expert 1's. Per group, expert 1's weight
    gradient is the same with and without expert 0's outlier."""
    recipe = RECIPES["mxfp8 rceil"]
    torch.manual_seed(1)
    x, w, dy = torch.randn(32, 32), torch.randn(2, 32, 32), torch.randn(32, 32)
    grads = []
    for outlier in (1.0, 2.0**12):
        xo = x.clone()
        xo[:16] *= outlier
        wg = w.clone().requires_grad_()
        block_scaled_grouped_mm(xo, wg, [16, 16], recipe).backward(dy)
        grads.append(wg.grad[1])
    assert torch.equal(grads[0], grads[1])


def test_stochastic_rounding_needs_a_generator_and_groups_must_fit() -> None:
    x, w = torch.randn(8, 16), torch.randn(2, 16, 16)
    with pytest.raises(ValueError, match="pass a seeded torch.Generator"):
        block_scaled_grouped_mm(x, w, [4, 4], BlockScaledRecipe.nvfp4_full())
    with pytest.raises(ValueError, match=r"token groups \[4, 3\] do not fit x \(8, 16\) and 2 experts"):
        block_scaled_grouped_mm(x, w, [4, 3], RECIPES["mxfp8 rceil"])


# ----------------------------------------------------------------------------- the trainer

BASE = [
    "--model.name",
    "moe",
    "--model.flavor",
    "debugmodel_moe",
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
MXFP8_EXPERTS = [
    "--mixed_precision.block_scaled",
    "mxfp8",
    "--mixed_precision.block_scaled_emulate",
    "true",
    "--mixed_precision.block_scaled_experts",
    "true",
]
STEPS = 10
GAP = 0.02
EXPERT_GEMMS = [f"layers.{i}.feed_forward.experts.{w}" for i in (1, 2) for w in ("w1", "w2", "w3")]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch):
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _trainer(tmp_path: Path, *extra: str) -> trainer_module.Trainer:
    return trainer_module.Trainer(load_config([*BASE, *extra, "--job.dump_folder", str(tmp_path)]))


@pytest.mark.parametrize(
    "extra, message, error",
    [
        (
            ["--mixed_precision.block_scaled_experts", "true"],
            "'mixed_precision.block_scaled_experts' = true needs mixed_precision.block_scaled = 'mxfp8' or 'nvfp4'",
            ConfigError,
        ),
        (
            [*MXFP8_EXPERTS, "--model.name", "llama3", "--model.flavor", "debugmodel_tiny"],
            "'mixed_precision.block_scaled_experts' = true converts no grouped experts: the model has none",
            PrecisionError,
        ),
        (
            [*MXFP8_EXPERTS, "--mixed_precision.block_scaled_skip_modules", "output,layers.*.feed_forward.experts"],
            "'mixed_precision.block_scaled_experts' = true converts no grouped experts: "
            "block_scaled_edge_layers = 1 and block_scaled_skip_modules keep them all",
            PrecisionError,
        ),
    ],
)
def test_block_scaled_experts_refusals_are_one_line(extra, message, error) -> None:
    with pytest.raises(error) as e:
        job_mod.resolve(load_config([*BASE, *extra]), 2, "cpu")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_report_and_audit_see_the_experts_gemms_and_name_one_run_plain(tmp_path: Path) -> None:
    t = _trainer(tmp_path, *MXFP8_EXPERTS)
    whole = json.loads((tmp_path / "precision_report.json").read_text())
    rows = {
        g["compute_dtype"]: g["num_params"]
        for g in whole["param_groups"]
        if g["module_type"].endswith("GroupedExperts")
    }
    assert rows == {"mxfp8": 2 * 3 * 8 * 64 * 64, "bfloat16": 3 * 8 * 64 * 64}  # blocks 1-2 / block 3
    report = whole["block_scaled"]
    assert set(EXPERT_GEMMS) <= set(report["modules"])
    assert (
        report["modules"]["layers.1.feed_forward.experts.w2"]["wgrad"]
        == "dy^T mxfp8 e4m3 1x32 e8m0 (rceil); x^T mxfp8 e4m3 1x32 e8m0 (rceil)"
    )
    assert "layers.3.feed_forward.experts.w1" in report["kept_out"]
    assert "layers.1.feed_forward.router" not in json.dumps(report)  # the router is not converted
    result = t.audit()
    assert result.ok, result.breaches
    assert set(EXPERT_GEMMS) <= set(result.gemms)
    assert {ops[0][0][0] for m, p in result.gemms.items() for ops in p.values()} == {"float8_e4m3fn"}
    assert result.modules["layers.1.feed_forward.experts"] == {"forward matmul": ["float32"]}
    assert result.modules["layers.3.feed_forward.experts"] == {"forward matmul": ["bfloat16"]}
    t = _trainer(tmp_path / "plain", *MXFP8_EXPERTS)
    experts = t.run.model.layers["2"].feed_forward.experts
    assert isinstance(experts, GroupedExperts) and isinstance(experts.block_scaled_mm, BlockScaledExperts)
    experts.block_scaled_mm = None  # runs the plain grouped matmul in bf16
    breaches = t.audit().breaches
    assert [(b.what, b.seen) for b in breaches] == [
        (f"layers.2.feed_forward.experts.{w}: {p} GEMM", ["no block-scaled GEMM (ran as a plain matmul)"])
        for w in ("w1", "w2", "w3")
        for p in ("forward", "dgrad", "wgrad")
    ]


def test_mxfp8_with_experts_trains_within_the_gap_of_bf16(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the emulation's many small ops wait on a second thread when it is shared
    curves = {}
    try:
        for name, extra in {"bf16": [], "mxfp8": MXFP8_EXPERTS}.items():
            torch.manual_seed(0)
            _trainer(tmp_path / name, "--training.steps", str(STEPS), *extra).train()
            losses = by_step(tmp_path / name)
            curves[name] = [losses[s]["loss"] for s in sorted(losses)]
    finally:
        torch.set_num_threads(threads)
    gap = sum(abs(a - b) for a, b in zip(curves["mxfp8"], curves["bf16"])) / STEPS
    assert 0 < gap < GAP, (gap, curves)
    assert curves["mxfp8"][-1] < curves["mxfp8"][0] - 0.5, curves


def test_stochastic_rounding_of_experts_is_seeded_per_step(tmp_path: Path) -> None:
    """nvfp4 (SR on gradients) with experts: each experts module has its own stream after the
    Linears', and block_scaled.seed_step reseeds it from (seed, stream, step) as it does a
    Linear's, so a resumed run draws what the uninterrupted one drew."""
    from torchtitan_amp.precision import block_scaled

    t = _trainer(
        tmp_path,
        "--mixed_precision.block_scaled",
        "nvfp4",
        "--mixed_precision.block_scaled_emulate",
        "true",
        "--mixed_precision.block_scaled_experts",
        "true",
    )
    holders = [
        m.experts.block_scaled_mm for m in (t.run.model.layers["1"].feed_forward, t.run.model.layers["2"].feed_forward)
    ]
    assert holders[0].recipe.stochastic_rounding and holders[0].sr_stream != holders[1].sr_stream
    draws = []
    for step in (3, 4, 3):
        block_scaled.seed_step([t.run.model], step, rank=0)
        draws.append([torch.rand(4, generator=h.generator) for h in holders])
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[2]))
    assert not torch.equal(draws[0][0], draws[1][0]) and not torch.equal(draws[0][0], draws[0][1])
