"""Block-scaled training (MXFP8, NVFP4) as the precision plan decided it.

precision/plan.py decides (the recipe, the patterns kept out, emulated or on torchao's kernels:
blockscaled_torchao.py probes and converts for the latter). This module realises the emulated
decision on a model: the rule naming the Linears a recipe converts (`is_block_scaled_linear`, the
same rule the report, the audit and the torchao path read), the module swap (`apply_block_scaled`:
nn.Linear -> BlockScaledLinear, parameters kept, so names and checkpoints are unchanged), the
report's section, and the audit's check of the GEMMs one step ran.

The emulation (blockscaled_linear.py: operands quantized bit-exactly, fp32 GEMMs): under FSDP the
weight is all-gathered in the plan's param / storage dtype and quantized inside the module: there
is no MX / NVFP4 all-gather (nor has torchao 0.18 one for training: blockscaled_torchao.py).
Under tensor parallel each rank quantizes its shards: `check_tensor_parallel` refuses, at job
resolution, a split that would cut a block between ranks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.blockscaled_linear import BlockScaledLinear, BlockScaledRecipe, GemmRecord
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN

# torchao's MX / NVFP4 training GEMMs run on the tensor cores of compute capability 10.0 (B200,
# GB200) and up; Hopper (H100, H200) has fp8 but no block-scaled MMA.
KERNEL_CAPABILITY = (10, 0)
# What the emulation costs against a bf16 F.linear, forward + backward (benchmarks/blockscaled_speed.py
# on the 2-core CPU of docs/performance.md): said in the start-up line and the refusal.
EMULATION_COST = "about 4-7x slower than bf16 on a 2-core AVX512 CPU"


def recipe_of(fmt: str, scale_mode: str, weight_2d: bool, rht: bool, sr: bool, seed: int) -> BlockScaledRecipe | None:
    """The config's recipe (None: block_scaled = "none"); the nvfp4 options apply to nvfp4 only."""
    if fmt == "none":
        return None
    if fmt == "mxfp8":
        return BlockScaledRecipe("mxfp8", mx_scale_mode=scale_mode, seed=seed)
    return BlockScaledRecipe("nvfp4", weight_2d=weight_2d, rht=rht, stochastic_rounding=sr, seed=seed)


def edge_patterns(n_layers: int, edge: int) -> tuple[str, ...]:
    """fnmatch patterns of the first and last `edge` of `n_layers` blocks (names "layers.<i>")."""
    keep = sorted(set(range(min(edge, n_layers))) | set(range(max(n_layers - edge, 0), n_layers)))
    return tuple(p for i in keep for p in (f"layers.{i}", f"layers.{i}.*"))


def skip_patterns(skip: Iterable[str], edge: int, n_layers: int) -> tuple[str, ...]:
    return (*skip, *edge_patterns(n_layers, edge))


def is_block_scaled_linear(name: str, module: nn.Module, recipe: BlockScaledRecipe | None,
                           skip: tuple[str, ...]) -> bool:
    """Whether `module` (named `name` in the whole model) runs block-scaled: an nn.Linear (a
    BlockScaledLinear is one) not kept fp32 by name, not frozen, and matching no skip pattern
    (`skip_patterns`: the configured ones and the edge blocks)."""
    return (recipe is not None and isinstance(module, nn.Linear)
            and not getattr(module, FP32_BY_NAME, False) and not getattr(module, FROZEN, False)
            and not any(fnmatch.fnmatchcase(name, p) for p in skip))


def n_layers_of(model: nn.Module) -> int:
    layers = getattr(model, "layers", None)
    return len(layers) if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else 0


def check_modules(model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int) -> None:
    """Every configured skip pattern names a Linear of the model (a typo would convert it), and the
    recipe converts at least one Linear (edge blocks and skips can cover them all)."""
    if recipe is None:
        return
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for p in skip:
        if not any(fnmatch.fnmatchcase(n, p) for n, _ in linears):
            raise PrecisionError(f"'mixed_precision.block_scaled_skip_modules' entry {p!r} matches no nn.Linear "
                                 "of the model (names such as 'output', 'layers.0.*')")
    every = skip_patterns(skip, edge, n_layers_of(model))
    if not any(is_block_scaled_linear(n, m, recipe, every) for n, m in linears):
        raise PrecisionError(f"'mixed_precision.block_scaled' = '{recipe.format}' converts no nn.Linear: "
                             f"block_scaled_edge_layers = {edge} and block_scaled_skip_modules keep them all")


def check_tensor_parallel(model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int,
                          tp: int, sharded_dim: dict[str, int]) -> None:
    """Under tensor parallel every converted Linear's sharded dim splits into whole blocks: its
    local length a multiple of the recipe's block (32 MXFP8, 16 NVFP4, 2-D tiles 16), so no block
    straddles two ranks and each rank quantizes its shard's blocks as one device would.
    `sharded_dim[name]`: 0 for a column-wise Linear (out_features split: dgrad's reduction dim),
    1 for a row-wise one (in_features split: the forward's and the 2-D tiles' dim)."""
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
                f"block_scaled_skip_modules or use a tensor_parallel_degree that divides it into whole blocks")


