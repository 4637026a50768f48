"""Block-scaled training (MXFP8, NVFP4) as the precision plan decided it.

precision/plan.py decides (the recipe, the patterns kept out, emulated or on torchao's kernels:
lowbit/capability.py probes for the latter). This module realises the decision on a model: the
rules naming the Linears and the grouped experts a recipe converts (`is_block_scaled_linear`,
`is_block_scaled_experts`, the same rules the report and the audit read), the conversion
(`apply_block_scaled`: nn.Linear -> lowbit/linear.py's BlockScaledLinear, and with
mixed_precision.block_scaled_experts each GroupedExperts' GEMMs run by lowbit/grouped.py's
BlockScaledExperts; on torchao's kernels `apply_torchao`: nn.Linear -> lowbit/torchao_kernels.py's
module; parameters kept, so names and checkpoints are unchanged), the report's
section, and the audit's check of the GEMMs one step ran. The experts' GEMMs are named by their
weights (`layers.1.feed_forward.experts.w1`, `.w2`, `.w3`); the router and the shared expert's
gates are not grouped experts: the router stays in its router_dtype, the shared expert's Linears
follow the Linear rule.

The emulation (lowbit/linear.py: operands quantized bit-exactly, fp32 GEMMs): under FSDP the
weight is all-gathered in the plan's param / storage dtype and quantized inside the module: there
is no MX / NVFP4 all-gather (nor has torchao 0.18 one for training: lowbit/torchao_kernels.py).
Under tensor parallel each rank quantizes its shards: `check_tensor_parallel` refuses, at job
resolution, a split that would cut a block between ranks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.models.moe.moe import GroupedExperts
from torchtitan_amp.precision.lowbit import torchao_kernels
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.grouped import BlockScaledExperts
from torchtitan_amp.precision.lowbit.linear import BlockScaledLinear, GemmRecord, sr_key
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN


def edge_patterns(n_layers: int, edge: int) -> tuple[str, ...]:
    """fnmatch patterns of the first and last `edge` of `n_layers` blocks (names "layers.<i>")."""
    keep = sorted(set(range(min(edge, n_layers))) | set(range(max(n_layers - edge, 0), n_layers)))
    return tuple(p for i in keep for p in (f"layers.{i}", f"layers.{i}.*"))


def skip_patterns(skip: Iterable[str], edge: int, n_layers: int) -> tuple[str, ...]:
    """Every fnmatch pattern a recipe keeps out: the configured ones, then the edge blocks'.

    Args:
        skip: the configured patterns (mixed_precision.block_scaled_skip_modules).
        edge: how many blocks at each end are kept out (block_scaled_edge_layers); 0 for none.
        n_layers: the model's number of transformer blocks.
    """
    return (*skip, *edge_patterns(n_layers, edge))


def is_block_scaled_linear(
    name: str, module: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...]
) -> bool:
    """Whether `module` runs block-scaled: an nn.Linear (a BlockScaledLinear is one) not kept fp32
    by name, not frozen, and matching no skip pattern.

    Args:
        name: the module's name in the whole model.
        module: the module asked about.
        recipe: the plan's block-scaled recipe; None (block_scaled = "none") answers False.
        skip: every pattern kept out (`skip_patterns`: the configured ones and the edge blocks).
    """
    return (
        recipe is not None
        and isinstance(module, nn.Linear)
        and not getattr(module, FP32_BY_NAME, False)
        and not getattr(module, FROZEN, False)
        and not any(fnmatch.fnmatchcase(name, p) for p in skip)
    )


def is_block_scaled_experts(
    name: str, module: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], experts: bool
) -> bool:
    """Whether the grouped experts `module` run block-scaled: the recipe is on, the experts are
    asked for, and the same exclusions as a Linear (fp32 by name, frozen, a skip pattern or an
    edge block) keep them in.

    Args:
        name: the module's name in the whole model.
        module: the module asked about (a GroupedExperts, else the answer is False).
        recipe: the plan's block-scaled recipe; None (block_scaled = "none") answers False.
        skip: every pattern kept out (`skip_patterns`: the configured ones and the edge blocks).
        experts: mixed_precision.block_scaled_experts: the routed experts are in the recipe too.
    """
    return (
        experts
        and recipe is not None
        and isinstance(module, GroupedExperts)
        and not getattr(module, FP32_BY_NAME, False)
        and not getattr(module, FROZEN, False)
        and not any(fnmatch.fnmatchcase(name, p) for p in skip)
    )


def expert_gemm_labels(name: str) -> list[str]:
    """The names a GroupedExperts module's GEMMs are reported and audited under."""
    return [f"{name}.{w}" for w in ("w1", "w2", "w3")]


