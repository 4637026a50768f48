"""The host-sync budget (torchtitan_amp/observability/host_syncs.py counts what would stall a GPU), in one
process on CPU: the counter itself; a dense training step reads the device once (the finiteness
flag), a logging step adds its log line's reads; an MoE layer without expert parallel reads
nothing, forward, backward and balancing included; with expert parallel (a 1-rank gloo group, the
same code path as EP 2) one read per layer forward, none in an activation-checkpoint recompute
or in backward, and one count all-to-all per forward (a recompute exchanges only the rows); a
compiled bf16 MoE block has no graph break. The launched layouts' counts are checked where they
train (test_parallelisms, test_moe_dist, test_expert_parallel)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from torchtitan_amp.config import load_config
from torchtitan_amp.distributed import expert_parallel
from torchtitan_amp.distributed.expert_parallel import ExpertParallel
from torchtitan_amp.models.moe.balance import after_backward, after_step
from torchtitan_amp.models.moe.model import MOE_FLAVORS, MoETransformer
from torchtitan_amp.models.moe.moe import MoE
from torchtitan_amp.observability.host_syncs import HostSyncs, StepSyncs, uncounted
from torchtitan_amp.train.trainer import Trainer

TINY = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.steps",
    "4",
    "--metrics.log_freq",
    "2",
]
MOE = ["--model.name", "moe", "--model.flavor", "debugmodel_moe"]
# The one read of a training step: trainer.train_step's torch.isfinite(grad_norm) (fp32 / bf16),
# the loss scale after GradScaler.update (fp16 with a fused optimizer, which takes found_inf on
# the device); a non-fused fp16 optimizer adds GradScaler.step's own read of found_inf.
STEP_BUDGET = 1
# A logging step's line: the mean loss and the gradient norm, plus the family's metrics (MoE: the
# most and least loaded expert).
LOG_READS = {"dense": 2, "moe": 4}


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


# ---------------------------------------------------------------------------------------------
# The counter


def _count(fn) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with HostSyncs() as syncs:
        fn()
    return dict(syncs.counts)


def test_counter_sees_every_kind_of_sync_and_nothing_else() -> None:
    t, mask, i = torch.arange(6.0), torch.arange(6) % 2 == 0, torch.tensor([1, 2])
    syncing = {
        "_local_scalar_dense": [lambda: t[0].item(), lambda: bool(t[1]), lambda: float(t[0]), lambda: int(t[0])],
        "tolist": [lambda: t.tolist()],
        "nonzero": [lambda: mask.nonzero(), lambda: torch.where(mask)],
        "bincount": [lambda: i.bincount()],
        "_unique2": [lambda: i.unique()],
        "masked_select": [lambda: t.masked_select(mask)],
        "index_with_bool_mask": [lambda: t[mask]],
        "index_put__with_bool_mask": [lambda: t.clone().__setitem__(mask, torch.zeros(3))],
        "repeat_interleave_without_output_size": [lambda: i.repeat_interleave(i)],
        "equal": [lambda: torch.equal(t, t)],
    }
    for name, calls in syncing.items():
        for call in calls:
            assert _count(call) == {name: 1}, name
    free = [
        lambda: i.repeat_interleave(i, output_size=3),
        lambda: t.argsort(stable=True),
        lambda: t.topk(2),
        lambda: torch.zeros(3).scatter_add_(0, i, torch.ones(2)),
        lambda: t[i],
        lambda: t.cumsum(0),
        lambda: t.masked_fill(mask, 0.0),
        lambda: t.to(torch.float64),
        lambda: t.clone().__setitem__(mask, 0.0),
    ]  # ATen runs it as masked_fill_
    for call in free:
        assert _count(call) == {}
    with HostSyncs() as syncs:
        with uncounted():
            t[0].item()
    assert syncs.total == 0
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # restored on exit


def test_counter_sees_reads_in_an_activation_checkpoint_recompute() -> None:
    """The recompute runs inside backward (a TorchFunctionMode is not active there)."""
    w = torch.ones(3, requires_grad=True)

    def reads(x: torch.Tensor) -> torch.Tensor:
        x.detach().sum().tolist()
        return x * x  # saves x: backward unpacks it, which recomputes

    with HostSyncs(where=True) as syncs:
        checkpoint(reads, w, use_reentrant=False).sum().backward()
    assert syncs.counts == {"tolist": 2}, syncs.where


# ---------------------------------------------------------------------------------------------
# Training steps, one process


def _counted_run(tmp_path: Path, *extra: str) -> dict[int, dict]:
    trainer = Trainer(load_config(["--job.dump_folder", str(tmp_path), *TINY, *extra]))
    recorder = StepSyncs(where=True)
    recorder.install(trainer)
    trainer.train()
    recorder.finish()
    return recorder.steps


@pytest.mark.parametrize(
    "family,precision",
    [
        ("dense", ("--mixed_precision.enabled", "false")),
        ("dense", ()),
        ("dense", ("--mixed_precision.param_dtype", "float16")),
        ("moe", ()),
        # Block-scaled (emulated): no finiteness read per quantized operand; a non-finite one reaches
        # the gradient norm's check (the full nvfp4 recipe: SR reseeded per step, RHT, 2-D weights).
        ("dense", ("--mixed_precision.block_scaled", "mxfp8", "--mixed_precision.block_scaled_emulate", "true")),
        ("dense", ("--mixed_precision.block_scaled", "nvfp4", "--mixed_precision.block_scaled_emulate", "true")),
    ],
)
def test_a_training_step_reads_the_device_once(tmp_path: Path, family: str, precision: tuple[str, ...]) -> None:
    model = ["--model.flavor", "debugmodel_tiny"] if family == "dense" else MOE
    steps = _counted_run(tmp_path, *model, *precision)
    assert sorted(steps) == [1, 2, 3, 4]
    for step, record in steps.items():
        assert record["train_step"] == STEP_BUDGET, (step, record["where"])
        logs = step % 2 == 0 or step == 1  # log_freq 2, and the first step
        assert record["loop"] == STEP_BUDGET + (LOG_READS[family] if logs else 0), (step, record)


# ---------------------------------------------------------------------------------------------
# MoE layers


def _moe(dtype: torch.dtype = torch.float32) -> tuple[MoETransformer, MoE]:
    args = dataclasses.replace(MOE_FLAVORS["debugmodel_moe"], max_seq_len=32, load_balance="bias_and_aux_loss")
    torch.manual_seed(0)
    model = MoETransformer(args)
    model.init_weights()
    model.to(dtype)
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    layer.experts.grouped_mm = True  # what parallelize.apply_expert_kernels decides on this CPU
    return model, layer


def test_moe_layer_without_expert_parallel_reads_nothing() -> None:
    model, layer = _moe()
    x = torch.randn(2, 16, model.model_args.dim, requires_grad=True)
    with HostSyncs(where=True) as syncs:
        layer(x).square().sum().backward()
        checkpoint(layer, x, use_reentrant=False).square().sum().backward()
        after_step([model]) if after_backward([model], None) else None
    assert syncs.total == 0, syncs.where


@pytest.fixture
def one_rank_group() -> torch.distributed.ProcessGroup:
    """A 1-rank gloo world: expert parallel's exchange runs (to itself) on the EP code path."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_expert_parallel_reads_the_split_sizes_once_per_forward(one_rank_group) -> None:  # type: ignore[no-untyped-def]
    model, layer = _moe()
    x = torch.randn(2, 16, model.model_args.dim, requires_grad=True)
    want = layer(x)
    layer.reset_step_counters()
    layer.expert_parallel = ExpertParallel(one_rank_group, 1)
    with HostSyncs(where=True) as syncs:
        out = layer(x)
    # One stacked .tolist() of the send and receive sizes; repeat_interleave given its size.
    assert syncs.counts == {"tolist": 1}, syncs.where
    torch.testing.assert_close(out, want)
    with HostSyncs(where=True) as syncs:
        out.square().sum().backward()  # the reverse all-to-all reuses the forward's sizes
    assert syncs.total == 0, syncs.where
    # Under activation checkpointing the recompute (inside backward) takes the forward's sizes.
    with HostSyncs(where=True) as syncs:
        for _ in range(2):  # two micro-batches forward, then both backward (first in, first out)
            y = checkpoint(layer, x, use_reentrant=False)
        y.square().sum().backward()
    assert syncs.counts == {"tolist": 2}, syncs.where
    after_backward([model], None)  # the step is done: nothing kept for recomputes that never come
    assert not layer.expert_parallel.read
    with torch.no_grad(), HostSyncs() as syncs:  # evaluation: read, nothing kept
        layer(x)
    assert syncs.counts == {"tolist": 1} and not layer.expert_parallel.read


