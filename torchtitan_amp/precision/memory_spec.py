"""The plan as the memory model reads it: memory.PrecisionSpec, the plan's decisions as dtype names
and module kinds (memory/ sits below precision/ and knows no plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from torchtitan_amp.core.rules import dtype_name as name
from torchtitan_amp.memory.specs import PrecisionSpec

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan


def from_plan(plan: PrecisionPlan, norm_cls: type | None = None) -> PrecisionSpec:
    """`norm_cls`: the model family's norm (ModelFamily.norm_cls), the "norm" kind; None: any
    safe module class that declares `computes_in_fp32` (every family's norms do)."""
    kinds = set()
    for cls_, kind in ((nn.Linear, "linear"), (nn.Embedding, "embedding"), (norm_cls, "norm")):
        if cls_ is not None and any(issubclass(cls_, safe) for safe in plan.safe_modules):
            kinds.add(kind)
    if norm_cls is None and any(getattr(safe, "computes_in_fp32", False) for safe in plan.safe_modules):
        kinds.add("norm")
    return PrecisionSpec(
        path=plan.path,
        storage=name(plan.storage_dtype),
        param=name(plan.param_dtype),
        reduce=name(plan.reduce_dtype),
        output=name(plan.output_dtype),
        comm_hook=plan.comm_hook != "none",
        safe_kinds=frozenset(kinds),
        optimizer_state=name(plan.optimizer_state_dtype),
        frozen=tuple(plan.frozen_names),
        cp_reduce=name(plan.cp_reduce_dtype),
        router=name(plan.router_dtype),
        lora_rank=plan.lora.rank if plan.lora is not None else 0,
        lora_targets=plan.lora.targets if plan.lora is not None else (),
        lora_nf4=plan.lora is not None and plan.lora.nf4,
        lora_fp8=plan.lora is not None and plan.lora.fp8,
    )
