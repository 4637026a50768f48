"""The GPU check `block_scaled_kernels`: torchao's block-scaled training modules
(precision/lowbit/torchao_kernels.py) against the emulation (precision/lowbit/linear.py)."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
import torch
from torch import nn

from torchtitan_amp.precision import block_scaled
from torchtitan_amp.precision.lowbit import capability, torchao_kernels
from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe

pytestmark = pytest.mark.gpu


def _bf16_bound(ours: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ours - theirs| for two bf16 results of a @ b^T on exactly-representable dequantized
    operands: each side's fp32 sum is within gamma_K sum|a b| of the exact one (s: both), then
    rounded to bf16 (relative 2^-8 each): s (1 + 2^-8) + 2^-7 |ours| (1 + 2^-7)."""
    k = a.shape[-1]
    s = 2 * (k * 2.0**-24 / (1 - k * 2.0**-24)) * (a.float().abs() @ b.float().abs().T)
    return s * (1 + 2.0**-8) + 2.0**-7 * (1 + 2.0**-7) * ours.float().abs()


Results = list[torch.Tensor]


def _block_scaled_pair(
    recipe: BlockScaledRecipe, device: str, n: int
) -> tuple[Results, Results, tuple[torch.Tensor, ...]]:
    """(ours, torchao's) forward output, input and weight gradients of one n x n bf16 Linear on n
    tokens, and the operands (x, the output gradient g, W)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(n, n, bias=False)).to(device, torch.bfloat16) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    block_scaled.apply_block_scaled(models[0], recipe, (), 0)
    block_scaled.apply_torchao(models[1], recipe, (), 0)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    g = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    results = []
    for m in models:
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.backward(g)
        results.append([y.detach(), xx.grad, m[0].weight.grad])
    return results[0], results[1], (x, g, models[0][0].weight.detach())


def block_scaled_kernels(device: str, out: dict[str, Any]) -> bool:
    """torchao's block-scaled training modules (precision/lowbit/torchao_kernels.py) against the
    emulation, one 256 x 256 bf16 Linear: mxfp8's three GEMMs within `_bf16_bound` (same
    quantization, exact products; only the fp32 order and the bf16 rounding differ), nvfp4's
    forward too (its gradients round stochastically: their distance is recorded). Where the
    device has no MX tensor cores (below compute capability 10.0) the mxfp8 comparison runs
    torchao's emulated kernel instead and nvfp4 (Triton kernels only) is skipped; it says which.
    `_bf16_bound` assumes fp32 summation: cuBLAS's reduced-precision bf16 reduction (allowed by
    torch's default) is turned off for the check and restored after."""
    why = capability.block_scaled_kernels_missing("mxfp8", device)
    out["kernels"] = "torchao" if why is None else f"torchao's emulated kernel ({why})"
    previous, torchao_kernels.EMULATED_KERNELS = torchao_kernels.EMULATED_KERNELS, why is not None
    matmul = torch.backends.cuda.matmul
    reduced, matmul.allow_bf16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction, False
    try:
        ok = True
        for mode in ("floor", "rceil"):
            ours, theirs, (x, g, w) = _block_scaled_pair(BlockScaledRecipe("mxfp8", mx_scale_mode=mode), device, 256)

            def q(t: torch.Tensor, mode: str = mode) -> torch.Tensor:
                return bs.quantize_mxfp8(t.float().contiguous(), scale_mode=mode).dequantize()

            operands = ((q(x), q(w)), (q(g), q(w.T)), (q(g.T), q(x.T)))
            worst = {}
            for what, o, t, (p, r) in zip(("forward", "dgrad", "wgrad"), ours, theirs, operands):
                over = ((o.float() - t.float()).abs() - _bf16_bound(o, p, r)).max().item()
                worst[what] = over
                ok = ok and over <= 0
            out[f"mxfp8_{mode}_excess_over_bound"] = worst  # <= 0: within the bound
        if capability.block_scaled_kernels_missing("nvfp4", device) is None:
            ours, theirs, _ = _block_scaled_pair(BlockScaledRecipe.nvfp4_full(), device, 256)
            rel = [((o.float() - t.float()).norm() / o.float().norm()).item() for o, t in zip(ours, theirs)]
            out["nvfp4_relative_distance"] = dict(zip(("forward", "dgrad", "wgrad"), rel))
            ok = ok and rel[0] <= 2.0**-7 and all(map(math.isfinite, rel))
        else:
            out["nvfp4"] = "skipped: torchao's NVFP4 training kernels need compute capability 10.0 and Triton"
        return ok
    finally:
        torchao_kernels.EMULATED_KERNELS = previous
        matmul.allow_bf16_reduced_precision_reduction = reduced


def test_block_scaled_kernels(a: argparse.Namespace, out: dict[str, Any]) -> None:
    assert block_scaled_kernels(a.device, out), out
