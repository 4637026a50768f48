"""float8 training through torchao, as the precision plan decided it.

precision/plan.py decides (recipe, skipped modules, fp8 all-gather) and refuses what cannot hold,
asking this module whether torchao and the device can run fp8 (torchao_missing, matmul_unsupported);
this module names the Linears a recipe converts and converts them (torchao's Float8Linear keeps its
weight in the storage dtype and casts to float8_e4m3fn per matmul with dynamic scales, so
checkpoints hold no fp8 state to restore).
torchao is imported here only, and only when fp8 is asked for.

The plan imports this module for its probes, so the functions here take the plan's values (recipe,
skip patterns, all-gather) rather than the plan: fp8 stays one module without an import cycle.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.metadata
import logging
from collections.abc import Callable

import torch
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN, tied_modules

# torch._scaled_mm needs both matmul dimensions of the weight to be multiples of 16.
_ALIGNMENT = 16
# The version this module was tested with. What it uses of torchao.float8 (module swap through
# convert_to_float8_training, the "tensorwise" and "rowwise" recipes, the FSDP fp8 all-gather with
# its scale precompute) is checked by name rather than by an upper version bound: torchtitan dropped
# tensorwise and the fp8 all-gather in 2026-04 and torchao is moving fp8 training to weight-wrapper
# tensors, but no torchao release is known to lack them yet, and a bound would refuse one that has.
TESTED_TORCHAO = "0.18.0"
INSTALL = "pip install 'torchao>=0.18' (the project's [fp8] extra)"
_RECIPES = ("tensorwise", "rowwise")


def torchao_missing(recipe: str | None = None, all_gather: bool | None = None) -> str | None:
    """Why torchao cannot run `recipe` (with the FSDP fp8 all-gather if `all_gather`), or None.
    Left as None, each asks for everything this module can use."""
    # torchao's import logs a WARNING per optional CUDA kernel library it cannot load (fp4,
    # CUTLASS): noise on any machine without them, and not about float8 training.
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ImportError as e:
        return f"fp8 training needs torchao ({e}); {INSTALL}"
    finally:
        quiet.setLevel(level)
    lacking = _lacking(torchao.float8, _RECIPES if recipe is None else (recipe,), all_gather is not False)
    if lacking is not None:
        return (f"fp8 training needs {lacking}, which torchao {_version()} lacks; "
                f"pip install 'torchao=={TESTED_TORCHAO}' (the version tested)")
    return None


def _lacking(float8: object, recipes: tuple[str, ...], all_gather: bool) -> str | None:
    """The first of the torchao.float8 APIs this module calls that `float8` lacks, or None."""
    needed = ["Float8LinearConfig", "Float8LinearRecipeName", "convert_to_float8_training"]
    needed += ["precompute_float8_dynamic_scale_for_fsdp"] if all_gather else []
    for name in needed:
        if not hasattr(float8, name):
            return f"torchao.float8.{name}"
    config = float8.Float8LinearConfig  # type: ignore[attr-defined]
    if not hasattr(config, "from_recipe_name"):
        return "Float8LinearConfig.from_recipe_name"
    names = {r.value for r in float8.Float8LinearRecipeName}  # type: ignore[attr-defined]
    for recipe in recipes:
        if recipe not in names:
            return f"torchao's {recipe!r} float8 recipe"
    fields = {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else set()
    if all_gather and "enable_fsdp_float8_all_gather" not in fields:
        return "Float8LinearConfig.enable_fsdp_float8_all_gather (the FSDP fp8 all-gather)"
    return None


def _version() -> str:
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def probe_scales(recipe: str, m: int, n: int, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales torchao hands torch._scaled_mm under `recipe` for an [m, k] x [k, n] product:
    one fp32 scalar per operand (tensorwise), or one fp32 per row of the left operand ([m, 1])
    and per column of the right one ([1, n]) (rowwise)."""
    if recipe.startswith("rowwise"):
        return torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    return torch.ones((), device=device), torch.ones((), device=device)


@functools.cache
def matmul_unsupported(device_type: str, recipe: str = "tensorwise", run_kernel: bool = True) -> str | None:
    """Why `device_type` cannot run `recipe`'s float8 matmuls, or None: a GPU below compute
    capability 8.9 (H100, L40, RTX 4090 and newer have fp8), or a device where a tiny
    torch._scaled_mm with the recipe's own scale shapes fails. `run_kernel` False (the launcher's
    pre-flight, which must open no CUDA context before torchrun starts): the capability only; the
    ranks run the kernel."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        if torch.cuda.get_device_capability() < (8, 9):
            name = torch.cuda.get_device_name()
            return f"{name} (compute capability {torch.cuda.get_device_capability()}) has no fp8 matmuls; 8.9+ needed"
    if not run_kernel:
        return None
    a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = probe_scales(recipe, 16, 16, device_type)
    try:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return f"torch._scaled_mm ({recipe} scales) fails on {device_type}: {' '.join(str(e).splitlines())[:160]}"
    return None


def convertible(name: str, module: nn.Module, skip: tuple[str, ...], keep_fp32: Callable[[nn.Module], bool]) -> bool:
    return (isinstance(module, nn.Linear) and not keep_fp32(module) and not any(fnmatch.fnmatchcase(name, p) for p in skip)
            and module.in_features % _ALIGNMENT == 0 and module.out_features % _ALIGNMENT == 0)


def unmatched_patterns(model: nn.Module, skip: tuple[str, ...]) -> list[str]:
    """Skip patterns that name no Linear of `model` (a typo would silently convert the module)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [p for p in skip if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def convert(model: nn.Module, recipe: str, skip: tuple[str, ...], all_gather: bool,
            keep_fp32: Callable[[nn.Module], bool]) -> list[str]:
    """Swap the convertible Linears of `model` for torchao Float8Linear (not those `keep_fp32`
    says the plan keeps in fp32); returns their names."""
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
    would read a weight that fp8 all-gather and torchao's module swap do not keep one tensor."""
    if recipe != "none":
        unmatched = unmatched_patterns(model, skip)
        if unmatched:
            raise PrecisionError(f"'mixed_precision.fp8_skip_modules' entry {unmatched[0]!r} matches no "
                                 "nn.Linear of the model (names such as 'output', 'layers.0.*')")
        for group in tied_modules(model):
            for name, module in group:
                if convertible(name, module, skip, _keep_fp32):
                    shared = next(n for n, _ in group if n != name)
                    raise PrecisionError(f"'mixed_precision.fp8_skip_modules' must cover '{name}': its weight is "
                                         f"shared with '{shared}' (model enable_weight_tying), which fp8 cannot keep")


def is_fp8_linear(name: str, module: nn.Module, recipe: str, skip: tuple[str, ...]) -> bool:
    """Whether `module` (named `name` in the whole model) runs in fp8 under `recipe` with `skip`:
    the rule apply_fp8 converts by, also true of a Float8Linear it converted (still an nn.Linear)."""
    return recipe != "none" and convertible(name, module, skip, _keep_fp32)


def apply_fp8(model: nn.Module, recipe: str, skip: tuple[str, ...], all_gather: bool) -> list[str]:
    """Convert the model's fp8 Linears (before parallelizing; not those tagged fp32 by name or
    frozen); returns their names."""
    if recipe == "none":
        return []
    return convert(model, recipe, skip, all_gather, keep_fp32=_keep_fp32)


def after_optimizer_step(model_parts: list[nn.Module], all_gather: bool) -> None:
    """With the fp8 all-gather, the next step's weight scales (see precompute_scales)."""
    if all_gather:
        precompute_scales(model_parts)
