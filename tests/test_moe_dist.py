"""The MoE family's proofs on gloo layouts: every layout trains one process's curve
with the same routing, and a checkpoint resumes bit for bit.

debugmodel_moe (dim 64, 4 blocks of which 3 MoE: 8 experts top 2 plus a shared expert; bias
balancing) and debugmodel_qwen3 (QK-norm, GQA, explicit head_dim, every block MoE), seq 32,
4 sequences per step, 5 steps, from the same seed and data:

- fp32: loss within FP32_LOSS_RTOL of one process at every step, every parameter's step-1
  gradient within FP32_GRAD_RTOL, and the same routing: the logged load metrics (the most and
  least loaded expert relative to uniform, from integer token counts) are equal at every step.
  FSDP 2, TP 2 (dense parts split), PP 2, CP 2, FSDP 2 x TP 2, full AC.
- bf16 (FSDP path, fp32 routers): within the precision tests' whole-curve tolerances of fp32.
- Block-scaled experts (mxfp8, mixed_precision.block_scaled_experts) under EP 2 with FSDP 2:
  within the bf16 step-1 and curve tolerances of one process's mxfp8 run (each rank's local
  experts run their per-expert GEMMs on the tokens dispatched to them).
- DeepSeek-V3's debug shape (MLA, group-limited routing): FSDP 2, PP 2, EP 2, TP 2, CP 2 in fp32
  as above.
- DeepSeek-V3's debug shape with multi-token prediction (one depth): FSDP 2 and EP 2 in fp32 as
  above, the logged MTP loss too.
- gpt-oss's debug shape (sinks, sliding windows, biased router and experts): FSDP 2, TP 2, PP 2,
  EP 2 and CP 2 in fp32 as above.
- Resume: FSDP 2 stopped at step 3 and resumed continues with the straight run's losses, grad
  norms and loads, bitwise (the expert biases are in the checkpoint).

Expert parallel has its own tests (tests/test_expert_parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import launch_worker
from tests.support.tolerances import (
    CURVE_MEAN_TOL,
    CURVE_TOL,
    SAME_FAMILY_STEP1_TOL,
    STEP1_TOL,
    assert_step_sync_budget,
)
from tests.test_parallelisms import GLOBAL_BATCH, PP, SHARD, STEPS, TP, Layout, Run, max_rel

pytestmark = [pytest.mark.dist, pytest.mark.slow]

MOE = ("--model.name", "moe", "--model.flavor", "debugmodel_moe")
QWEN3 = ("--model.name", "moe", "--model.flavor", "debugmodel_qwen3")
FP32_LOSS_RTOL = 1e-6
FP32_GRAD_RTOL = 1e-5

LAYOUTS = {
    "fsdp2": Layout(2, (SHARD, "2"), dp=2),
    "tp2": Layout(2, (TP, "2")),
    "pp2": Layout(2, (PP, "2")),
    # Each cp rank routes its half of every sequence; the loads are summed over the cp ranks too.
    "cp2": Layout(2, ("--parallelism.context_parallel_degree", "2")),
    "ac_full": Layout(1, ("--activation_checkpoint.mode", "full")),
    "fsdp2_tp2": Layout(4, (SHARD, "2", TP, "2"), dp=2),
}
QWEN3_LAYOUTS = {"qwen3_tp2": Layout(2, (TP, "2")), "qwen3_fsdp2": Layout(2, (SHARD, "2"), dp=2)}
# The sequence-wise aux loss: a cp rank holds 2 of a sequence's 4 chunks, so its statistics are
# the cp ranks' sums; TP ranks see the same tokens and compute the same loss.
MOE_AUX = ("--model.name", "moe", "--model.flavor", "debugmodel_moe_aux")
CP = "--parallelism.context_parallel_degree"
AUX_LAYOUTS = {"aux_cp2": Layout(2, (CP, "2")), "aux_cp2_tp2": Layout(4, (CP, "2", TP, "2"))}
SINGLE = Layout(1, ())
CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "3")
OP_SAC = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op")
MXFP8_EXPERTS = (
    "--mixed_precision.block_scaled",
    "mxfp8",
    "--mixed_precision.block_scaled_emulate",
    "true",
    "--mixed_precision.block_scaled_experts",
    "true",
)
EP2 = ("--parallelism.expert_parallel_degree", "2")
# DeepSeek-V3's debug shape (models/deepseek_v3/: MLA, group-limited sigmoid routing with the
# correction bias, routed scale 2.5) on the MoE family's layouts.
DSV3 = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
DSV3_LAYOUTS = {
    "dsv3_fsdp2": Layout(2, (SHARD, "2"), dp=2),
    "dsv3_pp2": Layout(2, (PP, "2")),
    "dsv3_ep2": Layout(2, (SHARD, "2", *EP2), dp=2),
    "dsv3_tp2": Layout(2, (TP, "2")),
    "dsv3_cp2": Layout(2, (CP, "2")),
}
# DeepSeek-V3's debug shape with one multi-token prediction depth (a routed block): each depth one
# FSDP unit (its fp32 norms a nested one), its loss computed inside the depth's forward.
DSV3_MTP = ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_mtp")
DSV3_MTP_LAYOUTS = {
    "dsv3_mtp_fsdp2": Layout(2, (SHARD, "2"), dp=2),
    "dsv3_mtp_ep2": Layout(2, (SHARD, "2", *EP2), dp=2),
    # The depth in the TP plan (sequence parallel and loss parallel on, as by default): the last
    # block's sequence-sharded output gathered, the depth's S - 1 positions replicated.
    "dsv3_mtp_tp2": Layout(2, (TP, "2")),
    # The depth on the last stage, the embeddings passed along beside the hidden states.
    "dsv3_mtp_pp2": Layout(2, (PP, "2")),
}
# gpt-oss's debug shape (models/gpt_oss/: sinks, alternating 16-key sliding and full layers, YaRN,
# biases, a biased router and the clamped SwiGLU) on its layouts.
GPT_OSS = ("--model.name", "gpt_oss", "--model.flavor", "debugmodel")
GPT_OSS_LAYOUTS = {
    "gpt_oss_fsdp2": Layout(2, (SHARD, "2"), dp=2),
    "gpt_oss_tp2": Layout(2, (TP, "2")),
    "gpt_oss_pp2": Layout(2, (PP, "2")),
    "gpt_oss_ep2": Layout(2, (SHARD, "2", *EP2), dp=2),
    # Seq 32 is twice the debug window (16): a sliding layer's queries at positions 16..31 lose
    # their earliest keys. CP 2 cuts the window into chunks [0, 8) [8, 16) [16, 24) [24, 32): rank 0
    # holds [0, 8) and [24, 32), rank 1 [8, 24), so a window taken from local indices (0..15) or from
    # the keys' gathered order would keep or drop other keys than the window positions do.
    "gpt_oss_cp2": Layout(2, (CP, "2")),
}


def _runs_for(nproc: int, root: Path) -> list[dict]:
    runs = []
    if nproc == 1:
        runs += [
            {"name": "single_fp32", "args": SINGLE.args("fp32", *MOE), "grads": True},
            {"name": "qwen3_single_fp32", "args": SINGLE.args("fp32", *QWEN3), "grads": True},
            {"name": "aux_single_fp32", "args": SINGLE.args("fp32", *MOE_AUX), "grads": True},
            {"name": "single_mxfp8_experts", "args": SINGLE.args("bf16", *MOE, *MXFP8_EXPERTS)},
            {"name": "dsv3_single_fp32", "args": SINGLE.args("fp32", *DSV3), "grads": True},
            {"name": "dsv3_mtp_single_fp32", "args": SINGLE.args("fp32", *DSV3_MTP), "grads": True},
            {"name": "gpt_oss_single_fp32", "args": SINGLE.args("fp32", *GPT_OSS), "grads": True},
        ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *MOE), "grads": True}
        for name, layout in LAYOUTS.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *QWEN3), "grads": True}
        for name, layout in QWEN3_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *MOE_AUX), "grads": True}
        for name, layout in AUX_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *DSV3), "grads": True}
        for name, layout in DSV3_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *DSV3_MTP), "grads": True}
        for name, layout in DSV3_MTP_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"{name}_fp32", "args": layout.args("fp32", *GPT_OSS), "grads": True}
        for name, layout in GPT_OSS_LAYOUTS.items()
        if layout.nproc == nproc
    ]
    if nproc == 2:
        fsdp = LAYOUTS["fsdp2"]
        runs.append({"name": "fsdp2_bf16", "args": fsdp.args("bf16", *MOE)})
        # Under op-level SAC: the routers' fp32 groups and the EP experts' efsdp groups are FSDP
        # units inside the recomputed feed-forward (parallelize.recomputed_whole); it crashed before.
        runs.append(
            {"name": "ep2_bf16", "args": fsdp.args("bf16", *MOE, "--parallelism.expert_parallel_degree", "2", *OP_SAC)}
        )
        runs.append({"name": "ep2_mxfp8_experts", "args": fsdp.args("bf16", *MOE, *EP2, *MXFP8_EXPERTS)})
        # Checkpoints at steps 3 and 5; then the same folder again, resuming from step 3.
        runs += [
            {"name": "resumed", "args": fsdp.args("fp32", *MOE, *CKPT, *again)}
            for again in ((), ("--checkpoint.load_step", "3"))
        ]
    if nproc == 4:
        # EP 2 x TP 2 in bf16 (sequence parallel, the MoE layer replicated over tp, experts split by EP).
        runs.append(
            {
                "name": "ep2_tp2_bf16",
                "args": LAYOUTS["fsdp2_tp2"].args("bf16", *MOE, "--parallelism.expert_parallel_degree", "2"),
            }
        )
    return runs


class Launches:
    def __init__(self, root: Path) -> None:
        self.root, self.outputs = root, {}

    def run(self, name: str, nproc: int) -> Run:
        key = f"nproc{nproc}"
        if key not in self.outputs:
            self.outputs[key] = f"the {key} launch did not finish"
            result = launch_worker(
                "layouts", self.root / key, _runs_for(nproc, self.root), nproc, timeout=600, check=False
            )
            self.outputs[key] = result.describe(6000)
        return Run(name, self.root / key / name, self.outputs[key])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("moe_layouts"))


def _grads(run: Run) -> dict[str, torch.Tensor]:
    run.ranks()
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(run.folder.glob("grads_rank*.pt")):
        grads.update(torch.load(path))
    return grads


def _loads(run: Run) -> list[tuple[float, float]]:
    return [(r["moe_load_max"], r["moe_load_min"]) for r in run.rows]


def _compare(run: Run, ref: Run, label: str) -> None:
    loss_rel = max_rel(run.losses, ref.losses)
    got, want = _grads(run), _grads(ref)
    assert sorted(got) == sorted(want)
    grad_rel = {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0}
    worst = max(grad_rel, key=grad_rel.get)
    print(
        f"\n[moe fp32] {label}: max rel loss diff {loss_rel:.2e}, worst step-1 gradient {grad_rel[worst]:.2e} "
        f"({worst}), loads {_loads(run)[-1]}"
    )
    assert loss_rel < FP32_LOSS_RTOL, (run.losses, ref.losses)
    assert grad_rel[worst] < FP32_GRAD_RTOL, sorted(grad_rel.items(), key=lambda kv: -kv[1])[:5]
    # Identical routing: the loads come from integer counts, so they agree exactly or not at all.
    assert _loads(run) == _loads(ref)
    assert ref.losses[-1] < ref.losses[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_moe_matches_one_process(trained: Launches, name: str) -> None:
    _compare(trained.run(f"{name}_fp32", LAYOUTS[name].nproc), trained.run("single_fp32", 1), name)


@pytest.mark.parametrize("name", list(QWEN3_LAYOUTS))
def test_fp32_qwen3_shape_matches_one_process(trained: Launches, name: str) -> None:
    """QK-norm under TP: each rank normalises its own heads; the norm weights' gradients are summed
    over the TP ranks."""
    _compare(trained.run(f"{name}_fp32", QWEN3_LAYOUTS[name].nproc), trained.run("qwen3_single_fp32", 1), name)


@pytest.mark.parametrize("name", list(DSV3_LAYOUTS))
def test_fp32_deepseek_v3_matches_one_process(trained: Launches, name: str) -> None:
    """MLA and DeepSeek-V3's routing on FSDP 2, PP 2, EP 2, TP 2 (heads split, latents replicated)
    and CP 2 (the expanded keys and values gathered): one process's losses, gradients and loads."""
    _compare(trained.run(f"{name}_fp32", DSV3_LAYOUTS[name].nproc), trained.run("dsv3_single_fp32", 1), name)


