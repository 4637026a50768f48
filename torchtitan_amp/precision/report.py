"""The plan as the job reports it: precision_report.json (param groups by module type with their
storage / compute / reduce dtypes, fp8 and fp32-by-name modules, frozen parameters, the sections
on the optimizer, context parallel, routers, expert parallel and fault tolerance) and the start-up
log lines."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan_amp.core.rules import DTYPE_BYTES, dtype_name, short_name
from torchtitan_amp.models.spec import synced_buffer_elements
from torchtitan_amp.precision import block_scaled
from torchtitan_amp.precision.lowbit import torchao_kernels
from torchtitan_amp.precision.lowbit.linear import BlockScaledLinear
from torchtitan_amp.precision.tags import FP32_BY_NAME

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan

logger = logging.getLogger("torchtitan_amp")

# Ops we keep in fp32 whatever the path. The norm and rotary upcasts live in the model (CPU
# autocast would otherwise run them in bf16); the loss upcast lives in `loss_fn`.
FP32_ISLANDS = (
    "RMSNorm (computes in fp32, returns input dtype)",
    "rotary tables and rotation",
    "cross-entropy on fp32 logits",
    "loss and metric accumulators",
)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _user_class(module: nn.Module) -> type:
    """The model's own class: FSDP2 and replicate swap in dynamic subclasses of it."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [
        (f"{n}.{pn}" if n else pn, p) for n, m in _named_modules(model) for pn, p in m.named_parameters(recurse=False)
    ]


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's modules by their names in the model; the trainer reports its pipeline stages
    as one ModuleList, whose index is not part of any module's name."""
    if isinstance(model, nn.ModuleList):
        return [(n.split(".", 1)[1], m) for n, m in model.named_modules() if "." in n]
    return list(model.named_modules())


def param_groups(plan: PrecisionPlan, model: nn.Module) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"num_params": 0})
    seen: set[int] = set()  # a tied weight is counted once, with its first module (the embedding)
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if not own:
            continue
        low = plan.is_safe(module) and plan.path != "full"
        # Off the "full" path storage is fp32: modules outside the safe list compute in it.
        compute = plan.compute_dtype(module)
        # The emulation multiplies in fp32; what the row promises is the recipe's format.
        experts_mm = getattr(module, "block_scaled_mm", None)  # grouped experts' BlockScaledExperts
        compute_name = (
            module.recipe.format
            if isinstance(module, BlockScaledLinear)
            else experts_mm.recipe.format
            if experts_mm is not None
            else dtype_name(compute)
        )
        name = _class_name(_user_class(module))
        reduce = plan.reduce_dtype if low else plan.storage_dtype
        if plan.path == "autocast" and plan.comm_hook == "none":
            reduce = plan.storage_dtype
        frozen = not own[0].requires_grad
        g = groups[f"{name} {compute_name} {frozen}"]
        g.update(
            module_type=name,
            storage_dtype=dtype_name(own[0].dtype),
            compute_dtype=compute_name,
            reduce_dtype="-" if frozen else dtype_name(reduce),
            trained=not frozen,
        )
        g["num_params"] += sum(p.numel() for p in own)
    return list(groups.values())


# ----------------------------------------------------------------------------- the plan's sections


def router_summary(plan: PrecisionPlan, model: nn.Module) -> dict[str, Any] | None:
    """The report's router section (None: the model routes no tokens)."""
    routers = [name for name, m in model.named_modules() if plan.routes(m)]
    if not routers:
        return None
    return {
        "router_dtype": dtype_name(plan.router_dtype),
        "routers": len(routers),
        "gate_matmul": f"{short_name(plan.router_dtype)} inputs and weights (activations upcast), "
        f"{short_name(plan.router_dtype)} output",
        "parameters": "fp32 (outside lower_precision_safe_modules: an fp32 FSDP group, no autocast, "
        "gradients reduced in fp32), never fp8",
        "expert_bias_and_counts": "float32",
    }


def expert_parallel_summary(plan: PrecisionPlan) -> dict[str, Any] | None:
    """The report's expert-parallel section (None without EP): tokens travel in the
    activations' dtype, what the experts compute in anyway."""
    if plan.expert_parallel_degree == 1:
        return None
    activations = dtype_name(plan.param_dtype if plan.path != "full" else plan.storage_dtype)
    return {
        "degree": plan.expert_parallel_degree,
        "dispatch_dtype": activations,
        "combine_dtype": activations,
        "weighted_sum": "float32 (on the rank that routed the token)",
    }


