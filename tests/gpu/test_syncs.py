"""The GPU checks' host syncs per training step of the real Trainer on one device: the plain bf16
runs (`syncs`: dense and MoE), emulated block-scaled training (mxfp8, nvfp4) and expert
parallel's dispatch and combine on a 1-rank process group."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.gpu.runs import BF16, MOE, STEP_SYNC_BUDGET, base_args, free_memory, step_syncs, sync_budget_kept
from tests.gpu.test_device_ops import one_rank_group
from torchtitan_amp.train.trainer import Trainer

pytestmark = pytest.mark.gpu

# Steps each counted run trains: step 1 builds lazily and is not counted; the count is the same
# every step after it, so 3 counted steps show it (and that it holds).
COUNTED_RUN_STEPS = 4
EMULATED = {
    "mxfp8": ["--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.block_scaled_emulate", "true"],
    "nvfp4": ["--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.block_scaled_emulate", "true"],
}


def _short(a: argparse.Namespace, work: Path) -> list[str]:
    return base_args(a, work) + ["--training.steps", str(COUNTED_RUN_STEPS)]


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    """The counted steps' train_step syncs (the distinct totals, and by op), in a line of the JSON."""
    steps = result["steps"].values()
    return {
        "train_step_syncs": sorted({r["train_step"] for r in steps}),
        "by_op": sorted({json.dumps(r["syncs"], sort_keys=True) for r in steps}),
    }


def check_syncs(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    for name, extra in (("dense", BF16), ("moe", [*MOE, *BF16])):
        out[name] = step_syncs(base_args(a, work / name) + extra + ["--training.steps", str(COUNTED_RUN_STEPS)])
        free_memory()
    return sync_budget_kept(out["dense"]) and sync_budget_kept(out["moe"])


def check_block_scaled_syncs(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """Host syncs per step of the debug model trained in emulated mxfp8 and nvfp4 (the full nvfp4
    recipe: per-step stochastic-rounding seeds, RHT, 2-D weight tiles); pass: every counted step's
    train_step within STEP_SYNC_BUDGET (no read per quantized operand: a non-finite one reaches
    the gradient norm's check), at the dispatcher and, on CUDA, by CUDA's own report."""
    ok = True
    for name, extra in EMULATED.items():
        out[name] = step_syncs(_short(a, work / name) + BF16 + extra)
        out[f"{name}_summary"] = _summary(out[name])
        ok = ok and sync_budget_kept(out[name])
        free_memory()
    return ok


def attach_expert_parallel(trainer: Trainer) -> int:
    """Expert parallel over the 1-rank default process group on every MoE layer of a Trainer built
    on one device: each layer dispatches through ExpertParallel (the count all-to-all and its one
    host read, the rows' all-to-all, the regrouping by local expert, the reverse all-to-all),
    what apply_ep attaches at EP degree 2 and more. The expert weights stay whole tensors (at
    EP 1 a shard is the whole). Returns the number of layers."""
    from torchtitan_amp.distributed.expert_parallel import ExpertParallel, expert_layers

    layers = [layer for part in trainer.run.model_parts for layer in expert_layers(part)]
    for layer in layers:
        layer.expert_parallel = ExpertParallel(dist.group.WORLD, 1)
    return len(layers)


def check_ep_syncs(a: argparse.Namespace, work: Path, out: dict[str, Any]) -> bool:
    """Host syncs per step of the MoE debug model in bf16 with expert parallel on a 1-rank process
    group (nccl on CUDA, gloo on CPU); pass: every counted step's train_step within
    STEP_SYNC_BUDGET + one read per EP layer forward (the split sizes), at the dispatcher and,
    on CUDA, by CUDA's own report."""
    layers: list[int] = []

    def setup(trainer: Trainer) -> None:  # the group after the Trainer: it builds as one process
        one_rank_group(a.device)
        layers.append(attach_expert_parallel(trainer))

    try:
        # The budget is known once the model is: count first, then set it from the layers.
        result = step_syncs(_short(a, work) + MOE + BF16, setup=setup)
    finally:  # the Trainer-based checks after this one expect no process group in this process
        if dist.is_initialized():
            dist.destroy_process_group()
    result["budget"] = STEP_SYNC_BUDGET + layers[0]
    out.update(
        backend="nccl" if a.device == "cuda" else "gloo",
        ep_degree=1,
        ep_layers=layers[0],
        ep=result,
        summary=_summary(result),
    )
    free_memory()
    return layers[0] > 0 and sync_budget_kept(result)


def test_syncs(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_syncs(a, tmp_path, out), out


def test_block_scaled_syncs(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_block_scaled_syncs(a, tmp_path, out), out


def test_ep_syncs(a: argparse.Namespace, tmp_path: Path, out: dict[str, Any]) -> None:
    assert check_ep_syncs(a, tmp_path, out), out
