"""Emulated block-scaled grouped expert GEMMs (MXFP8, NVFP4): the routed experts' three GEMMs per
expert exactly as linear.py does them for one Linear, over the token group each expert got.

GroupedExperts (models/moe/moe.py) holds E experts as [E, K, N] weights and multiplies x [M, K],
its rows sorted by expert with counts [E], by w[e] for each expert's rows. Expert e's product is a
Linear with weight W_e = w[e]^T (N, K), so its GEMMs and their block directions are the Linear's
(the same as torchao's MXFP8 grouped GEMM, torchao/prototype/moe_training/mxfp8_grouped_mm.py):

    forward  y_e  = Q(x_e) Q(W_e)^T         x_e (M_e, K) and W_e (N, K) quantized along K
    dgrad    dx_e = Q(dy_e) Q(W_e^T)^T      dy_e (M_e, N) and W_e^T = w[e] (K, N) along N
    wgrad    dW_e = Q(dy_e^T) Q(x_e^T)^T    dy_e^T (N, M_e) and x_e^T (K, M_e) along M_e (tokens)

Token groups: wgrad's blocks run along the tokens, and a block must not mix two experts' tokens.
Each expert's group is quantized on its own and zero-padded to a whole number of blocks (what
torchao's `pad_token_groups` does before its kernels, which need 32-aligned groups): the padding
zeros change no amax and add no product, so dW_e is the Linear's on x_e alone. An expert that got
no tokens runs no GEMM (zero gradient, no rows out).

NVFP4: each operand's fp32 tensor scale is taken per expert (from that expert's rows or weight),
as the loop of per-expert Linears has it; torchao's NVFP4 grouped GEMM plumbs no tensor scale yet.
2-D weight tiles, RHT and stochastic rounding apply per expert as in linear.py; the SR
draws come from one generator per experts module, expert by expert, dgrad then wgrad.

It is a loop over experts of linear.py's own functions (quantize_operand, emulated_mm):
one host read of the counts per call (the loop path's), E small fp32 GEMMs per pass.
"""

from __future__ import annotations

from typing import Any

import torch

from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe
from torchtitan_amp.precision.lowbit.linear import (
    _quantized_weight,
    emulated_mm,
    quantize_operand,
    rht_matrix,
)


class _GroupedFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        sizes: list[int],
        recipe: BlockScaledRecipe,
        generator: torch.Generator | None,
        label: str,
    ) -> torch.Tensor:
        """The experts' forward GEMMs, x_e times W_e^T quantized, expert by expert.

        Args:
            ctx: autograd's context; keeps x, w and the other arguments for backward.
            x: the tokens [M, K], rows sorted by expert.
            w: the experts' weights [E, K, N].
            sizes: rows of x per expert (E counts summing to M).
            recipe: the block-scaled recipe of the three GEMMs.
            generator: the stochastic-rounding generator of the gradients (None: no SR).
            label: names the GEMMs for observers.
        """
        n = w.shape[-1]
        outs = []
        for e, part in enumerate(x.split(sizes)):
            if part.shape[0]:
                outs.append(
                    emulated_mm(
                        quantize_operand(part, recipe),
                        _quantized_weight(w[e].t(), recipe, False, None),
                        part.shape[0],
                        n,
                        "forward",
                        label,
                    ).to(x.dtype)
                )
            else:
                outs.append(x.new_zeros(0, n))
        ctx.save_for_backward(x, w)
        ctx.sizes, ctx.recipe, ctx.generator, ctx.label = sizes, recipe, generator, label
        return torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        recipe, label = ctx.recipe, ctx.label
        gen = ctx.generator if recipe.stochastic_rounding else None
        r = rht_matrix(recipe.seed, device=grad_out.device) if recipe.rht else None
        k, n = w.shape[1], w.shape[2]
        grad_x, grad_w = [], torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for e, (g, xe) in enumerate(zip(grad_out.float().split(ctx.sizes), x.float().split(ctx.sizes))):
            m = g.shape[0]
            if not m:
                grad_x.append(grad_out.new_zeros(0, k, dtype=x.dtype))
                continue
            we = w[e].t()  # W_e (N, K), the Linear's weight
            grad_x.append(
                emulated_mm(
                    quantize_operand(g, recipe, generator=gen),
                    _quantized_weight(we, recipe, True, None),
                    m,
                    k,
                    "dgrad",
                    label,
                ).to(x.dtype)
            )
            dw = emulated_mm(
                quantize_operand(g.t(), recipe, generator=gen, rht=r),
                quantize_operand(xe.t(), recipe, rht=r),
                n,
                k,
                "wgrad",
                label,
            )
            # Through w's dtype as the Linear's gradient is, then into the [E, K, N] layout.
            grad_w[e] = dw.to(w.dtype).t()
        return torch.cat(grad_x), grad_w.to(w.dtype), None, None, None, None


def block_scaled_grouped_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    sizes: list[int],
    recipe: BlockScaledRecipe,
    generator: torch.Generator | None = None,
    label: str = "",
) -> torch.Tensor:
    """x [M, K] times w [E, K, N] per expert -> [M, N] in x's dtype, all three GEMMs block-scaled
    (emulated) per expert.

    Args:
        x: the tokens [M, K], rows sorted by expert.
        w: the experts' weights [E, K, N].
        sizes: rows of x per expert: `sizes[e]` rows for expert e, E counts summing to M.
        recipe: the block-scaled recipe of the three GEMMs.
        generator: feeds stochastic rounding; required when the recipe asks for it, else None.
        label: names the GEMMs for observers (the audit); "" for none.
    """
    if recipe.stochastic_rounding and generator is None:
        raise ValueError("the recipe rounds gradients stochastically: pass a seeded torch.Generator")
    if len(sizes) != w.shape[0] or sum(sizes) != x.shape[0]:
        raise ValueError(f"token groups {sizes} do not fit x {tuple(x.shape)} and {w.shape[0]} experts")
    return _GroupedFn.apply(x, w, list(sizes), recipe, generator, label)


class BlockScaledExperts:
    """What a GroupedExperts module runs its three weights' GEMMs with when the plan puts the
    experts in a block-scaled format (block_scaled.apply_block_scaled sets it as the
    module's `block_scaled_mm`). Not a module: parameters, names and checkpoints are unchanged.
    The SR generator is seeded as a BlockScaledLinear's, from the recipe's seed and `sr_stream`."""

    def __init__(self, recipe: BlockScaledRecipe, label: str, sr_stream: int) -> None:
        self.recipe, self.label, self.sr_stream = recipe, label, sr_stream
        self.generator: torch.Generator | None = None

    def sr_generator(self, device: torch.device) -> torch.Generator | None:
        if not self.recipe.stochastic_rounding:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(
                (self.recipe.seed * 1_000_003 + self.sr_stream) % 2**63
            )
        return self.generator

    def __call__(self, x: torch.Tensor, w: torch.Tensor, sizes: list[int], weight_name: str) -> torch.Tensor:
        return block_scaled_grouped_mm(
            x, w, sizes, self.recipe, self.sr_generator(w.device), f"{self.label}.{weight_name}"
        )