@pytest.mark.parametrize("name", list(DSV3_MTP_LAYOUTS))
def test_fp32_deepseek_v3_mtp_matches_one_process(trained: Launches, name: str) -> None:
    """Multi-token prediction on FSDP 2, EP 2 (the depth's routed experts split too), TP 2 (the
    depth's block split as the main blocks, eh_proj row-wise, the shared head loss-parallel) and
    PP 2 (the depth on the last stage, the embeddings passed along to it): one
    process's losses, logged MTP losses, step-1 gradients (the depth's included) and loads."""
    run, ref = trained.run(f"{name}_fp32", DSV3_MTP_LAYOUTS[name].nproc), trained.run("dsv3_mtp_single_fp32", 1)
    _compare(run, ref, name)
    mtp, want = [r["mtp_loss"] for r in run.rows], [r["mtp_loss"] for r in ref.rows]
    print(f"[moe mtp] {name}: max rel MTP loss diff {max_rel(mtp, want):.2e}")
    assert max_rel(mtp, want) < FP32_LOSS_RTOL, (mtp, want)
    assert any(n.startswith("mtp.4.") for n in _grads(run)), sorted(_grads(run))


@pytest.mark.parametrize("name", list(GPT_OSS_LAYOUTS))
def test_fp32_gpt_oss_matches_one_process(trained: Launches, name: str) -> None:
    """Sinks, sliding windows and biased experts on FSDP 2, TP 2 (heads, their biases and their
    sinks split), PP 2 (a sliding and a full block per stage), EP 2 (the expert biases split
    with their experts) and CP 2 (keys and values gathered, the window and causal masks by window
    position, the sinks in the fp32 softmax): one process's losses, gradients and loads."""
    _compare(trained.run(f"{name}_fp32", GPT_OSS_LAYOUTS[name].nproc), trained.run("gpt_oss_single_fp32", 1), name)


