"""Context parallel's proofs: every CP layout trains one process's curve, loss by loss
and gradient by gradient.

Same model, data and steps as tests/test_parallelisms.py (debugmodel_tiny, seq 32, 4 sequences per
step, 5 steps, lr 2e-2); each CP rank holds two of 2 x cp chunks of every sequence (head-tail), so
a CP layout computes exactly one process's step with another summation order:

- fp32: loss within FP32_LOSS_RTOL of one process at every step, and every parameter's step-1
  gradient (same weights, same batch) within FP32_GRAD_RTOL (norm of the difference over the norm),
  causal and block_causal, on CP 2, CP 4, CP 2 x FSDP 2, CP 2 x HSDP 2, CP 2 x TP 2 and PP 2 x CP 2.
- bf16 (the FSDP path, as CP always is): the whole curve within the precision tests' tolerances of
  fp32, and step 1 within SPLIT_MATMUL_STEP1_SIGMAS of the same path's FSDP 2 run (CP cuts the same
  matmuls along the sequence instead of the batch, so they round in other places).
- Tokens are counted once per step (torchtitan#2983 counted them cp times); the logged loss is the
  window's (torchtitan#3280 showed it halved under TP + CP): the parity above is on logged losses.
- Labels partly set to -100 (MASKED_LAYOUTS, loss normalisation by the step's global count of
  valid labels: docs/parallelisms.md): FSDP 2, FSDP 2 x accumulation 2, CP 2, TP 2 (loss parallel)
  and PP 2 equal one process on the same masked batches, within the fp32 bounds above. These runs
  join the 1- and 2-process launches.

Three launches (1, 2 and 4 processes), each training its runs one after another
(tests/workers/layouts.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.inputs import write_short_documents
from tests.support.launch import launch_worker
from tests.support.tolerances import CURVE_MEAN_TOL, CURVE_TOL, SPLIT_MATMUL_STEP1_SIGMAS
from tests.test_parallelisms import (
    GLOBAL_BATCH,
    PP,
    REPLICATE,
    SCHEDULE,
    SHARD,
    STEPS,
    TP,
    Layout,
    Run,
    bf16_rounding_sigma,
    max_rel,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CP = "--parallelism.context_parallel_degree"
SEQ_LEN = 32
# The bounds: fp32 CP reorders sums only (measured: see the printed values).
FP32_LOSS_RTOL = 1e-6
FP32_GRAD_RTOL = 1e-5

LAYOUTS = {
    "cp2": Layout(2, (CP, "2")),
    "cp4": Layout(4, (CP, "4")),
    "cp2_fsdp2": Layout(4, (CP, "2", SHARD, "2"), dp=2),
    # HSDP: replicas of 2 ranks that shard over cp alone.
    "cp2_hsdp2": Layout(4, (CP, "2", REPLICATE, "2", SHARD, "1"), dp=2),
    "cp2_tp2": Layout(4, (CP, "2", TP, "2"), tp=True),
    "pp2_cp2": Layout(4, (PP, "2", CP, "2", SCHEDULE, "1F1B")),
}
FSDP2 = Layout(2, (SHARD, "2"), dp=2)
SINGLE = Layout(1, ())
DOC_MASK_LAYOUTS = ("cp2", "cp2_fsdp2", "cp2_tp2", "pp2_cp2")
ACCUM = ("--training.local_batch_size", "2", "--training.global_batch_size", str(GLOBAL_BATCH))
# Labels partly set to -100 (tests/workers/layouts.py's mask_labels): the loss is normalised by the
# step's global count of valid labels on every layout. Step 1 of FSDP 2 puts 32 valid labels on
# rank 0 and none on rank 1; PP's microbatches of one window hold 16, 0, 16 and 0.
MASKED_LAYOUTS = {
    "fsdp2": FSDP2,
    "fsdp2_accum": Layout(
        2, (SHARD, "2", "--training.local_batch_size", "1", "--training.global_batch_size", str(GLOBAL_BATCH))
    ),
    "cp2": LAYOUTS["cp2"],
    "tp2": Layout(2, (TP, "2"), tp=True),  # loss parallel: the sum of a vocab-sharded cross-entropy
    "pp2": Layout(2, (PP, "2", SCHEDULE, "1F1B")),
}


def _runs_for(nproc: int, docs: Path) -> list[dict]:
    masked = ("--training.dataset", f"path:{docs}", "--model.attn_mask_type", "block_causal")
    named = {"single": SINGLE, **LAYOUTS}
    runs = [
        {"name": f"{name}_fp32", "args": layout.args("fp32"), "grads": True}
        for name, layout in named.items()
        if layout.nproc == nproc
    ]
    runs += [
        {"name": f"docmask_{name}_fp32", "args": layout.args("fp32", *masked), "grads": True}
        for name, layout in named.items()
        if layout.nproc == nproc and name in ("single", *DOC_MASK_LAYOUTS)
    ]
    if nproc == 2:
        runs += [
            {"name": "cp2_bf16", "args": LAYOUTS["cp2"].args("bf16")},
            {"name": "fsdp2_bf16", "args": FSDP2.args("bf16")},
            # The step's 4 sequences as 2 accumulated micro-batches of 2.
            {"name": "cp2_accum_fp32", "args": LAYOUTS["cp2"].args("fp32", *ACCUM), "grads": True},
        ]
    # Last in their launches: before the normalisation by the global count these raised (NaN).
    runs += [
        {"name": f"masked_{name}_fp32", "args": layout.args("fp32"), "grads": True, "mask_labels": True}
        for name, layout in {"single": SINGLE, **MASKED_LAYOUTS}.items()
        if layout.nproc == nproc
    ]
    return runs


class Launches:
    def __init__(self, root: Path) -> None:
        self.root, self.outputs = root, {}
        self.docs = write_short_documents(root / "docs.jsonl")

    def run(self, name: str, nproc: int) -> Run:
        key = f"nproc{nproc}"
        if key not in self.outputs:
            self.outputs[key] = f"the {key} launch did not finish"
            result = launch_worker(
                "layouts", self.root / key, _runs_for(nproc, self.docs), nproc, timeout=600, check=False
            )
            self.outputs[key] = result.describe(6000)
        return Run(name, self.root / key / name, self.outputs[key])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("cp_layouts"))


def _grads(run: Run) -> dict[str, torch.Tensor]:
    """Every parameter's full step-1 gradient, from whichever rank holds it."""
    run.ranks()  # fails the test with the run's error if it raised
    grads: dict[str, torch.Tensor] = {}
    for path in sorted(run.folder.glob("grads_rank*.pt")):
        grads.update(torch.load(path))
    return grads


