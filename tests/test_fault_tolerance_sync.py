"""What the replica groups must agree on beyond the weights, in one process: two one-rank groups,
one thread each, whose stand-in torchft Managers really average (tests/support/standins.PairedGroups).

- MoE: the expert biases (buffers that learn outside the optimizer) are bit-equal across the
  groups after every step, per step (the token counts summed over the quorum) and under DiLoCo
  (the biases synced with the weights), and a healing group copies them with the weights.
- The loss normalisation: with masked labels the groups hold different numbers of valid labels;
  their averaged gradient is one process's mean over every valid label.
- FSDP with gradient accumulation (a one-rank gloo world): one cross-group all-reduce per step,
  not per micro-batch; and the reduce-scatter output that FSDP's all-reduce hook sent stays
  referenced until the backward has ended.

The launches with a real lighthouse are in test_fault_tolerance.py."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.inputs import mask_labels
from tests.support.standins import PairedGroups, SameValuesManager, use_paired_managers, use_stand_in_manager
from torchtitan_amp.config import load_config
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models.moe.balance import moe_layers
from torchtitan_amp.precision import PrecisionPlan
from torchtitan_amp.train.fault_tolerance import FaultTolerance
from torchtitan_amp.train.trainer import Trainer

FT = ["--fault_tolerance.enable", "true", "--fault_tolerance.group_size", "2"]
MOE = [
    "--model.name",
    "moe",
    "--model.flavor",
    "debugmodel_moe",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.log_freq",
    "1",
    "--training.gc_freq",
    "0",
]
TINY = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--training.gc_freq",
    "0",
    "--mixed_precision.enabled",
    "false",
    "--training.max_norm",
    "0",
]
DILOCO = ["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "2"]
STEPS = 4


def _groups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> tuple[PairedGroups, list[Trainer]]:
    groups = PairedGroups()
    use_paired_managers(monkeypatch, groups)
    trainers = [
        Trainer(
            load_config(
                [*args, *FT, "--fault_tolerance.replica_id", str(g), "--job.dump_folder", str(tmp_path / f"g{g}")]
            )
        )
        for g in (0, 1)
    ]
    return groups, trainers


def _biases(trainer: Trainer) -> list[torch.Tensor]:
    return [layer.router.expert_bias.detach().clone() for layer in moe_layers(trainer.run.model_parts)]


@pytest.mark.parametrize("mode", ["per_step", "diloco"])
def test_moe_expert_biases_are_bit_equal_across_groups(monkeypatch, tmp_path: Path, mode: str) -> None:
    """Each group reads its own data, so its experts' loads differ from the other's: a bias update
    from one group's counts (or biases left out of DiLoCo's sync) drifts the groups apart."""
    groups, trainers = _groups(
        monkeypatch, tmp_path, *MOE, "--training.steps", str(STEPS), *(DILOCO if mode == "diloco" else ())
    )
    groups.run([t.train for t in trainers])
    weights = [dict(t.run.model.named_parameters()) for t in trainers]
    assert all(torch.equal(p, weights[1][n]) for n, p in weights[0].items())
    first, second = _biases(trainers[0]), _biases(trainers[1])
    assert any(b.abs().max() > 0 for b in first), "the biases never moved: the test would prove nothing"
    assert [torch.equal(a, b) for a, b in zip(first, second)] == [True] * len(first), (
        f"biases up to {max(float((a - b).abs().max()) for a, b in zip(first, second)):.2e} apart"
    )


def test_a_healing_group_copies_the_expert_biases(monkeypatch, tmp_path: Path) -> None:
    """A restarted group (fresh biases, zero) heals from a live one that trained two steps: it
    loads the weights and the biases, as torchtitan's heal loads the model's state dict."""
    groups, trainers = _groups(monkeypatch, tmp_path, *MOE, "--training.steps", "2")
    groups.run([t.train for t in trainers])
    restarted = Trainer(
        load_config(
            [
                *MOE,
                *FT,
                "--fault_tolerance.replica_id",
                "1",
                "--training.steps",
                "2",
                "--job.dump_folder",
                str(tmp_path / "g1b"),
            ]
        )
    )
    assert not any(b.abs().max() > 0 for b in _biases(restarted))
    groups.managers[1].heal_from(groups.managers[0])
    assert all(torch.equal(a, b) for a, b in zip(_biases(trainers[0]), _biases(restarted)))


def _masked_windows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four windows of 32 tokens; labels masked by tests/support/inputs.mask_labels, chosen so that the
    first two windows hold fewer valid labels than the last two."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        inputs = torch.randint(0, vocab, (4, 33), generator=g)
        labels = mask_labels(inputs[:, 1:])
        valid = (labels != -100).sum(dim=1)
        if valid[:2].sum() * 2 < valid[2:].sum() and valid[:2].sum() > 0:
            return inputs[:, :-1].contiguous(), labels
    raise AssertionError("no draw of windows with unequal valid labels")


def test_masked_labels_average_like_one_process(monkeypatch, tmp_path: Path) -> None:
    """Groups of 2 windows each (group 0 with under half of group 1's valid labels) against one
    process holding all 4: the gradient the groups agree on is the mean over all valid labels,
    not the mean of the two groups' means (which weighs group 0's labels over twice as much)."""
    groups, trainers = _groups(monkeypatch, tmp_path, *TINY, "--training.local_batch_size", "2")
    one = Trainer(load_config([*TINY, "--training.local_batch_size", "4", "--job.dump_folder", str(tmp_path / "one")]))
    inputs, labels = _masked_windows(one.run.job.model_args.vocab_size)

    def step(t: Trainer, rows: slice):
        t.run.ft.start_step()
        return t.train_step(iter([(inputs[rows], labels[rows])]))[0]

    losses = groups.run([lambda: step(trainers[0], slice(0, 2)), lambda: step(trainers[1], slice(2, 4))])
    want_loss = one.train_step(iter([(inputs, labels)]))[0]
    grads = [{n: p.grad for n, p in t.run.model.named_parameters()} for t in (*trainers, one)]
    for name, want in grads[2].items():
        assert torch.equal(grads[0][name], grads[1][name])
        # The same per-label gradients (the weight 2 / count is 1 / count times 2, exactly, and
        # the groups' mean halves exactly); only the order in which backward's matmuls add a
        # window's labels differs: fp32 reassociation of 128 terms, far below 1e-4 of the norm.
        assert torch.allclose(grads[0][name], want, rtol=0, atol=1e-4 * float(want.norm())), name
    # Each group logs its own mean loss; weighted by the groups' label counts they make the step's.
    counts = [(labels[:2] != -100).sum(), (labels[2:] != -100).sum()]
    mean = (losses[0] * counts[0] + losses[1] * counts[1]) / (counts[0] + counts[1])
    assert torch.allclose(mean, want_loss, rtol=1e-5)


@pytest.fixture
def one_rank_world():
    """A 1-rank gloo world, for FSDP in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _plan(*extra: str) -> PrecisionPlan:
    return PrecisionPlan.from_config(load_config([*FT, *extra]), ParallelDims(1, 1, 1, 1, 1), "cpu", probe=None)