def n_layers_of(model: nn.Module) -> int:
    layers = getattr(model, "layers", None)
    return len(layers) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else 0


def check_modules(
    model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int, experts: bool = False
) -> None:
    """Every configured skip pattern names a Linear (or, with `experts`, grouped experts) of the
    model (a typo would convert it), the recipe converts at least one Linear (edge blocks and
    skips can cover them all), and `experts` has grouped experts to convert. Raises
    PrecisionError naming the first that fails.

    Args:
        model: the whole model, before conversion.
        recipe: the plan's block-scaled recipe; None (block_scaled = "none"): nothing to check.
        skip: fnmatch patterns of module names kept out (mixed_precision.block_scaled_skip_modules).
        edge: the first and last `edge` transformer blocks kept out (block_scaled_edge_layers).
        experts: mixed_precision.block_scaled_experts: the routed experts are in the recipe too.
    """
    if recipe is None:
        return
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    grouped = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)] if experts else []
    for p in skip:
        if not any(fnmatch.fnmatchcase(n, p) for n, _ in [*linears, *grouped]):
            raise PrecisionError(
                f"'mixed_precision.block_scaled_skip_modules' entry {p!r} matches no nn.Linear "
                f"{'or grouped experts ' if experts else ''}of the model (names such as 'output', "
                "'layers.0.*')"
            )
    if experts and not any(
        is_block_scaled_experts(n, m, recipe, skip_patterns(skip, edge, n_layers_of(model)), True) for n, m in grouped
    ):
        raise PrecisionError(
            "'mixed_precision.block_scaled_experts' = true converts no grouped experts: "
            + (
                "the model has none (a mixture-of-experts model has them)"
                if not grouped
                else f"block_scaled_edge_layers = {edge} and block_scaled_skip_modules keep them all"
            )
        )
    every = skip_patterns(skip, edge, n_layers_of(model))
    if not any(is_block_scaled_linear(n, m, recipe, every) for n, m in linears):
        raise PrecisionError(
            f"'mixed_precision.block_scaled' = '{recipe.format}' converts no nn.Linear: "
            f"block_scaled_edge_layers = {edge} and block_scaled_skip_modules keep them all"
        )