def context_parallel_summary(plan: PrecisionPlan) -> dict[str, Any] | None:
    """The report's context-parallel section (None without CP)."""
    if plan.context_parallel_degree == 1:
        return None
    activations = plan.param_dtype if plan.path != "full" else plan.storage_dtype
    return {
        "degree": plan.context_parallel_degree,
        "kv_all_gather_dtype": dtype_name(activations),
        "kv_grad_reduce_scatter_dtype": dtype_name(plan.cp_reduce_dtype),
        "softmax_merge": "none: each rank's queries attend to the all-gathered keys and values "
        "in one SDPA call (no partial outputs or log-sum-exps to merge)",
    }


def attention_summary(plan: PrecisionPlan, model: nn.Module) -> dict[str, Any]:
    """The report's attention section: the backend every layer calls and why (the plan's
    decision), each layer's mask (window, sinks), and the dtypes of the op."""
    layers = {}
    for name, module in _named_modules(model):
        if not (name.endswith("attention") and hasattr(module, "wo")):
            continue
        core = getattr(module, "core", None)
        window, sinks = getattr(core, "window", None), hasattr(core, "sinks")
        masks = ", ".join(([f"sliding window {window}"] if window else []) + (["sinks (fp32 merge)"] if sinks else []))
        op = "flex_attention (BlockMask)" if plan.attention_backend == "flex" else "scaled_dot_product_attention"
        if plan.attention_backend == "sdpa" and core is not None:
            op = "matmul + softmax in fp32 (sinks: no SDPA kernel takes a sink column)"
        layers[name] = f"{op}{'; ' + masks if masks else ''}"
    return {
        "backend": plan.attention_backend,
        "reason": plan.attention_reason,
        "softmax_statistics_dtype": "float32",
        "output_dtype": "the dtype of q, k, v (the compute dtype; float32 in fp32 islands)",
        "layers": layers,
    }


def fault_tolerance_summary(plan: PrecisionPlan) -> dict[str, Any] | None:
    """The report's fault-tolerance section (None when fault_tolerance.enable is off); the
    report adds the dtypes the param groups reduce in, or under DiLoCo the bytes of a sync."""
    if not plan.replica_groups:
        return None
    if plan.sync_steps:
        outer = short_name(plan.outer_state_dtype)
        return {
            "replica_groups": plan.replica_groups,
            "semi_sync_method": "diloco",
            "sync_steps": plan.sync_steps,
            "cross_group_allreduce": f"torchft Manager.allreduce every {plan.sync_steps} steps: average of "
            f"the pseudo-gradients (global - local weights, computed in fp32) in "
            f"{short_name(plan.pseudo_gradient_dtype)}; no per-step all-reduce",
            "pseudo_gradient_dtype": dtype_name(plan.pseudo_gradient_dtype),
            "global_weights_dtype": dtype_name(plan.outer_state_dtype),
            "outer_optimizer": f"Nesterov SGD in {outer} on the {outer} global weights, {outer} momentum",
        }
    return {
        "replica_groups": plan.replica_groups,
        "cross_group_allreduce": "torchft Manager.allreduce: average over the groups in the step's "
        "quorum, in each param group's reduce_dtype (cross_group_dtype)",
    }


def optimizer_summary(plan: PrecisionPlan) -> dict[str, Any]:
    """The report's optimizer section: the moments' dtype, the update's math, the weights' rounding."""
    mixed = plan.mixed_state_optimizer
    return {
        "state_dtype": dtype_name(plan.optimizer_state_dtype),
        "update": (
            "fp32 math per parameter (AdamWMixedState)" if mixed else f"torch AdamW in {short_name(plan.storage_dtype)}"
        ),
        "weight_rounding": "stochastic" if plan.stochastic_rounding else "nearest",
    }


def _fault_tolerance(plan: PrecisionPlan, groups: list[dict[str, Any]], model: nn.Module) -> dict[str, Any] | None:
    """The plan's fault-tolerance section with the dtypes the cross-group all-reduce carries (and
    under DiLoCo the bytes of one sync)."""
    summary = fault_tolerance_summary(plan)
    if summary is not None and plan.sync_steps:
        wire = summary["pseudo_gradient_dtype"]
        summary["cross_group_allreduce_dtypes"] = [wire]
        # Every trained parameter's shard crosses once per sync (this rank), the whole model per group.
        trained = [p for _, p in _named_parameters(model) if p.requires_grad]
        # The floating-point persistent buffers (MoE's expert biases) ride along, whole on every rank.
        buffers = synced_buffer_elements([model])
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in trained) + buffers
        summary["bytes_per_sync"] = {
            "this_rank": local * DTYPE_BYTES[wire],
            "group": (sum(p.numel() for p in trained) + buffers) * DTYPE_BYTES[wire],
        }
    elif summary is not None:
        dtypes = {g["reduce_dtype"] for g in groups if g["reduce_dtype"] != "-"}
        summary["cross_group_allreduce_dtypes"] = sorted(dtypes)
    return summary