def apply_block_scaled(model: nn.Module, recipe: BlockScaledRecipe | None, skip: tuple[str, ...], edge: int) -> list[str]:
    """Swap the model's block-scaled Linears for BlockScaledLinear (the whole model, before
    splitting and parallelizing: the edge blocks are counted on it); returns their names. Each
    gets its own stochastic-rounding stream, numbered in model order."""
    if recipe is None:
        return []
    every = skip_patterns(skip, edge, n_layers_of(model))
    chosen = [(n, m) for n, m in model.named_modules() if is_block_scaled_linear(n, m, recipe, every)
              and not isinstance(m, BlockScaledLinear)]
    for stream, (name, linear) in enumerate(chosen):
        parent_name, _, child = name.rpartition(".")
        new = BlockScaledLinear.from_linear(linear, recipe, sr_stream=stream)
        new.label = name
        for tag in (FP32_BY_NAME, FROZEN):
            if hasattr(linear, tag):
                setattr(new, tag, getattr(linear, tag))
        setattr(model.get_submodule(parent_name), child, new)
    return [n for n, _ in chosen]


def seed_step(parts: list[nn.Module], step: int) -> None:
    """Seed every stochastically rounding BlockScaledLinear's generator from (recipe seed, its
    stream, `step`) before the step: the draws then depend on the step number alone, so a run
    resumed from a checkpoint draws what the uninterrupted run drew, with no generator state saved."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, BlockScaledLinear) and m.recipe.stochastic_rounding:
                seed = ((m.recipe.seed * 1_000_003 + m.sr_stream) * 1_000_033 + step) % 2**63
                if m.generator is None or m.generator.device != m.weight.device:
                    m.generator = torch.Generator(device=m.weight.device)
                m.generator.manual_seed(seed)


def summary(recipe: BlockScaledRecipe | None, emulated: bool, named: list[tuple[str, nn.Module]]) -> dict[str, Any] | None:
    """The report's block_scaled section: each converted module's format per pass, the Linears kept
    out (they compute in the plan's dtype)."""
    if recipe is None:
        return None
    return {"format": recipe.format, "emulated": emulated, "recipe": recipe.describe(),
            "modules": {n: recipe.describe() for n, m in named if isinstance(m, BlockScaledLinear)},
            "kept_out": sorted(n for n, m in named if isinstance(m, nn.Linear) and not isinstance(m, BlockScaledLinear))}


# ----------------------------------------------------------------------------- the audit's check


def promised_operands(recipe: BlockScaledRecipe) -> dict[str, tuple[tuple[Any, ...], tuple[Any, ...]]]:
    """Per pass, what each operand must be quantized to: (elements, scales, block, rounding, rht)."""
    if recipe.format == "mxfp8":
        mx = ("float8_e4m3fn", "float8_e8m0fnu", (1, 32), "rne", False)
        return {"forward": (mx, mx), "dgrad": (mx, mx), "wgrad": (mx, mx)}
    row = ("float4_e2m1fn", "float8_e4m3fn", (1, 16))
    w = (*row[:2], (16, 16) if recipe.weight_2d else (1, 16), "rne", False)
    grad = "stochastic" if recipe.stochastic_rounding else "rne"
    return {"forward": ((*row, "rne", False), w), "dgrad": ((*row, grad, False), w),
            "wgrad": ((*row, grad, recipe.rht), (*row, "rne", recipe.rht))}


def operand_seen(record: GemmRecord) -> tuple[str, str, list[Any]]:
    """(module, pass, [a, b]) of one GEMM, in a form all_gather_object carries and JSON writes."""
    info = [[i.elements, i.scales, list(i.block), i.rounding, i.rht] for i in (record.a, record.b)]
    return record.module, record.what, info


def _words(operands: Any) -> str:
    return "; ".join(f"{e} {s} {b[0]}x{b[1]} {r}{' RHT' if h else ''}" for e, s, b, r, h in operands)


def check_gemms(seen: dict[str, dict[str, list[list[Any]]]], promised: Iterable[str], kept_out: Iterable[str],
                recipe: BlockScaledRecipe) -> list[tuple[str, list[str], list[str]]]:
    """(what, promised, seen) for each breach: a promised module whose forward, dgrad or wgrad GEMM
    was not seen in the recipe's format (or not seen block-scaled at all), a kept-out module
    that ran a block-scaled GEMM. `seen`: module -> pass -> distinct operand lists."""
    want = {p: _words(ops) for p, ops in promised_operands(recipe).items()}
    breaches = []
    for name in sorted(promised):
        for what, words in want.items():
            got = sorted({_words(ops) for ops in seen.get(name, {}).get(what, [])})
            if got != [words]:
                breaches.append((f"{name}: {what} GEMM", [f"{recipe.format} {words}"],
                                 got or ["no block-scaled GEMM (ran as a plain matmul)"]))
    for name in sorted(kept_out):
        if seen.get(name):
            breaches.append((f"{name}: block-scaled GEMMs", ["none (kept out of block_scaled)"], sorted(seen[name])))
    return breaches