def check_tensor_parallel(
    model: nn.Module,
    recipe: BlockScaledRecipe | None,
    skip: tuple[str, ...],
    edge: int,
    tp: int,
    sharded_dim: dict[str, int],
) -> None:
    """Under tensor parallel every converted Linear's sharded dim splits into whole blocks: its
    local length a multiple of the recipe's block (32 MXFP8, 16 NVFP4, 2-D tiles 16), so no block
    straddles two ranks and each rank quantizes its shard's blocks as one device would. Raises
    PrecisionError naming the first Linear that does not.

    Args:
        model: the whole model, before parallelizing.
        recipe: the plan's block-scaled recipe; None (block_scaled = "none"): nothing to check.
        skip: fnmatch patterns of module names kept out (mixed_precision.block_scaled_skip_modules).
        edge: the first and last `edge` transformer blocks kept out (block_scaled_edge_layers).
        tp: the tensor-parallel degree; 1 checks nothing.
        sharded_dim: by Linear name, the weight dim tensor parallel splits: 0 for a column-wise
            Linear (out_features split: dgrad's reduction dim), 1 for a row-wise one (in_features
            split: the forward's and the 2-D tiles' dim); Linears absent are not split.
    """
    if recipe is None or tp == 1:
        return
    every = skip_patterns(skip, edge, n_layers_of(model))
    for name, m in model.named_modules():
        if name not in sharded_dim or not is_block_scaled_linear(name, m, recipe, every):
            continue
        dim = sharded_dim[name]
        full = m.weight.shape[dim]
        if full % tp or (full // tp) % recipe.block_size:
            field = "out_features" if dim == 0 else "in_features"
            raise PrecisionError(
                f"'mixed_precision.block_scaled' = '{recipe.format}' under parallelism.tensor_parallel_degree = {tp}: "
                f"{name} splits its {field} {full} into {full / tp:g} per rank, not a multiple of the "
                f"{recipe.block_size}-element block (a block would straddle ranks); keep it out with "
                f"block_scaled_skip_modules or use a tensor_parallel_degree that divides it into whole blocks"
            )


def apply_block_scaled(
    model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int, experts: bool = False
) -> list[str]:
    """Swap the model's block-scaled Linears for BlockScaledLinear and, with `experts`, give each
    block-scaled GroupedExperts a BlockScaledExperts; returns the converted modules' names. Each
    gets its own stochastic-rounding stream, numbered in model order.

    Args:
        model: the whole model, converted in place before splitting and parallelizing (the edge
            blocks are counted on it).
        recipe: the plan's block-scaled recipe; None (block_scaled = "none"): converts nothing.
        skip: fnmatch patterns of module names kept out (mixed_precision.block_scaled_skip_modules).
        edge: the first and last `edge` transformer blocks kept out (block_scaled_edge_layers).
        experts: mixed_precision.block_scaled_experts: the routed experts are in the recipe too.
    """
    if recipe is None:
        return []
    every = skip_patterns(skip, edge, n_layers_of(model))
    chosen = [
        (n, m)
        for n, m in model.named_modules()
        if is_block_scaled_linear(n, m, recipe, every) and not isinstance(m, BlockScaledLinear)
    ]
    grouped = [(n, m) for n, m in model.named_modules() if is_block_scaled_experts(n, m, recipe, every, experts)]
    for stream, (name, module) in enumerate(grouped, start=len(chosen)):
        module.block_scaled_mm = BlockScaledExperts(recipe, name, stream)
    for stream, (name, linear) in enumerate(chosen):
        parent_name, _, child = name.rpartition(".")
        new = BlockScaledLinear.from_linear(linear, recipe, sr_stream=stream)
        new.label = name
        for tag in (FP32_BY_NAME, FROZEN):
            if hasattr(linear, tag):
                setattr(new, tag, getattr(linear, tag))
        setattr(model.get_submodule(parent_name), child, new)
    return [n for n, _ in [*chosen, *grouped]]


def apply_torchao(model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int) -> list[str]:
    """Swap the model's block-scaled Linears (`is_block_scaled_linear`) for torchao's training
    modules (lowbit/torchao_kernels.py), keeping their Parameters; returns their names. Every
    shape is checked before any module is swapped.

    Args:
        model: the whole model, converted in place before splitting and parallelizing.
        recipe: the plan's block-scaled recipe; None (block_scaled = "none"): converts nothing.
        skip: fnmatch patterns of module names kept out (mixed_precision.block_scaled_skip_modules).
        edge: the first and last `edge` transformer blocks kept out (block_scaled_edge_layers).
    """
    if recipe is None:
        return []
    every = skip_patterns(skip, edge, n_layers_of(model))
    chosen = [
        (n, m)
        for n, m in model.named_modules()
        if is_block_scaled_linear(n, m, recipe, every) and not torchao_kernels.is_torchao_module(m)
    ]
    for name, linear in chosen:
        torchao_kernels.check_shape(name, linear, recipe.format)
    for stream, (name, linear) in enumerate(chosen):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, torchao_kernels.torchao_linear(linear, recipe, stream))
    return [n for n, _ in chosen]


def _sr_holders(part: nn.Module) -> Iterator[tuple[BlockScaledLinear | BlockScaledExperts, torch.device]]:
    """The block-scaled GEMM owners of `part` (Linears, experts' BlockScaledExperts) and their device."""
    for m in part.modules():
        if isinstance(m, BlockScaledLinear):
            yield m, m.weight.device
        elif isinstance(m, GroupedExperts) and isinstance(m.block_scaled_mm, BlockScaledExperts):
            yield m.block_scaled_mm, m.w1.device


def seed_step(parts: list[nn.Module], step: int, rank: int) -> None:
    """Seed every stochastically rounding BlockScaledLinear's and BlockScaledExperts' generator
    from (recipe seed, its stream, `step`, `rank`) before the step: the draws then depend on the
    step number and the rank alone, so a run resumed from a checkpoint on the same layout draws
    what the uninterrupted run drew, with no generator state saved.

    Args:
        parts: the model parts this rank holds.
        step: the step about to run.
        rank: trainer.run.sr_rank, telling apart the ranks that round different values of one
            step: data-parallel ranks (fault-tolerant replica groups included), context-parallel
            and tensor-parallel ranks. With one key for all of them every data-parallel rank
            would draw the same numbers, and a gradient of consistent sign would get rounding
            errors correlated across ranks, which the gradient mean does not average out;
            independent draws do (tests/test_blockscaled_train.py).
    """
    for part in parts:
        for holder, device in _sr_holders(part):
            if holder.recipe.stochastic_rounding:
                seed = sr_key(holder.recipe.seed, holder.sr_stream, step, rank)
                if holder.generator is None or holder.generator.device != device:
                    holder.generator = torch.Generator(device=device)
                holder.generator.manual_seed(seed)