def _stored_as(p: nn.Parameter) -> str:
    return "nf4" if type(p).__name__ == "NF4Tensor" else dtype_name(p.dtype)


def _lora(plan: PrecisionPlan, model: nn.Module) -> dict[str, Any] | None:
    """[lora]: each part's storage / compute / grad dtype as decided, and the adapted modules."""
    if plan.lora is None:
        return None
    lp = plan.lora
    adapted = sorted(n for n, m in _named_modules(model) if hasattr(m, "lora_A"))
    return {
        "rank": lp.rank,
        "alpha": lp.alpha,
        "scaling": lp.scaling,
        "dropout": lp.dropout,
        "target_modules": list(lp.targets),
        "adapted_modules": adapted,
        **lp.parts(),
    }


def report(plan: PrecisionPlan, model: nn.Module) -> dict[str, Any]:
    groups = param_groups(plan, model)
    return {
        "path": plan.path,
        "param_dtype": dtype_name(plan.param_dtype),
        "reduce_dtype": dtype_name(plan.reduce_dtype),
        "output_dtype": dtype_name(plan.output_dtype),
        "storage_dtype": dtype_name(plan.storage_dtype),
        "autocast_dtype": dtype_name(plan.autocast_dtype) if plan.autocast_dtype else None,
        "comm_hook": plan.comm_hook,
        "grad_scaler": plan.grad_scaler,
        "lower_precision_safe_modules": [_class_name(c) for c in plan.safe_modules],
        "fp32_modules": sorted({g["module_type"] for g in groups if g["compute_dtype"] == "float32"}),
        "fp32_islands": list(FP32_ISLANDS),
        "param_groups": groups,
        "mixed_precision_enabled": plan.enabled_setting,
        "decision": plan.decision,
        "low_precision_matmul": plan.speed.to_dict() if plan.speed else None,
        "compute_dtypes": [dtype_name(d) for d in plan.compute_dtypes],
        "notes": list(plan.notes),
        "warnings": list(plan.warnings),
        "fp8": plan.fp8,
        "fp8_modules": sorted(n for n, m in _named_modules(model) if type(m).__name__ == "Float8Linear"),
        "fp8_all_gather": plan.fp8_all_gather,
        "block_scaled": _block_scaled(plan, model),
        "fp32_module_names": list(plan.fp32_names),
        "optimizer": optimizer_summary(plan),
        "context_parallel": context_parallel_summary(plan),
        "attention": attention_summary(plan, model),
        "router": router_summary(plan, model),
        "expert_parallel": expert_parallel_summary(plan),
        "fault_tolerance": _fault_tolerance(plan, groups, model),
        "frozen": {n: _stored_as(p) for n, p in _named_parameters(model) if not p.requires_grad},
        "lora": _lora(plan, model),
        "fp32_by_name": sorted(
            n
            for n, m in _named_modules(model)
            if getattr(m, FP32_BY_NAME, False) and any(True for _ in m.parameters(recurse=False))
        ),
    }


