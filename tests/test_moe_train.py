"""The MoE auxiliary loss inside the trainer, in one process: the gradient it adds to a step is the
one of adding it to the loss explicitly, with the loss's own factor (fp16 loss scale /
accumulation steps), on the first step of a run and of a resume; and the expert biases do not
move on a step skipped for non-finite gradients."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from torchtitan_amp.config import load_config
from torchtitan_amp.data.loader import to_device
from torchtitan_amp.models.moe import moe as moe_mod
from torchtitan_amp.models.moe.balance import moe_layers
from torchtitan_amp.precision import autocast
from torchtitan_amp.train.trainer import Trainer

# fp16 autocast with dynamic loss scaling that grows every step (the scale a resumed run starts
# from differs from the first run's), accumulation 4 (global batch 8 of local batches 2).
FP16_ACCUM4 = [
    "--model.name",
    "moe",
    "--model.flavor",
    "debugmodel_moe_aux",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--mixed_precision.enabled",
    "true",
    "--mixed_precision.param_dtype",
    "float16",
    "--mixed_precision.growth_interval",
    "1",
]


@pytest.fixture(autouse=True)
def _no_peak_flops_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torchtitan_amp.train.build.peak_flops", lambda device, dtype: 1e12)


class _RecordAux:
    """Stands for _AddAuxLoss: the aux loss is recorded and joins no gradient by itself."""

    seen: list[torch.Tensor] = []

    @staticmethod
    def apply(x: torch.Tensor, aux: torch.Tensor, scale: object) -> torch.Tensor:
        _RecordAux.seen.append(aux)
        return x


def _router_grads(trainer: Trainer) -> list[torch.Tensor]:
    return [layer.router.weight.grad.detach().clone() for layer in moe_layers(trainer.run.model_parts)]


def _step_grads(trainer: Trainer, batches: list, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The router gradients a train step holds just before unscaling (scaled, as backward left them)."""
    grads: list[list[torch.Tensor]] = []
    real = trainer.run.scaler.unscale_
    monkeypatch.setattr(trainer.run.scaler, "unscale_", lambda opt: (grads.append(_router_grads(trainer)), real(opt)))
    trainer.train_step(iter(batches))
    monkeypatch.setattr(trainer.run.scaler, "unscale_", real)
    return grads[0]


def _explicit_aux_grads(trainer: Trainer, batches: list, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The router gradients of scale x sum over micro-batches of aux / accum, the aux loss added
    to a loss by hand (nothing else backpropagated)."""
    monkeypatch.setattr(moe_mod, "_AddAuxLoss", _RecordAux)
    trainer.run.optimizer.zero_grad(set_to_none=True)
    for inputs, _labels in batches:
        _RecordAux.seen.clear()
        with autocast.forward_context(trainer.run.plan):
            trainer.run.model(to_device(inputs, trainer.run.device))
        aux = torch.stack(_RecordAux.seen).sum() / trainer.run.accum
        with autocast.backward_context(trainer.run.plan):
            trainer.run.scaler.scale(aux).backward()
    monkeypatch.undo()
    return _router_grads(trainer)


def _check_aux_gradient(trainer: Trainer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's router gradient = the step without the aux loss + the aux loss's explicit gradient."""
    batches = [next(trainer._batches) for _ in range(trainer.run.accum)]
    model_state = copy.deepcopy(trainer.run.model.state_dict())
    scaler_state = copy.deepcopy(trainer.run.scaler.state_dict())

    def restore() -> None:
        trainer.run.model.load_state_dict(model_state)
        trainer.run.scaler.load_state_dict(copy.deepcopy(scaler_state))

    full = _step_grads(trainer, batches, monkeypatch)
    restore()
    with monkeypatch.context() as m:
        m.setattr(moe_mod, "_AddAuxLoss", _RecordAux)
        without = _step_grads(trainer, batches, monkeypatch)
    restore()
    aux = _explicit_aux_grads(trainer, batches, monkeypatch)
    restore()
    for f, w, a in zip(full, without, aux):
        assert a.abs().max() > 1e-3 * w.abs().max()  # the aux loss's share is visible
        # fp32 gradients: the two paths meet at the router scores in another order (a few ulps of
        # the whole gradient); the factor being off on one micro-batch of 4 moves a quarter of it.
        torch.testing.assert_close(f - w, a, rtol=1e-4, atol=1e-5 * float(f.abs().max()))


def _trainer(folder: Path, *extra: str) -> Trainer:
    trainer = Trainer(load_config(["--job.dump_folder", str(folder), *FP16_ACCUM4, *extra]))
    trainer._batches = iter(trainer.run.dataloader)
    return trainer


def test_aux_loss_gradient_uses_the_loss_factor_at_start_and_after_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "1", "--training.steps", "1"]
    first = _trainer(tmp_path, *ckpt)
    assert first.run.accum == 4 and first.run.scaler.enabled
    _check_aux_gradient(first, monkeypatch)
    first.train()  # one step, saved
    scale_saved = first.run.scaler.get_scale()
    del first
    resumed = _trainer(tmp_path, *ckpt[:-1], "2")
    assert resumed.step == 1 and resumed.run.scaler.get_scale() == scale_saved != 65536.0
    _check_aux_gradient(resumed, monkeypatch)


def test_expert_biases_stay_on_a_skipped_fp16_step(tmp_path: Path) -> None:
    """An initial scale that overflows fp16 skips the first step: the biases the step's loads
    asked for are not applied; the next (applied) step moves them."""
    trainer = _trainer(
        tmp_path,
        "--model.flavor",
        "debugmodel_moe",
        "--mixed_precision.init_scale",
        "1e30",
        "--mixed_precision.backoff_factor",
        "1e-26",
    )
    batches = iter(trainer.run.dataloader)
    _, _, stepped = trainer.train_step(batches)
    assert not stepped
    assert all(not layer.router.expert_bias.any() for layer in moe_layers(trainer.run.model_parts))
    _, _, stepped = trainer.train_step(batches)
    assert stepped
    for layer in moe_layers(trainer.run.model_parts):
        assert layer.router.expert_bias.any() and abs(float(layer.router.expert_bias.sum())) < 1e-6