def experts_gemms(named: Iterable[tuple[str, nn.Module]], converted: bool) -> list[str]:
    """The GEMM names of the grouped experts that run block-scaled (`converted`) or do not."""
    return [
        g
        for n, m in named
        if isinstance(m, GroupedExperts) and (getattr(m, "block_scaled_mm", None) is not None) == converted
        for g in expert_gemm_labels(n)
    ]


def summary(
    recipe: BlockScaledRecipe | None, emulated: bool, named: list[tuple[str, nn.Module]]
) -> dict[str, Any] | None:
    """The report's block_scaled section: each converted module's format per pass (a grouped
    experts module per weight: its three GEMMs per expert), the Linears and experts kept out
    (they compute in the plan's dtype); None when the recipe is None.

    Args:
        recipe: the plan's block-scaled recipe, or None (block_scaled = "none").
        emulated: whether the GEMMs are emulated (True) or run on torchao's kernels (False).
        named: the model's modules with their names, after conversion.
    """
    if recipe is None:
        return None
    modules = {n: recipe.describe() for n, m in named if isinstance(m, BlockScaledLinear)}
    modules |= {g: recipe.describe() for g in experts_gemms(named, True)}
    kept = [n for n, m in named if isinstance(m, nn.Linear) and not isinstance(m, BlockScaledLinear)]
    return {
        "format": recipe.format,
        "emulated": emulated,
        "recipe": recipe.describe(),
        "modules": modules,
        "kept_out": sorted([*kept, *experts_gemms(named, False)]),
    }


# ----------------------------------------------------------------------------- the audit's check


def promised_operands(recipe: BlockScaledRecipe) -> dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """Per pass, what each operand must be quantized to: (elements, scales, block, rounding, rht)."""
    if recipe.format == "mxfp8":
        mx = ("float8_e4m3fn", "float8_e8m0fnu", (1, 32), "rne", False)
        return {"forward": (mx, mx), "dgrad": (mx, mx), "wgrad": (mx, mx)}
    row = ("float4_e2m1fn", "float8_e4m3fn", (1, 16))
    w = (*row[:2], (16, 16) if recipe.weight_2d else (1, 16), "rne", False)
    grad = "stochastic" if recipe.stochastic_rounding else "rne"
    return {
        "forward": ((*row, "rne", False), w),
        "dgrad": ((*row, grad, False), w),
        "wgrad": ((*row, grad, recipe.rht), (*row, "rne", recipe.rht)),
    }


def operand_seen(record: GemmRecord) -> tuple[str, str, list[Any]]:
    """(module, pass, [a, b]) of one GEMM, in a form all_gather_object carries and JSON writes."""
    info = [[i.elements, i.scales, list(i.block), i.rounding, i.rht] for i in (record.a, record.b)]
    return record.module, record.what, info


def _words(operands: Any) -> str:
    return "; ".join(f"{e} {s} {b[0]}x{b[1]} {r}{' RHT' if h else ''}" for e, s, b, r, h in operands)


def check_gemms(
    seen: dict[str, dict[str, list[list[Any]]]],
    promised: Iterable[str],
    kept_out: Iterable[str],
    recipe: BlockScaledRecipe,
) -> list[tuple[str, list[str], list[str]]]:
    """(what, promised, seen) for each breach: a promised module whose forward, dgrad or wgrad GEMM
    was not seen in the recipe's format (or not seen block-scaled at all), a kept-out module
    that ran a block-scaled GEMM.

    Args:
        seen: the GEMMs one step ran: module -> pass -> distinct operand lists.
        promised: names of the modules (Linears, experts' weights) the plan runs block-scaled.
        kept_out: names of the modules the plan keeps in its compute dtype.
        recipe: the block-scaled recipe the promised GEMMs must be in.
    """
    want = {p: _words(ops) for p, ops in promised_operands(recipe).items()}
    breaches = []
    for name in sorted(promised):
        for what, words in want.items():
            got = sorted({_words(ops) for ops in seen.get(name, {}).get(what, [])})
            if got != [words]:
                breaches.append(
                    (
                        f"{name}: {what} GEMM",
                        [f"{recipe.format} {words}"],
                        got or ["no block-scaled GEMM (ran as a plain matmul)"],
                    )
                )
    for name in sorted(kept_out):
        if seen.get(name):
            breaches.append((f"{name}: block-scaled GEMMs", ["none (kept out of block_scaled)"], sorted(seen[name])))
    return breaches
