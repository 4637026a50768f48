"""Context parallel composed with activation checkpointing and torch.compile.

- Activation checkpointing (full, and op-level selective) on CP 2, fp32 and bf16, and op-level
  SAC with document masking (block_causal): the same losses and gradient norms as the run
  without AC, bit for bit. The recompute runs the K/V all-gather again (it is not on the SAC save
  list), on every cp rank in the same order.
- torch.compile (per-block) on CP 2 in fp32: dynamo traces the K/V gather (an autograd.Function
  over functional collectives) and the chunked causal attention without a graph break (fp32
  compiles fullgraph, so a break would fail the run); losses equal eager's to fp32 rounding.
  (bf16 compiled vs eager measured 4.0e-5 on torch 2.13, 7.5e-5 on 2.11; CP 2 x FSDP 2 with AC,
  compile, compile + full AC and compile + op SAC bit-identical to eager in fp32: left out of the
  suite for its time, cold compiles and a 4-rank launch.) The compiled run goes first so that its
  blocks meet empty context_parallel caches, as in a fresh process: run after the eager ones it
  passed while a fresh compiled CP run failed (dynamo cannot trace CausalBias's creation).

- FlexAttention on CP 2 (forward, no grad: torch has no FlexAttention backward on CPU): over the
  gathered keys with a BlockMask placed by window position, its logits equal SDPA's on CP 2 and
  one process's, for documents (Llama), gpt-oss's sliding window and sinks, and both.

Two launches: the training one (tests/workers/layouts.py): CP 2, the compiled run first (fresh
caches), then eager and AC; and the flex forwards' (tests/workers/cp_flex.py, 2 ranks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.inputs import write_short_documents
from tests.support.launch import launch_worker
from tests.support.machine import NO_COMPILER, c_compiler
from tests.test_flex_attention import MODEL_ATOL

pytestmark = pytest.mark.dist

BASE = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.steps",
    "3",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--training.gc_freq",
    "0",
]
PRECISIONS = {"fp32": ["--mixed_precision.enabled", "false"], "bf16": ["--mixed_precision.param_dtype", "bfloat16"]}
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
AC = {
    "none": [],
    "full": ["--activation_checkpoint.mode", "full"],
    "op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
}
N_LAYERS = 4  # debugmodel_tiny
AC_WRAPPED = {
    "none": [],
    "full": [f"layers.{i}" for i in range(N_LAYERS)],
    "op": [f"layers.{i}" for i in range(N_LAYERS)],
}  # a dense block is one op-SAC region
COMPILED = [f"layers.{i}" for i in range(N_LAYERS)]
# fp32 compiled vs eager on CP 2: losses measured equal, grad norms 1e-7 apart on torch 2.13
# (inductor's fused reductions sum in another order), bit-identical on 2.11.
COMPILE_FP32_RTOL = 1e-6


def _runs(layout: list[str], prefix: str) -> list[dict]:
    return [
        {"name": f"{prefix}_{p}_ac_{mode}", "args": [*BASE, *layout, *PRECISIONS[p], *AC[mode]]}
        for p in PRECISIONS
        for mode in AC
    ]


class Launches:
    """The launch, run once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.outputs = root, {}
        self.docs = write_short_documents(root / "docs.jsonl")

    def runs(self, key: str) -> list[dict]:
        masked = [
            "--training.dataset",
            f"path:{self.docs}",
            "--model.attn_mask_type",
            "block_causal",
            *PRECISIONS["fp32"],
        ]
        # The compiled run first: its blocks then find context_parallel's caches empty, as in a
        # fresh training process (the bias they need must be made outside the compiled region).
        return [
            {"name": "cp2_fp32_compile", "args": [*BASE, *CP2, *PRECISIONS["fp32"], "--compile.enable", "true"]},
            *_runs(CP2, key),
            {"name": "cp2_docmask_ac_none", "args": [*BASE, *CP2, *masked]},
            {"name": "cp2_docmask_ac_op", "args": [*BASE, *CP2, *masked, *AC["op"]]},
        ]

    def folder(self, key: str, name: str) -> Path:
        if key not in self.outputs:
            nproc = 2
            self.outputs[key] = f"the {key} launch did not finish"
            result = launch_worker("layouts", self.root / key, self.runs(key), nproc, timeout=600, check=False)
            self.outputs[key] = result.describe(6000)
        folder = self.root / key / name
        errors = sorted(folder.glob("error_rank*.txt"))
        if errors:
            pytest.fail(f"{name} raised:\n{errors[0].read_text()[-4000:]}")
        if not (folder / "wall_s.txt").is_file():
            pytest.fail(f"{name} did not finish:\n{self.outputs[key][-4000:]}")
        return folder


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Launches:
    return Launches(tmp_path_factory.mktemp("cp_compose"))


