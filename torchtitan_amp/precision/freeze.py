"""What the parameters are stored in: the storage dtype for all (fp32 master weights, or pure bf16),
and for training.freeze's modules their compute dtype, with no gradient."""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.precision.tags import FROZEN, tied_modules

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def apply_storage_dtype(plan: PrecisionPlan, model: nn.Module) -> None:
    """Store parameters (only) in storage_dtype: fp32 master weights for mixed precision,
    bf16 for pure-bf16 training. Buffers stay as built: the rotary tables must stay fp32."""
    stored: dict[int, nn.Parameter] = {}  # a shared (tied) parameter stays one
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in stored:
                stored[id(p)] = nn.Parameter(p.detach().to(plan.storage_dtype), p.requires_grad)
            module.register_parameter(name, stored[id(p)])


def freeze(plan: PrecisionPlan, model: nn.Module) -> dict[str, str]:
    """training.freeze: the matching modules' parameters (everything inside them) get
    requires_grad = False and their compute dtype as storage. Call on the whole model after
    mark_fp32_by_name and before it is split or parallelized. Returns {parameter: dtype}."""
    named = dict(model.named_modules())
    unmatched = [p for p in plan.frozen_names if not any(fnmatch.fnmatchcase(n, p) for n in named if n)]
    if unmatched:
        raise PrecisionError(
            f"'training.freeze' entry {unmatched[0]!r} matches no module of the model "
            "(names such as 'tok_embeddings', 'layers.0', 'layers.*.attention')"
        )
    matched = {
        sub_name: sub
        for name, module in named.items()
        if name and any(fnmatch.fnmatchcase(name, p) for p in plan.frozen_names)
        for sub_name, sub in module.named_modules(prefix=name)
    }
    _check_tied(model, matched)
    frozen: dict[str, str] = {}
    made: dict[int, nn.Parameter] = {}  # a shared (tied) parameter stays one
    for sub_name, sub in matched.items():
        dtype = plan.frozen_dtype(sub)
        for pname, p in list(sub.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            sub.register_parameter(pname, made[id(p)])
            frozen[f"{sub_name}.{pname}"] = dtype_name(dtype)
        setattr(sub, FROZEN, True)
    return frozen


def _check_tied(model: nn.Module, matched: dict[str, nn.Module]) -> None:
    """A weight two modules share (enable_weight_tying) is frozen for both or for neither."""
    for group in tied_modules(model):
        frozen = [n for n, _ in group if n in matched]
        if frozen and len(frozen) < len(group):
            other = next(n for n, _ in group if n not in matched)
            raise PrecisionError(
                f"'training.freeze' freezes '{frozen[0]}' but not '{other}', which shares its "
                f"weight (model enable_weight_tying); freeze both or neither"
            )


def refreeze(model: nn.Module) -> None:
    """TP's SequenceParallel and distribute_module re-register parameters as DTensors that
    require grad: frozen modules' parameters are frozen again after TP."""
    for module in model.modules():
        if getattr(module, FROZEN, False):
            for p in module.parameters(recurse=False):
                p.requires_grad_(False)


def frozen_low_precision_modules(plan: PrecisionPlan, model: nn.Module) -> list[nn.Module]:
    """Frozen modules stored in param_dtype: their own FSDP groups, so that no group mixes them
    with fp32 trained parameters."""
    return [
        m
        for m in model.modules()
        if getattr(m, FROZEN, False)
        and plan.frozen_dtype(m) != plan.storage_dtype
        and any(True for _ in m.parameters(recurse=False))
    ]