@pytest.mark.parametrize("name", list(AUX_LAYOUTS))
def test_fp32_sequence_aux_loss_matches_one_process(trained: Launches, name: str) -> None:
    """The logged aux loss is the whole sequences' (all cp ranks' statistics), and the loss and
    gradients it drives match one process's."""
    run, ref = trained.run(f"{name}_fp32", AUX_LAYOUTS[name].nproc), trained.run("aux_single_fp32", 1)
    _compare(run, ref, name)
    aux, want = [r["moe_aux_loss"] for r in run.rows], [r["moe_aux_loss"] for r in ref.rows]
    print(f"[moe aux] {name}: aux losses {aux} vs one process {want}")
    assert max_rel(aux, want) < FP32_LOSS_RTOL


def test_bf16_moe_within_precision_tolerance(trained: Launches) -> None:
    fp32, run = trained.run("single_fp32", 1), trained.run("fsdp2_bf16", 2)
    deltas = [a - b for a, b in zip(run.losses, fp32.losses)]
    print(f"\n[moe bf16] fsdp2: vs fp32 max |d| {max(map(abs, deltas)):.2e}, mean {sum(deltas) / len(deltas):+.2e}")
    assert max(map(abs, deltas)) < CURVE_TOL and abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas
    report = run.report
    assert report["path"] == "fsdp" and report["router"]["router_dtype"] == "float32"


