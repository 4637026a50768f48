"""Block-scaled training (MXFP8, NVFP4) on torchao's kernels, as the precision plan decided it.

precision/plan.py asks lowbit/capability.py (can this device and torchao run the recipe's training
kernels, is there an option of our recipe torchao cannot honour); where both say no and
block_scaled_emulate is not true, precision/block_scaled.py's `apply_torchao` converts the same
Linears the emulation would (block_scaled.is_block_scaled_linear), each with `torchao_linear` here,
which maps OUR recipe to torchao's modules (torchao 0.18, torchao.prototype.moe_training):

- mxfp8 -> MXFP8Linear: all three GEMMs e4m3 in 1x32 blocks with E8M0 scales, the scale rule
  `mx_scale_mode` (ScaleCalculationMode FLOOR or RCEIL), weight gradient in MXFP8 (wgrad_with_hp
  off), KernelPreference AUTO (its Triton / CUDA casts and the CUTLASS / cuBLAS MX GEMMs).
- nvfp4 -> NVFP4Linear: torchao's one NVFP4 training recipe, Triton-only: 2-D 16x16 weight scales,
  RHT16 of the weight-gradient operands, stochastic rounding of the gradients. A recipe with
  nvfp4_weight_2d, nvfp4_rht or nvfp4_stochastic_rounding off is refused (torchao has no switch
  for them). The RHT sign vector is ours (the recipe's seed: every rank and every restart uses
  the same one, which torchao's per-module random default does not promise under FSDP) and each
  module's SR key is seeded from (recipe seed, its stream, the rank's trainer.run.sr_rank: ranks
  rounding different values draw differently); the per-step SR offsets come from the
  default CUDA generator, which training.seed seeds: a resumed run does not replay the draws the
  uninterrupted run made (the emulation does, see block_scaled.seed_step).

Parameters are kept (the module's weight and bias are the Linear's Parameters) and NVFP4Linear's
two buffers are kept out of the state dict, so names and checkpoints are those of the bf16 model.
Under FSDP torchao all-gathers the weights in the plan's param dtype and quantizes after the
gather: torchao 0.18 has no MXFP8 / NVFP4 FSDP all-gather for training (its weight wrapper's
fsdp_pre_all_gather sends param_dtype), so none is offered.

The audit cannot see inside torchao's autograd functions (the quantized operands never leave
them): `check_modules` checks that each promised module is torchao's module type with the
recipe's settings, and that a kept-out one is not.

`EMULATED_KERNELS` is the test hook: True converts with torchao's KernelPreference.EMULATED (its
own quantization in PyTorch, then a matmul of the dequantized operands in the operands' dtype),
which runs on CPU. Only MXFP8Linear has it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.linear import RANK_KEY, rht_signs
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN

# Tests set it (see the module docstring); a job never does.
EMULATED_KERNELS = False
# torchao's NVFP4 training kernel (nvfp4_mm_triton) takes only tiles of 128 in M, K and N.
NVFP4_TILE = 128


def token_tile(fmt: str) -> int:
    """What torchao's kernels need the tokens of one GEMM to be a multiple of: MXFP8's weight
    gradient quantizes along the tokens in blocks of 32 (no padding); NVFP4's kernel takes tiles of 128."""
    return bs.MX_BLOCK if fmt == "mxfp8" else NVFP4_TILE


def _mxfp8_module(linear: nn.Linear, recipe: BlockScaledRecipe) -> nn.Linear:
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    kernel = KernelPreference.EMULATED if EMULATED_KERNELS else KernelPreference.AUTO
    return MXFP8Linear(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        device="meta",
        kernel_preference=kernel,
        wgrad_with_hp=False,
        scale_calculation_mode=ScaleCalculationMode(recipe.mx_scale_mode),
    )


def sr_seed(recipe: BlockScaledRecipe, stream: int, rank: int = 0) -> int:
    """The module's SR key as an int64: the emulation's per-module seed rule, with the rank's
    share folded in as lowbit/linear.py's sr_key does, so that data-parallel ranks do not draw
    alike (rank 0 keeps the one-process key).

    Args:
        recipe: the block-scaled recipe, whose seed the key starts from.
        stream: the module's stochastic-rounding stream number.
        rank: the rank's share (trainer.run.sr_rank); 0 in one process.
    """
    s = (recipe.seed * 1_000_003 + stream + rank * RANK_KEY) % 2**64
    return s - 2**64 if s >= 2**63 else s


def _nvfp4_module(linear: nn.Linear, recipe: BlockScaledRecipe, stream: int) -> nn.Linear:
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    new = NVFP4Linear(
        linear.in_features,
        linear.out_features,
        linear.bias is not None,
        device=linear.weight.device,
        rht_sign_vector=tuple(int(v) for v in rht_signs(recipe.seed)),
    )
    new.block_scaled_recipe, new.sr_stream = recipe, stream
    # Both are derived from the recipe (fill_buffers): out of the state dict, checkpoints stay
    # those of the plain model, loadable by the emulated path and back.
    new._non_persistent_buffers_set.update({"_rht_sign_vector", "_sr_seed"})
    if linear.weight.device.type != "meta":
        fill_buffers(new)
    return new


def fill_buffers(module: nn.Module) -> None:
    """An NVFP4Linear's RHT signs and SR key from the recipe: after the model is materialized
    (to_empty leaves its buffers uninitialised, and init_weights knows nothing of them)."""
    m: Any = module  # torchao's NVFP4Linear (imported lazily), with the attributes _nvfp4_module set
    recipe = m.block_scaled_recipe
    with torch.no_grad():
        m._rht_sign_vector.copy_(rht_signs(recipe.seed).to(torch.int8))
        m._sr_seed.fill_(sr_seed(recipe, m.sr_stream, getattr(m, "sr_rank", 0)))
    m._refresh_rht_sign_vector_tuple()


