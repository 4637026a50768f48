"""The loss normalisation (torchtitan_amp/models/loss.py), in process: each part of a step (rank,
accumulation micro-batch, pipeline microbatch) contributes its cross-entropy sum times
label_weight = G / N, N the step's count of valid labels (not -100) and G the ranks the gradient
wrappers average over, so that the step is one process's mean over all valid labels, however
unequally the parts hold them. The launched layouts (FSDP 2, FSDP 2 x accumulation 2, CP 2, TP 2
with loss parallel, PP 2) are in tests/test_context_parallel_dist.py
(test_masked_labels_match_one_process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.inputs import mask_labels
from torchtitan_amp.config import load_config
from torchtitan_amp.models.loss import IGNORE_INDEX, count_valid_labels, label_weight, loss_fn
from torchtitan_amp.train.trainer import Trainer

# fp32 sums of a few hundred terms in another order, and one more division: a few unit roundoffs.
FP32_RTOL = 1e-6
TINY = [
    "--model.flavor",
    "debugmodel_tiny",
    "--training.seq_len",
    "32",
    "--mixed_precision.enabled",
    "false",
    "--lr_scheduler.warmup_steps",
    "2",
    "--training.seed",
    "0",
]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU's matmul benchmark is not what these tests are about."""
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


def _masked_batch(batch: int = 8, seq: int = 16, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=g, dtype=torch.float32)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[1] = IGNORE_INDEX  # a whole window
    labels[2, : seq // 2] = IGNORE_INDEX
    labels[5, ::3] = IGNORE_INDEX
    return logits, labels


def _split_loss(
    logits: torch.Tensor, labels: torch.Tensor, parts: int, grad_mean_size: int, per_part_mean: bool = False
) -> torch.Tensor:
    """What the wrappers' gradient mean makes of `parts` pieces of the batch spread over
    `grad_mean_size` ranks: the sum of each piece's loss, over grad_mean_size. per_part_mean: each
    piece's own mean over its parts' count (a rank's mean, divided by the pieces per rank)."""
    weight = label_weight(count_valid_labels([labels], None), grad_mean_size)
    total = torch.zeros(())
    for x, y in zip(logits.chunk(parts), labels.chunk(parts)):
        if per_part_mean:
            total = total + loss_fn(x, y).nan_to_num() * grad_mean_size / parts
        else:
            total = total + loss_fn(x, y, reduction="sum") * weight
    return total / grad_mean_size


@pytest.mark.parametrize("parts,ranks", [(2, 2), (4, 2), (8, 4), (8, 1)])
def test_label_weight_makes_any_split_one_process_mean(parts: int, ranks: int) -> None:
    logits, labels = _masked_batch()
    leaf = logits.clone().requires_grad_()
    want = F.cross_entropy(leaf.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    got_leaf = logits.clone().requires_grad_()
    got = _split_loss(got_leaf, labels, parts, ranks)
    got.backward()
    torch.testing.assert_close(got, want.detach(), rtol=FP32_RTOL, atol=0)
    torch.testing.assert_close(got_leaf.grad, leaf.grad, rtol=FP32_RTOL, atol=1e-9)
    # The rule it replaces, a mean per part, weighs the parts' labels unequally.
    old = _split_loss(logits, labels, parts, ranks, per_part_mean=True)
    assert abs(float(old - want)) > 1e-3 * float(want), (float(old), float(want))


def test_no_valid_label_gives_zero_loss_and_gradient_not_nan() -> None:
    logits, labels = _masked_batch()
    labels[:] = IGNORE_INDEX
    count = count_valid_labels([labels], None)
    assert count.dtype == torch.int64 and int(count) == 0
    weight = label_weight(count, 4)
    assert float(weight) == 4.0  # 4 / max(0, 1)
    leaf = logits.clone().requires_grad_()
    loss = loss_fn(leaf, labels, reduction="sum") * weight
    loss.backward()
    assert float(loss) == 0.0 and torch.count_nonzero(leaf.grad) == 0


class _SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device value on the host (`.item()`, `float(t)`, `bool(t)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _step(
    tmp_path: Path, batches: list[tuple[torch.Tensor, torch.Tensor]], *extra: str
) -> tuple[float, float, dict[str, torch.Tensor], int]:
    """One train step of a fresh single-process Trainer on `batches`: loss, grad norm, gradients
    and the host reads the step made."""
    trainer = Trainer(load_config(["--job.dump_folder", str(tmp_path), *TINY, *extra]))
    with _SyncCounter() as counter:
        loss, grad_norm, _ = trainer.train_step(iter(batches))
    grads = {n: p.grad.clone() for n, p in trainer.run.model.named_parameters() if p.grad is not None}
    return float(loss), float(grad_norm), grads, counter.syncs


def test_accumulated_micro_batches_with_unequal_valid_labels_equal_one_batch(tmp_path: Path) -> None:
    """4 windows as one batch, and as 2 accumulated micro-batches of 2 whose valid-label counts
    differ (one window wholly masked): the same loss, gradients and grad norm. The normalisation
    reads nothing on the host: the step's one read is the finiteness check of the grad norm."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4, 33), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0] = IGNORE_INDEX
    labels[3, :20] = IGNORE_INDEX
    assert (labels[:2] != IGNORE_INDEX).sum() != (labels[2:] != IGNORE_INDEX).sum()
    one = _step(tmp_path / "one", [(inputs, labels)], "--training.local_batch_size", "4")
    two = _step(
        tmp_path / "two",
        [(inputs[:2], labels[:2]), (inputs[2:], labels[2:])],
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
    )
    assert two[0] == pytest.approx(one[0], rel=FP32_RTOL) and two[1] == pytest.approx(one[1], rel=FP32_RTOL)
    worst = max(float((two[2][n] - g1).norm() / g1.norm()) for n, g1 in one[2].items())
    print(
        f"\n[loss norm] accumulation 2 vs one batch: loss {abs(two[0] / one[0] - 1):.1e}, grad norm "
        f"{abs(two[1] / one[1] - 1):.1e}, worst gradient {worst:.1e} (relative)"
    )
    assert worst < 1e-5
    assert one[3] == two[3] == 1, (one[3], two[3])


def test_masking_helper_masks_by_window_content() -> None:
    """tests/support/inputs.mask_labels, which the launched parity runs use: the same window is masked
    the same way whichever rank or batch position it has."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 256, (16, 32), generator=g)
    masked = mask_labels(labels)
    assert torch.equal(mask_labels(labels.flip(0)), masked.flip(0))
    counts = (masked != IGNORE_INDEX).sum(1).tolist()
    assert set(counts) == {0, 16, 21, 32}, counts


def test_validation_loss_is_the_mean_over_valid_labels(tmp_path: Path) -> None:
    """Validation sums each batch's per-label losses and counts its valid labels: two batches with
    unequal counts give the mean over all their valid labels, not the mean of the batches' means."""
    trainer = Trainer(
        load_config(
            [
                "--job.dump_folder",
                str(tmp_path),
                *TINY,
                "--training.local_batch_size",
                "2",
                "--validation.enable",
                "true",
                "--validation.steps",
                "2",
            ]
        )
    )
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 33), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0] = IGNORE_INDEX
    labels[3, :20] = IGNORE_INDEX
    batches = [(tokens[:2, :-1], labels[:2]), (tokens[2:, :-1], labels[2:])]
    trainer.run.validator._iterator = lambda: iter(batches)  # type: ignore[method-assign]
    got = trainer.run.validator.run()
    with torch.no_grad():
        want = loss_fn(trainer.run.model(tokens[:, :-1]), labels)
    assert got["val_loss"] == pytest.approx(float(want), rel=FP32_RTOL)
    assert got["val_tokens"] == int((labels != IGNORE_INDEX).sum()) == 32 + 12 + 32