def log_and_write_report(
    plan: PrecisionPlan, model: nn.Module, dump_folder: str, is_writer: bool, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write the precision report to `dump_folder`/precision_report.json and log its start-up
    table; returns the report written (the plan's sections and `extra`'s).

    Args:
        plan: the precision plan the job trains under.
        model: the model after parallelize, whose modules and parameters the report lists.
        dump_folder: the job's output folder; created when missing.
        is_writer: whether this rank writes the file and logs the table (one rank does);
            every rank computes the report.
        extra: sections the job adds (gradient collectives and bytes per parameter, which the
            memory model computes from this plan); None adds none.
    """
    written = {**report(plan, model), **(extra or {})}
    if is_writer:
        Path(dump_folder).mkdir(parents=True, exist_ok=True)
        (Path(dump_folder) / "precision_report.json").write_text(json.dumps(written, indent=2) + "\n")
        logger.info("precision: %s", plan.decision)
        logger.info("attention: %s (%s)", plan.attention_backend, plan.attention_reason)
        for name, what in written["attention"]["layers"].items():
            logger.info("  %s: %s", name, what)
        for warning in plan.warnings:
            logger.warning("precision: %s", warning)
        logger.info(
            "precision: path=%s param=%s reduce=%s output=%s comm_hook=%s scaler=%s",
            plan.path,
            short_name(plan.param_dtype),
            short_name(plan.reduce_dtype),
            short_name(plan.output_dtype),
            plan.comm_hook,
            plan.grad_scaler,
        )
        _log_fault_tolerance(written.get("fault_tolerance"))
        logger.info("  %-40s %12s %8s %8s %8s", "module type", "params", "storage", "compute", "reduce")
        for g in written["param_groups"]:
            logger.info(
                "  %-40s %12s %8s %8s %8s",
                g["module_type"].rsplit(".", 1)[-1] + ("" if g["trained"] else " (frozen)"),
                f"{g['num_params']:,}",
                *(short_name(g[k]) for k in ("storage_dtype", "compute_dtype", "reduce_dtype")),
            )
        opt = written["optimizer"]
        logger.info(
            "  optimizer: AdamW moments %s, update %s, weights rounded to %s",
            short_name(plan.optimizer_state_dtype),
            opt["update"],
            opt["weight_rounding"],
        )
        _log_experts_and_context_parallel(written)
        for name, by_dtype in written.get("gradient_collectives", {}).items():
            logger.info(
                "  gradient collective %s: %s per step",
                name,
                ", ".join(f"{n:,} B {short_name(d)}" for d, n in sorted(by_dtype.items())),
            )
        _log_block_scaled(written["block_scaled"])
        for note in plan.notes:
            logger.info("  note: %s", note)
    return written


def _log_fault_tolerance(ft: dict[str, Any] | None) -> None:
    """The start-up table's torchft line: DiLoCo's pseudo-gradient syncs, or the per-step
    cross-group all-reduce; nothing without fault tolerance."""
    if ft is not None and ft.get("semi_sync_method") == "diloco":
        logger.info(
            "precision: DiLoCo (torchft, up to %d groups): pseudo-gradients averaged every %d steps in "
            "%s (%s B per sync on this rank); %s",
            ft["replica_groups"],
            ft["sync_steps"],
            ft["pseudo_gradient_dtype"],
            f"{ft['bytes_per_sync']['this_rank']:,}",
            ft["outer_optimizer"],
        )
    elif ft is not None:
        logger.info(
            "precision: cross-group all-reduce (torchft, up to %d groups) in %s",
            ft["replica_groups"],
            ", ".join(ft["cross_group_allreduce_dtypes"]),
        )


def _log_experts_and_context_parallel(written: dict[str, Any]) -> None:
    """The start-up table's lines for MoE routers, expert parallel and context parallel, each
    where the job has it."""
    router = written["router"]
    if router is not None:
        logger.info(
            "  %d MoE routers: logits, scores, top-k and combine weights in %s; parameters %s",
            router["routers"],
            router["router_dtype"],
            router["parameters"],
        )
    ep = written["expert_parallel"]
    if ep is not None:
        logger.info(
            "  expert parallel %d: tokens dispatched and combined by all-to-all in %s, weighted sums in float32",
            ep["degree"],
            ep["dispatch_dtype"],
        )
    cp = written["context_parallel"]
    if cp is not None:
        logger.info(
            "  context parallel %d: K/V all-gathered in %s, their gradients reduce-scattered in %s; "
            "no softmax merge (one attention call per rank)",
            cp["degree"],
            cp["kv_all_gather_dtype"],
            cp["kv_grad_reduce_scatter_dtype"],
        )


def _log_block_scaled(section: dict[str, Any] | None) -> None:
    """The start-up table's block-scaled lines: the format of each pass, the Linears kept out."""
    if section is None:
        return
    logger.info(
        "  block-scaled %s%s: %d Linears / expert weights",
        section["format"],
        " (emulated)" if section["emulated"] else " (torchao kernels)",
        len(section["modules"]),
    )
    for what, operands in section["recipe"].items():
        logger.info("    %-7s %s", what, operands)
    logger.info("    kept out (plan's compute dtype): %s", ", ".join(section["kept_out"]) or "none")


def _block_scaled(plan: PrecisionPlan, model: nn.Module) -> dict[str, Any] | None:
    """The emulation's section, or torchao's (the modules it converted to, their settings)."""
    named = _named_modules(model)
    if plan.block_scaled_emulated:
        return block_scaled.summary(plan.block_scaled, True, named)
    return torchao_kernels.summary(plan.block_scaled, named)
