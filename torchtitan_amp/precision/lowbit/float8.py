"""float8 training through torchao, as the precision plan decided it.

precision/plan.py decides (recipe, skipped modules, fp8 all-gather) and refuses what cannot hold,
asking lowbit/capability.py whether torchao and the device can run fp8 (fp8_torchao_missing,
fp8_matmul_unsupported); this module names the Linears a recipe converts and converts them
(torchao's Float8Linear keeps its weight in the storage dtype and casts to float8_e4m3fn per matmul
with dynamic scales, so checkpoints hold no fp8 state to restore). torchao is imported only when fp8
is asked for. The functions take the plan's values (recipe, skip patterns, all-gather), not the plan.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN, tied_modules

# torch._scaled_mm needs both matmul dimensions of the weight to be multiples of 16.
_ALIGNMENT = 16


def convertible(name: str, module: nn.Module, skip: tuple[str, ...], keep_fp32: Callable[[nn.Module], bool]) -> bool:
    """Whether torchao may swap `module` for a Float8Linear: an nn.Linear not kept in fp32, not
    skipped by name, with both dims multiples of 16 (torch._scaled_mm's alignment).

    Args:
        name: the module's name in the whole model.
        module: the module asked about.
        skip: fnmatch patterns of module names (in the whole model) kept out of fp8
            (mixed_precision.fp8_skip_modules).
        keep_fp32: says whether the plan keeps a module in fp32 (tagged by name, or frozen).
    """
    return (
        isinstance(module, nn.Linear)
        and not keep_fp32(module)
        and not any(fnmatch.fnmatchcase(name, p) for p in skip)
        and module.in_features % _ALIGNMENT == 0
        and module.out_features % _ALIGNMENT == 0
    )


def unmatched_patterns(model: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """Skip patterns that name no Linear of `model` (a typo would silently convert the module)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [p for p in skip if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def convert(
    model: nn.Module, recipe: str, skip: tuple[str, ...], all_gather: bool, keep_fp32: Callable[[nn.Module], bool]
) -> list[str]:
    """Swap the convertible Linears of `model` for torchao Float8Linear (not those `keep_fp32`
    says the plan keeps in fp32); returns their names.

    Args:
        model: the model, converted in place (before parallelizing).
        recipe: torchao's float8 recipe name, "tensorwise" or "rowwise".
        skip: fnmatch patterns of module names (in the whole model) kept out of fp8
            (mixed_precision.fp8_skip_modules).
        all_gather: whether FSDP all-gathers the weights in fp8 (tensorwise scaling only).
        keep_fp32: says whether the plan keeps a module in fp32 (not converted).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise, fp8 all-gather
    converted: list[str] = []

    def keep(module: nn.Module, name: str) -> bool:
        if convertible(name, module, skip, keep_fp32):
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return converted


def precompute_scales(parts: list[nn.Module]) -> None:
    """After each optimizer step with fp8 all-gather: one all-reduce computes every weight's scale
    for the next step's fp8 all-gathers (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


def _keep_fp32(module: nn.Module) -> bool:
    return getattr(module, FP32_BY_NAME, False) or getattr(module, FROZEN, False)


def check_fp8_modules(model: nn.Module, recipe: str, skip: tuple[str, ...]) -> None:
    """Every fp8 skip pattern names a Linear of the model (a typo would convert it), and no Linear
    whose weight another module shares (a tied output projection) is converted: the embedding
    would read a weight that fp8 all-gather and torchao's module swap do not keep one tensor.
    Raises PrecisionError naming the first that fails; nothing is checked when fp8 is off.

    Args:
        model: the model before conversion.
        recipe: the plan's float8 recipe, "none" (off), "tensorwise" or "rowwise".
        skip: fnmatch patterns of module names (in the whole model) kept out of fp8
            (mixed_precision.fp8_skip_modules).
    """
    if recipe != "none":
        unmatched = unmatched_patterns(model, skip)
        if unmatched:
            raise PrecisionError(
                f"'mixed_precision.fp8_skip_modules' entry {unmatched[0]!r} matches no "
                "nn.Linear of the model (names such as 'output', 'layers.0.*')"
            )
        for group in tied_modules(model):
            for name, module in group:
                if convertible(name, module, skip, _keep_fp32):
                    shared = next(n for n, _ in group if n != name)
                    raise PrecisionError(
                        f"'mixed_precision.fp8_skip_modules' must cover '{name}': its weight is "
                        f"shared with '{shared}' (model enable_weight_tying), which fp8 cannot keep"
                    )


def is_fp8_linear(name: str, module: nn.Module, recipe: str, skip: tuple[str, ...]) -> bool:
    """Whether `module` runs in fp8: the rule apply_fp8 converts by, also true of a Float8Linear it
    converted (still an nn.Linear).

    Args:
        name: the module's name in the whole model.
        module: the module asked about.
        recipe: the plan's float8 recipe, "none" (off), "tensorwise" or "rowwise".
        skip: fnmatch patterns of module names (in the whole model) kept out of fp8
            (mixed_precision.fp8_skip_modules).
    """
    return recipe != "none" and convertible(name, module, skip, _keep_fp32)


def apply_fp8(model: nn.Module, recipe: str, skip: tuple[str, ...], all_gather: bool) -> list[str]:
    """Convert the model's fp8 Linears (before parallelizing; not those tagged fp32 by name or
    frozen); returns their names (none when `recipe` is "none").

    Args:
        model: the model, converted in place.
        recipe: the plan's float8 recipe, "none" (off), "tensorwise" or "rowwise".
        skip: fnmatch patterns of module names (in the whole model) kept out of fp8
            (mixed_precision.fp8_skip_modules).
        all_gather: whether FSDP all-gathers the weights in fp8 (tensorwise scaling only).
    """
    if recipe == "none":
        return []
    return convert(model, recipe, skip, all_gather, keep_fp32=_keep_fp32)


def after_optimizer_step(model_parts: list[nn.Module], all_gather: bool) -> None:
    """With the fp8 all-gather, the next step's weight scales (see precompute_scales)."""
    if all_gather:
        precompute_scales(model_parts)