def _compare(run: Run, ref: Run, label: str) -> None:
    loss_rel, norm_rel = max_rel(run.losses, ref.losses), max_rel(run.grad_norms, ref.grad_norms)
    got, want = _grads(run), _grads(ref)
    assert sorted(got) == sorted(want) and len(want) > 10
    grad_rel = {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want}
    worst = max(grad_rel, key=grad_rel.get)
    print(
        f"\n[cp fp32] {label}: max rel loss diff {loss_rel:.2e}, grad norm {norm_rel:.2e}, worst parameter "
        f"step-1 gradient {grad_rel[worst]:.2e} ({worst}), losses over {STEPS} steps"
    )
    assert loss_rel < FP32_LOSS_RTOL, (run.losses, ref.losses)
    assert grad_rel[worst] < FP32_GRAD_RTOL, sorted(grad_rel.items(), key=lambda kv: -kv[1])[:5]
    assert ref.losses[-1] < ref.losses[0] - 1  # a real training curve, not a constant


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp32_cp_matches_one_process(trained: Launches, name: str) -> None:
    layout = LAYOUTS[name]
    run = trained.run(f"{name}_fp32", layout.nproc)
    _compare(run, trained.run("single_fp32", 1), name)
    report = run.report["context_parallel"]
    cp = int(layout.overrides[layout.overrides.index(CP) + 1])
    assert report["degree"] == cp and report["kv_grad_reduce_scatter_dtype"] == "float32"
    ranks = run.ranks()
    assert all(r["degrees"]["cp"] == cp for r in ranks)
    # Tokens counted once per cp group: the step's 4 x 32 tokens, not cp times as many.
    assert {r["tokens_seen"] for r in ranks} == {STEPS * GLOBAL_BATCH * SEQ_LEN}