def test_expert_parallel_recompute_reuses_the_forwards_counts(one_rank_group, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The int64 count exchange runs once per grad-enabled forward: an activation-checkpoint
    recompute takes the received counts the forward kept, with its split sizes (on nccl a
    repeated exchange is a collective and a wait inside backward), and exchanges only the rows."""
    model, layer = _moe()
    x = torch.randn(2, 16, model.model_args.dim, requires_grad=True)
    want = layer(x)
    layer.reset_step_counters()
    layer.expert_parallel = ExpertParallel(one_rank_group, 1)
    calls: list[str] = []
    counts_a2a, rows_a2a = dist.all_to_all_single, expert_parallel.all_to_all_single_autograd
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: calls.append("counts") or counts_a2a(*a, **k))
    monkeypatch.setattr(
        expert_parallel, "all_to_all_single_autograd", lambda *a, **k: calls.append("rows") or rows_a2a(*a, **k)
    )
    for _ in range(2):  # two micro-batches forward, then both backward (first in, first out)
        y = checkpoint(layer, x, use_reentrant=False)
        torch.testing.assert_close(y, want)
    assert calls == ["counts", "rows", "rows"] * 2
    calls.clear()
    y.square().sum().backward()  # one micro-batch's graph: one recompute (same inputs, same counts)
    assert calls == ["rows", "rows"], calls
    assert len(layer.expert_parallel.read) == 1  # kept for the other micro-batch's recompute


def test_compiled_bf16_moe_block_has_no_graph_break() -> None:
    """torch.compile over a bf16 MoE block whose experts run the grouped kernel (decided at build):
    one graph, no break (a host read inside would split it)."""
    model, layer = _moe(torch.bfloat16)
    block = next(b for b in model.layers.values() if b.feed_forward is layer)
    x = torch.randn(2, 16, model.model_args.dim, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x, model.rope_cos, model.rope_sin)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
