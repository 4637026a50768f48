"""fp16 dynamic loss scaling: the plan's scaler choice built, behind one interface."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


class LossScaler:
    """fp16 dynamic loss scaling behind one interface; a no-op when the plan needs none.

    Contract per optimizer step: `scale(loss)` every micro-batch, `unscale_(opt)` once before
    clipping, `step(opt)` returns False when the step was skipped for inf/nan gradients.
    """

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler
        self.skipped_steps = 0
        # The scale as a Python float, read back from the device once per step (in `step`), so
        # that `get_scale()` in the loop and the log never synchronises. Only `update()` and
        # `load_state_dict` change it. Before the first `scale()` this is init_scale (no sync).
        self._scale = scaler.get_scale() if scaler else 1.0

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            if self.scaler._scale is None:
                # A pipeline stage without the loss never called scale(): create the scale the
                # same lazy way, so that unscale_ / step / update run (and agree) on every rank.
                device = next(p.device for g in optimizer.param_groups for p in g["params"])
                self.scaler.scale(torch.zeros((), device=device))
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() backs the scale off exactly when this step found inf/nan and skipped.
        before, self._scale = self._scale, self.scaler.get_scale()
        stepped = self._scale >= before
        self.skipped_steps += not stepped
        return stepped

    def get_scale(self) -> float:
        return self._scale

    def state_dict(self) -> dict[str, Any]:
        state = self.scaler.state_dict() if self.scaler else {}
        return {"scaler": state, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()
        self.skipped_steps = int(state.get("skipped_steps", 0))


def build_scaler(plan: PrecisionPlan) -> LossScaler:
    # Keyword arguments by name (init_scale, growth_factor, backoff_factor, growth_interval): typed
    # dict[str, float], they would be checked against every parameter of the scalers, group included.
    kwargs: dict[str, Any] = plan.scaler_kwargs
    if plan.grad_scaler == "ShardedGradScaler":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return LossScaler(ShardedGradScaler(plan.device_type, **kwargs))
    if plan.grad_scaler == "GradScaler":
        return LossScaler(torch.amp.GradScaler(plan.device_type, **kwargs))
    return LossScaler(None)
