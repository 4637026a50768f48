"""AdamW and the warm-up / stable / decay learning-rate schedule."""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_step

from torchtitan_amp.config import LRSchedulerConfig, OptimizerConfig
from torchtitan_amp.distributed.process_groups import local_tensor as _local

_MOMENTS = ("exp_avg", "exp_avg_sq")


def build_optimizer(
    params: list[nn.Parameter],
    cfg: OptimizerConfig,
    device: torch.device,
    *,
    state_dtype: torch.dtype | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    fused_ok: bool = True,
) -> torch.optim.Optimizer:
    """torch's AdamW, or with `state_dtype` `AdamWMixedState`, which keeps its moments in that dtype
    and computes the update in fp32.

    Args:
        params: the trained parameters.
        cfg: the optimizer config section: lr, betas, eps, weight decay, implementation.
        device: the parameters' device (the fused kernel's).
        state_dtype: the moments' dtype (None: the parameters'); the precision plan's
            `mixed_state_optimizer` decides when it is set.
        stochastic_rounding: True to round the fp32 update into bf16 parameters stochastically
            (AdamWMixedState only).
        seed: the stochastic rounding streams' seed.
        fused_ok: the plan's `fused_optimizer_ok`: whether its loss scaler can drive the fused kernel.
    """
    if state_dtype is not None:
        return AdamWMixedState(
            params,
            state_dtype=state_dtype,
            stochastic_rounding=stochastic_rounding,
            seed=seed,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
        )
    impl = cfg.implementation
    if impl == "auto":
        # torch's fused kernel exists for CUDA and CPU, DTensor parameters included (FSDP and TP
        # runs on gloo take the same losses as foreach); on CPU it saved 1-4% of a bf16 step
        # (docs/performance.md). Other devices get foreach.
        impl = "fused" if device.type in ("cuda", "cpu") and fused_ok else "foreach"
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient's local part laid out as the parameter's: DTensor may leave it partial (the
    trainer sums those once per step) or replicated where the parameter is sharded (a TP
    embedding's gradient, torch 2.13)."""
    g = p.grad
    assert g is not None  # called on parameters the step found a gradient for
    if isinstance(g, DTensor):
        d = cast(DTensor, p)  # a DTensor parameter's gradient is a DTensor, and only its
        if tuple(g.placements) != tuple(d.placements):
            g = g.redistribute(d.device_mesh, d.placements)
    return _local(g)


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16 rounding away from zero with probability (dropped low 16 bits) / 2**16:
    unbiased, E[round(x)] = x. Adding uniform 16-bit noise to the magnitude bits, then cutting them,
    does exactly that for either sign; inf stays inf."""
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator)
    bits = (x.contiguous().view(torch.int32) + noise) & -65536  # -65536 == 0xFFFF0000
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


class AdamWMixedState(torch.optim.AdamW):
    """AdamW with its moments in `state_dtype` whatever the parameters' dtype, the update computed
    in fp32 and, for bf16 parameters, optionally rounded stochastically.

    torch's AdamW keeps the moments in the parameter's dtype (its kernels refuse anything else),
    and torchao's `_AdamW` rounds with the global RNG, which data-parallel replicas do not draw in
    step. This one runs torch's own single-tensor AdamW math (`torch.optim.adam.adam`, decoupled
    weight decay) on fp32 copies of one parameter at a time, so at most one parameter's fp32 state
    exists beside the stored one, then stores the moments in `state_dtype` (round to nearest) and
    the parameter in its dtype. Stochastic rounding draws from a generator seeded by (seed, step,
    parameter index): replicas of a parameter round alike and a resumed run as the original.
    The state dict is AdamW's (step, exp_avg, exp_avg_sq), so checkpoints move between the two.
    """

    def __init__(
        self, params: Any, *, state_dtype: torch.dtype, stochastic_rounding: bool, seed: int, **adamw: Any
    ) -> None:
        super().__init__(params, foreach=False, **adamw)
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed(((self.seed * 1_000_003 + step) * 65_537 + index) % (1 << 63))
        return gen

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1  # counts parameters without a gradient too: the same on every replica
                if p.grad is not None:
                    self._update(p, group, index)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)  # on the CPU, as torch's non-fused AdamW keeps it
            for key in _MOMENTS:
                state[key] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        param = _local(p)
        moments = [_local(state[key]) for key in _MOMENTS]
        p32 = param if param.dtype == torch.float32 else param.float()
        m32 = [m if m.dtype == torch.float32 else m.float() for m in moments]
        beta1, beta2 = group["betas"]
        adam_step(
            [p32],
            [_local_grad(p).float()],
            [m32[0]],
            [m32[1]],
            [],
            [state["step"]],
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        for stored, computed in zip(moments, m32):
            if computed is not stored:
                stored.copy_(computed)
        if p32 is not param:
            if self.stochastic_rounding and param.dtype == torch.bfloat16:
                p32 = stochastic_round_bf16(p32, self._generator(param.device, int(state["step"]), index))
            param.copy_(p32)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts every floating state to the parameter's dtype (fp32 moments of bf16
        parameters would be rounded): store the incoming moments in state_dtype instead."""
        super().load_state_dict(state_dict)
        saved_keys = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for key, p in zip(saved_keys, params):
            incoming = state_dict["state"].get(key, {})
            for name in _MOMENTS:
                if name in incoming:
                    self.state[p][name] = incoming[name].to(device=p.device, dtype=self.state_dtype, copy=True)


def lr_factor(
    step: int, *, warmup: int, total: int, decay_ratio: float, decay_type: str, min_lr_factor: float
) -> float:
    """Multiplier of the peak LR after `step` optimizer steps (step 0 = before the first step).

    Warm-up runs from 1/(warmup+1) to 1 so the first step never uses LR 0; then a stable phase,
    then decay down to `min_lr_factor`, reached at step `total`. Decay never overlaps warm-up: when
    warmup + decay exceed `total`, decay is shortened so that it starts from the peak at the end of
    warm-up.

    Args:
        step: optimizer steps taken.
        warmup: warm-up steps.
        total: the run's steps, where decay ends.
        decay_ratio: the share of the steps that decays (-1: all steps after warm-up).
        decay_type: the decay's shape ("linear", "sqrt", "cosine").
        min_lr_factor: the multiplier decay ends at.
    """
    if step < warmup:
        return (step + 1) / (warmup + 1)
    decay_steps = total - warmup if decay_ratio < 0 else round(total * decay_ratio)
    decay_steps = min(decay_steps, total - warmup)
    decay_start = total - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule (lr_factor: warm-up, stable, decay) as a LambdaLR over `optimizer`.

    Args:
        optimizer: the optimizer whose learning rate is scheduled.
        cfg: the lr_scheduler config section: warm-up steps, decay ratio and type, minimum factor.
        total_steps: the run's steps (training.steps).
    """
    fn = partial(
        lr_factor,
        warmup=cfg.warmup_steps,
        total=total_steps,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