def materialized(parts: list[nn.Module], rank: int = 0) -> None:
    """Call after the model parts are materialized: fills every NVFP4Linear's buffers, the SR key
    for `rank` (trainer.run.sr_rank; the trainer calls it again with this process's)."""
    for part in parts:
        for m in part.modules():
            if type(m).__name__ == "NVFP4Linear" and hasattr(m, "block_scaled_recipe"):
                m.sr_rank = rank  # type: ignore[assignment]  # a plain attribute; nn.Module's stubs type them Tensor | Module
                fill_buffers(m)


def check_shape(name: str, linear: nn.Linear, fmt: str) -> None:
    """Both dims of a converted Linear in whole tiles of torchao's kernels (they do not pad);
    raises PrecisionError naming the Linear otherwise.

    Args:
        name: the Linear's name in the model, for the error.
        linear: the Linear about to be converted.
        fmt: the block-scaled format, "mxfp8" (32-wide tiles) or "nvfp4" (128-wide).
    """
    tile = bs.MX_BLOCK if fmt == "mxfp8" else NVFP4_TILE
    if linear.in_features % tile or linear.out_features % tile:
        raise PrecisionError(
            f"'mixed_precision.block_scaled' = '{fmt}' on torchao's kernels: {name} is {linear.in_features} -> "
            f"{linear.out_features}, and the kernels take multiples of {tile}; keep it out with "
            "block_scaled_skip_modules or set block_scaled_emulate = true"
        )


def torchao_linear(linear: nn.Linear, recipe: BlockScaledRecipe, stream: int) -> nn.Linear:
    """torchao's training module for `linear` under `recipe` (its shape checked by `check_shape`),
    keeping its Parameters and its tags.

    Args:
        linear: the Linear converted.
        recipe: the block-scaled recipe; its format picks MXFP8Linear or NVFP4Linear.
        stream: numbers the module's stochastic-rounding key (NVFP4).
    """
    new = _mxfp8_module(linear, recipe) if recipe.format == "mxfp8" else _nvfp4_module(linear, recipe, stream)
    new.weight, new.bias = linear.weight, linear.bias
    for tag in (FP32_BY_NAME, FROZEN):
        if hasattr(linear, tag):
            setattr(new, tag, getattr(linear, tag))
    return new


def is_torchao_module(module: nn.Module) -> bool:
    return type(module).__name__ in ("MXFP8Linear", "NVFP4Linear")


def settings_of(module: nn.Module) -> dict[str, Any]:
    """What a converted module will run, in the recipe's words (for the report and the audit)."""
    name = type(module).__name__
    m: Any = module  # torchao's module (imported lazily): its attributes are untyped here
    if name == "MXFP8Linear":
        return {
            "module": name,
            "scale_mode": m.scale_calculation_mode.value,
            "wgrad": "hp" if m.wgrad_with_hp else "mxfp8",
            "kernels": m.kernel_preference.value,
        }
    if name == "NVFP4Linear":
        return {"module": name, "rht_signs": list(m.rht_sign_vector), "kernels": m.kernel_preference.value}
    return {"module": name}


def promised_settings(recipe: BlockScaledRecipe) -> dict[str, Any]:
    if recipe.format == "mxfp8":
        return {
            "module": "MXFP8Linear",
            "scale_mode": recipe.mx_scale_mode,
            "wgrad": "mxfp8",
            "kernels": "emulated" if EMULATED_KERNELS else "auto",
        }
    return {"module": "NVFP4Linear", "rht_signs": [int(v) for v in rht_signs(recipe.seed)], "kernels": "triton"}


def summary(recipe: BlockScaledRecipe | None, named: list[tuple[str, nn.Module]]) -> dict[str, Any] | None:
    """The report's block_scaled section on torchao's kernels (block_scaled.summary's keys)."""
    if recipe is None:
        return None
    return {
        "format": recipe.format,
        "emulated": False,
        "kernels": "torchao",
        "recipe": recipe.describe(),
        "modules": {n: settings_of(m) for n, m in named if is_torchao_module(m)},
        "kept_out": sorted(n for n, m in named if isinstance(m, nn.Linear) and not is_torchao_module(m)),
        "fsdp_all_gather": "param dtype (torchao has no MXFP8 / NVFP4 all-gather for training)",
    }


def check_modules(
    named: Mapping[str, nn.Module], promised: Iterable[str], kept_out: Iterable[str], recipe: BlockScaledRecipe
) -> list[tuple[str, list[str], list[str]]]:
    """(what, promised, seen) for each promised module that is not torchao's module with the
    recipe's settings, and each kept-out module that is one.

    Args:
        named: the model's modules by name (the whole model's).
        promised: names of the Linears the plan converts.
        kept_out: names of the Linears the plan keeps out (in its compute dtype).
        recipe: the block-scaled recipe the converted modules must run.
    """
    want = promised_settings(recipe)
    breaches = []
    for name in sorted(promised):
        got = settings_of(named[name])
        if got != want:
            breaches.append((f"{name}: torchao block-scaled module", [str(want)], [str(got)]))
    for name in sorted(kept_out):
        if is_torchao_module(named[name]):
            breaches.append(
                (
                    f"{name}: torchao block-scaled module",
                    ["none (kept out of block_scaled)"],
                    [str(settings_of(named[name]))],
                )
            )
    return breaches