def test_bf16_expert_parallel_dispatches_in_bf16(trained: Launches) -> None:
    """EP under bf16 FSDP with op-level SAC: tokens travel in bf16 (what the experts compute in),
    the curve stays within the whole-curve tolerance of fp32, routers in fp32."""
    fp32, run = trained.run("single_fp32", 1), trained.run("ep2_bf16", 2)
    deltas = [a - b for a, b in zip(run.losses, fp32.losses)]
    print(f"\n[moe bf16] ep2: vs fp32 max |d| {max(map(abs, deltas)):.2e}, mean {sum(deltas) / len(deltas):+.2e}")
    assert max(map(abs, deltas)) < CURVE_TOL and abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas
    ep = run.report["expert_parallel"]
    assert (ep["degree"], ep["dispatch_dtype"], ep["combine_dtype"]) == (2, "bfloat16", "bfloat16")
    assert run.report["router"]["router_dtype"] == "float32"


def test_block_scaled_experts_under_expert_parallel_train_as_one_process(trained: Launches) -> None:
    """mxfp8 with block-scaled experts on EP 2 x FSDP 2 against one process's mxfp8 run: step 1
    and the curve within the bf16 tolerances (measured 8.2e-4 and 3.0e-3, where the bf16 runs of
    the two layouts differ by 6.3e-4 and 1.1e-3: FSDP's bf16-gathered weights); the recipe ran (step
    1 is not EP 2 bf16's: measured 1.6e-4 apart) and the report names every local experts module's
    GEMMs (each rank holds 4 of the 8 experts of blocks 1-2)."""
    run, ref, bf16 = (
        trained.run("ep2_mxfp8_experts", 2),
        trained.run("single_mxfp8_experts", 1),
        trained.run("ep2_bf16", 2),
    )
    step1 = abs(run.losses[0] - ref.losses[0])
    curve = max(abs(a - b) for a, b in zip(run.losses, ref.losses))
    print(
        f"\n[block-scaled experts] ep2 mxfp8: step 1 vs one process {step1:.1e}, curve max |d| {curve:.1e}; "
        f"vs ep2 bf16 at step 1 {run.losses[0] - bf16.losses[0]:+.1e}"
    )
    assert len(run.losses) == STEPS and step1 < STEP1_TOL and curve < CURVE_TOL, (run.losses, ref.losses)
    assert abs(run.losses[0] - bf16.losses[0]) > SAME_FAMILY_STEP1_TOL, (run.losses, bf16.losses)
    experts = {m for m in run.report["block_scaled"]["modules"] if ".experts." in m}
    assert experts == {f"layers.{i}.feed_forward.experts.{w}" for i in (1, 2) for w in ("w1", "w2", "w3")}, experts
    assert run.report["expert_parallel"]["degree"] == 2