def _curve(folder: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows), rows
    return [(r["loss"], r["grad_norm"]) for r in rows]


def _ranks(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


@pytest.mark.parametrize("mode", ["full", "op"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_activation_checkpointing_keeps_the_loss_bitwise_under_cp(
    launches: Launches, precision: str, mode: str
) -> None:
    key = "cp2"
    plain = launches.folder(key, f"{key}_{precision}_ac_none")
    ac = launches.folder(key, f"{key}_{precision}_ac_{mode}")
    assert _curve(ac) == _curve(plain)
    ranks = _ranks(ac)
    assert len(ranks) == 2
    assert all(r["checkpoint_wrapped"] == AC_WRAPPED[mode] for r in ranks)
    assert all(r["checkpoint_wrapped"] == [] for r in _ranks(plain))
    # The cp dim really is in the mesh: each cp rank held its own chunks.
    assert all(r["mesh_dim_names"][3] == "cp" and r["mesh_shape"][3] == 2 for r in ranks)


def test_activation_checkpointing_keeps_the_document_mask_bitwise_under_cp(launches: Launches) -> None:
    assert _curve(launches.folder("cp2", "cp2_docmask_ac_op")) == _curve(launches.folder("cp2", "cp2_docmask_ac_none"))
    # The mask changed the curve (the documents are short): the masked runs did not run causal.
    assert _curve(launches.folder("cp2", "cp2_docmask_ac_none")) != _curve(launches.folder("cp2", "cp2_fp32_ac_none"))


@pytest.mark.skipif(c_compiler() is None, reason=NO_COMPILER)
def test_compile_keeps_the_loss_under_cp(launches: Launches) -> None:
    compiled = launches.folder("cp2", "cp2_fp32_compile")
    eager = _curve(launches.folder("cp2", "cp2_fp32_ac_none"))
    got = _curve(compiled)
    rel = max(abs(a - b) / b for pair_got, pair_eager in zip(got, eager) for a, b in zip(pair_got, pair_eager))
    print(f"\n[compile] CP 2 fp32 compiled vs eager: max rel diff (loss, grad norm) {rel:.1e}")
    assert rel <= COMPILE_FP32_RTOL, (got, eager)
    assert [loss for loss, _ in got] == [loss for loss, _ in eager]
    for rank in _ranks(compiled):
        assert rank["compiled"] == COMPILED and rank["dynamo_unique_graphs"] >= 1


CP_CASES = {
    "block_causal": {"family": "llama3", "documents": True},
    "sliding_window_sinks": {"family": "gpt_oss", "documents": False},
    "sliding_window_sinks_block_causal": {"family": "gpt_oss", "documents": True},
}


@pytest.fixture(scope="module")
def cp_forwards() -> dict[str, dict[str, float]]:
    """One 2-rank gloo launch (tests/workers/cp_flex.py): every case's no-grad forward on cp 2."""
    from tests.support.launch import run_distributed
    from tests.workers import cp_flex

    return run_distributed(cp_flex.forward_under_cp, 2, CP_CASES, timeout=400)[0]


@pytest.mark.parametrize("case", list(CP_CASES))
def test_flex_under_context_parallel_equals_sdpa_and_one_process(cp_forwards: dict, case: str) -> None:
    """Under CP 2 (head-tail chunks: rank 0 holds window positions [0, 16) and [48, 64), rank 1
    [16, 48)), flex over the gathered keys with the BlockMask placed by window position equals
    SDPA on CP and one process: Llama with documents, gpt-oss's sinks (the fp32 lse merge) with its
    16-key sliding window (which cuts every query past position 15) without and with documents.
    Every layer ran FlexAttention on the flex forward, none on SDPA's. Bound: MODEL_ATOL, as for
    flex vs SDPA on one process (tests/test_flex_attention.py: the same sums in other orders)."""
    got = cp_forwards[case]
    print(f"\n[flex cp2] {case}: {got}")
    assert got["flex_calls"] == got["layers"] and got["sdpa_flex_calls"] == 0, got
    for key in ("flex_vs_one", "sdpa_vs_one", "flex_vs_sdpa"):
        assert got[key] <= MODEL_ATOL, (key, got)