@pytest.mark.parametrize("name", DOC_MASK_LAYOUTS)
def test_document_masking_under_cp_matches_one_process(trained: Launches, name: str) -> None:
    """block_causal: the document ids of the whole window follow each rank's chunks (the keys'
    are gathered with the keys), so CP masks at the same boundaries as one process."""
    _compare(
        trained.run(f"docmask_{name}_fp32", LAYOUTS[name].nproc),
        trained.run("docmask_single_fp32", 1),
        f"block_causal {name}",
    )


def test_gradient_accumulation_under_cp_matches_one_process(trained: Launches) -> None:
    """Two accumulated micro-batches of 2 sequences, each cut over 2 cp ranks: the step's mean loss
    and gradients are one process's single batch of 4."""
    _compare(trained.run("cp2_accum_fp32", 2), trained.run("single_fp32", 1), "cp2, 2 micro-batches")


@pytest.mark.parametrize("name", list(MASKED_LAYOUTS))
def test_masked_labels_match_one_process(trained: Launches, name: str) -> None:
    """Labels set to -100 in unequal numbers per rank, micro-batch and pipeline microbatch (some
    none valid): each layout's loss and gradients are one process's mean over the valid labels."""
    run = trained.run(f"masked_{name}_fp32", MASKED_LAYOUTS[name].nproc)
    _compare(run, trained.run("masked_single_fp32", 1), f"masked labels, {name}")


def test_masked_labels_are_unequal_across_ranks_and_micro_batches(trained: Launches) -> None:
    """What the test above rests on: the masked counts differ where a per-part mean would be wrong."""
    single = trained.run("masked_single_fp32", 1).ranks()[0]["valid_labels"]
    assert len(single) == STEPS and 0 < min(single) < max(single) < GLOBAL_BATCH * SEQ_LEN, single
    fsdp = [r["valid_labels"] for r in trained.run("masked_fsdp2_fp32", 2).ranks()]
    assert [a + b for a, b in zip(*fsdp)] == single
    assert fsdp[0][0] > 0 == fsdp[1][0], fsdp  # step 1: one rank holds no valid label at all
    accum = [r["valid_labels"] for r in trained.run("masked_fsdp2_accum_fp32", 2).ranks()]
    assert len(accum[0]) == 2 * STEPS and len({*accum[0][:2], *accum[1][:2]}) > 1, accum


def test_bf16_cp_within_precision_tolerance(trained: Launches) -> None:
    fp32, run = trained.run("single_fp32", 1), trained.run("cp2_bf16", 2)
    same_path = trained.run("fsdp2_bf16", 2)
    deltas = [a - b for a, b in zip(run.losses, fp32.losses)]
    step1 = abs(run.losses[0] - same_path.losses[0])
    sigma = bf16_rounding_sigma()
    print(
        f"\n[cp bf16] cp2: vs fp32 max |d| {max(map(abs, deltas)):.2e}, mean d {sum(deltas) / len(deltas):+.2e}; "
        f"step 1 vs FSDP 2 bf16 {step1:.1e} ({step1 / sigma:.2f} sigma)"
    )
    assert max(map(abs, deltas)) < CURVE_TOL and abs(sum(deltas) / len(deltas)) < CURVE_MEAN_TOL, deltas
    assert step1 < SPLIT_MATMUL_STEP1_SIGMAS * sigma, (run.losses, same_path.losses)
    report = run.report
    assert report["path"] == "fsdp"
    assert report["context_parallel"]["kv_all_gather_dtype"] == "bfloat16"
    assert report["context_parallel"]["kv_grad_reduce_scatter_dtype"] == "float32"
