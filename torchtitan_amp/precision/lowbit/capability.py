"""What this machine's torchao and device can run of the low-bit formats: the probes the precision
plan asks before it decides (precision/plan.py refuses, in one line, what they say cannot run).

fp8 (lowbit/float8.py converts): `fp8_torchao_missing` (is torchao installed, with every API the
conversion calls), `fp8_matmul_unsupported` (can the device multiply in fp8 with the recipe's scale
shapes). torchao is imported here only when fp8 is asked for.

Block-scaled MXFP8 / NVFP4 on torchao's kernels (lowbit/torchao_kernels.py maps the recipe to
torchao's modules): `block_scaled_torchao_missing`, `block_scaled_kernels_missing` (compute
capability, the import, then one tiny forward + backward on the device) and
`block_scaled_recipe_refused` (a setting of our recipe, or a GEMM shape of the job, torchao's
kernels cannot honour). `EMULATION_COST` is what the plan says the bit-exact emulation costs.

The functions take the plan's values (recipe names, formats, device type), not the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
from typing import Any

import torch
from torch import nn

from torchtitan_amp.precision.lowbit import torchao_kernels
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe

# ----------------------------------------------------------------------------- fp8

# The version lowbit/float8.py was tested with. What it uses of torchao.float8 (module swap through
# convert_to_float8_training, the "tensorwise" and "rowwise" recipes, the FSDP fp8 all-gather with
# its scale precompute) is checked by name rather than by an upper version bound: torchtitan dropped
# tensorwise and the fp8 all-gather in 2026-04 and torchao is moving fp8 training to weight-wrapper
# tensors, but no torchao release is known to lack them yet, and a bound would refuse one that has.
TESTED_TORCHAO = "0.18.0"
INSTALL = "pip install 'torchao>=0.18' (the project's [fp8] extra)"
_RECIPES = ("tensorwise", "rowwise")


def _quiet_import(module: str) -> Any:
    # torchao's import logs a WARNING per optional CUDA kernel library it cannot load (fp4,
    # CUTLASS): noise on any machine without them, and not about the format asked for.
    quiet = logging.getLogger("torchao")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return __import__(module, fromlist=["_"])
    finally:
        quiet.setLevel(level)


def fp8_torchao_missing(recipe: str | None = None, all_gather: bool | None = None) -> str | None:
    """Why torchao cannot run `recipe` (with the FSDP fp8 all-gather if `all_gather`), or None.
    Left as None, each asks for everything lowbit/float8.py can use."""
    try:
        float8 = _quiet_import("torchao.float8")
    except ImportError as e:
        return f"fp8 training needs torchao ({e}); {INSTALL}"
    lacking = _lacking(float8, _RECIPES if recipe is None else (recipe,), all_gather is not False)
    if lacking is not None:
        return (
            f"fp8 training needs {lacking}, which torchao {_version()} lacks; "
            f"pip install 'torchao=={TESTED_TORCHAO}' (the version tested)"
        )
    return None


def _lacking(float8: object, recipes: tuple[str, ...], all_gather: bool) -> str | None:
    """The first of the torchao.float8 APIs lowbit/float8.py calls that `float8` lacks, or None."""
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
    and per column of the right one ([1, n]) (rowwise); all ones.

    Args:
        recipe: the float8 recipe, "tensorwise" or "rowwise" (any name starting "rowwise" takes
            row / column scales).
        m: rows of the left operand (the product's rows).
        n: columns of the right operand (the product's columns).
        device: where the scales are made.
    """
    if recipe.startswith("rowwise"):
        return torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
    return torch.ones((), device=device), torch.ones((), device=device)


@functools.cache
def fp8_matmul_unsupported(device_type: str, recipe: str = "tensorwise", run_kernel: bool = True) -> str | None:
    """Why `device_type` cannot run `recipe`'s float8 matmuls, or None: a GPU below compute
    capability 8.9 (H100, L40, RTX 4090 and newer have fp8), or a device where a tiny
    torch._scaled_mm with the recipe's own scale shapes fails.

    Args:
        device_type: the torch device type the job trains on ("cuda", "cpu", ...).
        recipe: the float8 recipe whose scale shapes the probe uses, "tensorwise" or "rowwise".
        run_kernel: False in the launcher's pre-flight, which must open no CUDA context before
            torchrun starts: the capability only is checked; the ranks run the kernel.
    """
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


# ----------------------------------------------------------------------------- block-scaled