def test_fsdp_accumulation_all_reduces_across_groups_once_per_step(monkeypatch, tmp_path: Path, one_rank_world) -> None:
    """Two micro-batches under FSDP (the group's model sharded over a 1-rank mesh, its root one
    FSDP unit): the hook's cross-group all-reduce runs after the last micro-batch only, as DDP's
    all-reduce does, not once per micro-batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    use_stand_in_manager(monkeypatch)
    t = Trainer(
        load_config(
            [
                *TINY,
                *FT,
                "--training.local_batch_size",
                "1",
                "--training.global_batch_size",
                "2",
                "--job.dump_folder",
                str(tmp_path),
            ]
        )
    )
    assert t.run.accum == 2
    fully_shard(t.run.model, mesh=init_device_mesh("cpu", (1,)))
    t.run.ft.attach(t.run.model_parts)
    t.run.optimization.params = list(t.run.model.parameters())
    t.run.optimization.optimizer = torch.optim.AdamW(t.run.params, lr=1e-3)
    inputs = torch.randint(0, t.run.job.model_args.vocab_size, (2, 1, 32))
    t.run.ft.start_step()
    t.train_step(iter([(inputs[0], inputs[0]), (inputs[1], inputs[1])]))
    gradients = [d for d in t.run.ft.manager.sent if d.is_floating_point]
    assert gradients == [torch.float32], f"{len(gradients)} cross-group all-reduces in one step of 2 micro-batches"


class _RecordingManager(SameValuesManager):
    """Keeps a weak reference to every tensor it all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def allreduce(self, t: torch.Tensor, reduce_op=None):
        self.refs.append(weakref.ref(t))
        return super().allreduce(t, reduce_op)


def test_fsdp_hook_keeps_the_reduce_buffer_until_backward_has_ended(one_rank_world) -> None:
    """bf16 reduce of fp32 parameters: FSDP casts each reduce-scatter output to fp32 after the
    hook and drops the bf16 buffer. On a GPU torchft's all-reduce may still be queued on it
    (the hook's stream waits for it; the host does not), and the caching allocator would hand the
    block to the next reduce-scatter: the hook must keep it referenced until the backward is
    over (FaultTolerance.backward_done), as torch's native HSDP keeps its all-reduce buffer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plan = _plan("--mixed_precision.enabled", "true", "--mixed_precision.reduce_dtype", "bfloat16")
    manager = _RecordingManager()
    ft = FaultTolerance(load_config(FT).fault_tolerance, plan, manager=manager)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh, policy = init_device_mesh("cpu", (1,)), MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    ft.attach([model])
    model(torch.randn(4, 8)).sum().backward()
    gc.collect()
    assert len(manager.refs) == 2 and all(r() is not None and r().dtype == torch.bfloat16 for r in manager.refs), (
        "a reduce-scatter output was freed while torchft's all-reduce could still be queued on it"
    )
    ft.backward_done()
    gc.collect()
    assert all(r() is None for r in manager.refs), "the buffers outlived the backward"