def test_bf16_expert_parallel_under_tensor_parallel(trained: Launches) -> None:
    """EP 2 x TP 2 under bf16 FSDP: the curve within the whole-curve tolerance of fp32, tokens in
    bf16, routers in fp32 (the audit checks its collectives: tests/test_audit.py)."""
    fp32, run = trained.run("single_fp32", 1), trained.run("ep2_tp2_bf16", 4)
    deltas = [a - b for a, b in zip(run.losses, fp32.losses)]
    print(f"\n[moe bf16] ep2 x tp2: vs fp32 max |d| {max(map(abs, deltas)):.2e}, mean {sum(deltas) / len(deltas):+.2e}")
    assert len(deltas) == STEPS
    assert max(map(abs, deltas)) < CURVE_TOL and abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas
    assert run.report["expert_parallel"]["dispatch_dtype"] == "bfloat16"
    assert run.report["router"]["router_dtype"] == "float32"


def test_resume_is_bitwise(trained: Launches) -> None:
    straight, resumed = trained.run("fsdp2_fp32", 2), trained.run("resumed", 2)
    resumed.ranks()
    rows = [json.loads(line) for line in (resumed.folder / "metrics.jsonl").read_text().splitlines() if line]
    after = rows[-2:]  # the resumed run's steps
    assert [r["step"] for r in after] == [4, 5], rows
    want = straight.rows[3:]
    for key in ("loss", "grad_norm", "moe_load_max", "moe_load_min"):
        assert [r[key] for r in after] == [r[key] for r in want], (key, after, want)
    assert all(r["tokens_seen"] == STEPS * GLOBAL_BATCH * 32 for r in resumed.ranks())


# Every run trained from step 0 (the resumed run counts no step 2), by process count.
SYNC_RUNS = [
    ("single_fp32", 1),
    ("ac_full_fp32", 1),
    ("fsdp2_fp32", 2),
    ("tp2_fp32", 2),
    ("pp2_fp32", 2),
    ("cp2_fp32", 2),
    ("fsdp2_bf16", 2),
    ("ep2_bf16", 2),
    ("ep2_tp2_bf16", 4),
]


@pytest.mark.parametrize("name,nproc", SYNC_RUNS)
def test_moe_step_host_syncs(trained: Launches, name: str, nproc: int) -> None:
    """Step 2's host syncs: without EP an MoE layer reads nothing (the step's one read is the
    finiteness flag); with EP one read of the split sizes per layer forward, none in op-level
    SAC's recompute (ep2_bf16) or under TP (ep2_tp2_bf16)."""
    ranks = trained.run(name, nproc).ranks()
    assert all(bool(r["ep_layers"]) == name.startswith("ep") for r in ranks), ranks
    assert_step_sync_budget(ranks, name)