# torchao's MX / NVFP4 training GEMMs run on the tensor cores of compute capability 10.0 (B200,
# GB200) and up; Hopper (H100, H200) has fp8 but no block-scaled MMA.
KERNEL_CAPABILITY = (10, 0)
# What the emulation costs against a bf16 F.linear, forward + backward (benchmarks/blockscaled_speed.py
# on the 2-core CPU of docs/performance.md): said in the start-up line and the refusal.
EMULATION_COST = "about 4-7x slower than bf16 on a 2-core AVX512 CPU"
# What each format converts to, for the decision line.
TORCHAO_MODULES = {"mxfp8": "torchao MXFP8Linear", "nvfp4": "torchao NVFP4Linear: 2-D weights, RHT, SR"}
_NEEDED = {
    "mxfp8": ("torchao.prototype.moe_training.mxfp8_linear", "MXFP8Linear"),
    "nvfp4": ("torchao.prototype.moe_training.nvfp4_training.nvfp4_training", "NVFP4Linear"),
}


def block_scaled_torchao_missing(fmt: str) -> str | None:
    """Why torchao cannot convert to `fmt`'s training module, or None."""
    module, name = _NEEDED[fmt]
    try:
        found = _quiet_import(module)
    except ImportError as e:
        return f"torchao's {module} cannot be imported ({e})"
    if not hasattr(found, name):
        return f"{module} lacks {name} (torchao 0.18 has it)"
    return None


@functools.cache
def block_scaled_kernels_missing(fmt: str, device_type: str, run_kernel: bool = True) -> str | None:
    """Why `device_type` cannot run `fmt`'s block-scaled training kernels through torchao, or None.
    Past the capability and the import, one tiny forward + backward on the device (torchao only
    warns when its MXFP8 CUDA extension did not load; the step is what fails).

    Args:
        fmt: the block-scaled format, "mxfp8" or "nvfp4".
        device_type: the torch device type the job trains on; only "cuda" has the kernels.
        run_kernel: False in the launcher's pre-flight (no CUDA context before torchrun starts):
            no step is run; the ranks run it.
    """
    if device_type != "cuda":
        return f"{device_type} has no MX / NVFP4 tensor cores"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    cap, need = torch.cuda.get_device_capability(), KERNEL_CAPABILITY
    if cap < need:
        return (
            f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}) has no block-scaled "
            f"tensor cores; {need[0]}.{need[1]}+ (Blackwell) needed"
        )
    missing = block_scaled_torchao_missing(fmt)
    if missing is not None or not run_kernel:
        return missing
    try:
        tiny_step(fmt, device_type)
    except Exception as e:
        return f"torchao's {fmt} training step fails here ({type(e).__name__}: {' '.join(str(e).splitlines())[:200]})"
    return None


def tiny_step(fmt: str, device: str) -> None:
    """One forward + backward of a 128 x 128 bf16 Linear on 128 tokens through torchao's `fmt`
    training module (128: NVFP4's tile; MXFP8 needs multiples of 32)."""
    recipe = BlockScaledRecipe("mxfp8") if fmt == "mxfp8" else BlockScaledRecipe.nvfp4_full()
    linear = nn.Linear(128, 128, bias=False).to(device, torch.bfloat16)
    module = torchao_kernels.torchao_linear(linear, recipe, 0)
    x = torch.randn(128, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    module(x).float().square().sum().backward()


def block_scaled_recipe_refused(
    recipe: BlockScaledRecipe, tensor_parallel: int, gemm_rows: list[tuple[int, str, bool]]
) -> str | None:
    """The first setting of `recipe` (or the job) torchao's kernels cannot honour, as 'field: why';
    None when they honour them all.

    Args:
        recipe: the block-scaled recipe the plan chose.
        tensor_parallel: the job's tensor-parallel degree (1: none); the kernel path takes only 1.
        gemm_rows: one (tokens, the config fields that set them, whether the backward runs it
            too) for each kind of GEMM the job runs; the tokens must fill the kernels' tiles.
    """
    if tensor_parallel > 1:
        return (
            "parallelism.tensor_parallel_degree > 1: the torchao kernel path is not wired for tensor "
            "parallel here (the emulation is)"
        )
    if recipe.format == "nvfp4":
        for field, on in (
            ("nvfp4_weight_2d", recipe.weight_2d),
            ("nvfp4_rht", recipe.rht),
            ("nvfp4_stochastic_rounding", recipe.stochastic_rounding),
        ):
            if not on:
                return (
                    f"mixed_precision.{field} = false: torchao's NVFP4 training kernels always use 2-D "
                    "weight scales, RHT and stochastic rounding"
                )
    tile = torchao_kernels.token_tile(recipe.format)
    for tokens, fields, backward in gemm_rows:
        # MXFP8 quantizes along the tokens only for the weight gradient; NVFP4 tiles them always.
        if (backward or recipe.format == "nvfp4") and tokens % tile:
            return (
                f"{fields} gives {tokens} tokens a GEMM, and torchao's {recipe.format} kernels take multiples of {tile}"
            )
    return None
