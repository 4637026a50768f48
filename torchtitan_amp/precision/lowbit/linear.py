"""Emulated block-scaled Linear (MXFP8, NVFP4): the three GEMMs of a Linear as the hardware does
them, with operands quantized bit-exactly (formats.py) and products summed in fp32.

    forward  y  = Q(x) Q(W)^T          x (M, K) and W (N, K) quantized along K
    dgrad    dx = Q(dy) Q(W^T)^T       dy (M, N) and W^T (K, N) along N
    wgrad    dW = Q(dy^T) Q(x^T)^T     dy^T (N, M) and x^T (K, M) along M (the tokens)

The recipe (formats.py's `BlockScaledRecipe`) says the format and, for NVFP4, NVIDIA's pre-training options:
2-D 16x16 weight scaling (W is quantized once per tile, so forward and dgrad see the same
quantized weight), a random Hadamard transform of both wgrad operands along M in blocks of 16
(R = diag(signs) H16 / 4 is orthogonal with dyadic entries, so R R^T = I exactly and
dy^T R (x^T R)^T = dy^T x: it spreads outliers before quantization and cancels in the product),
and stochastic rounding of the gradient operand of dgrad and wgrad from a seeded generator.
MXFP8 follows torchao's MXLinear: e4m3 everywhere, no RHT, no SR.

What differs from a tensor core: the emulation dequantizes each operand to fp32 (exactly: element
times block scale), multiplies with one fp32 GEMM (products exact unless they fall below fp32's
range, which needs two blocks scaled near 2^-127; K-long fp32 sums in the BLAS's order) and
applies NVFP4's two tensor scales as one fp32 multiply of the output (the GEMM's alpha, as
torch.nn.functional.scaled_mm takes them). The hardware sums each block's products internally
(in a format NVIDIA does not document), scales the partial sum by the two block scales and
accumulates in fp32 in its own order: the two agree to fp32 accumulation error (gamma_K of the
sum of |products|), not bit for bit. Hardware SR takes its random bits inside the convert
instruction; here torch.rand on a torch.Generator: the same distribution (to the resolution of
the random bits), not the same draws. Autocast is off inside the emulated GEMM. The fp32 result
is rounded once to x's dtype (bf16 under the plan, as the kernels' bf16 output is): an error
bound on the Linear's output adds that rounding (2^-8 of it in bf16) to the GEMM's.
The emulation keeps x and W in their storage dtype for backward and re-quantizes them there
(a hardware recipe saves the quantized column-wise copies): memory differs, numerics do not.
A reduction dim that is not a multiple of the block is zero-padded (zeros change no amax and no
product); the hardware kernels instead require multiples of 32 (MXFP8) / 16 (NVFP4).
Under tensor parallel (a DTensor weight) each rank runs the emulation on its local shards, with
NVFP4's tensor amaxes all-reduced over the TP group; blocks never straddle shards (checked at job
resolution), so every operand quantizes as on one device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from torchtitan_amp.precision.lowbit import formats as bs
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe

RHT_DIM = 16


# ----------------------------------------------------------------------------- RHT


def hadamard(n: int = RHT_DIM) -> torch.Tensor:
    """Sylvester Hadamard matrix / sqrt(n), fp32 (entries +-1/4 for n = 16: dyadic, exact)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / (n**0.5)


def rht_signs(seed: int, n: int = RHT_DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(torch.float32)


def rht_matrix(seed: int, n: int = RHT_DIM, device: torch.device | str | None = None) -> torch.Tensor:
    """R = diag(signs) H / sqrt(n), as torchao's get_rht_matrix builds it; R R^T = I exactly.
    fp32, built once per (seed, n, device) and cached: every rotated GEMM of a run takes the same
    tensor (do not modify it), with no CPU build and copy per GEMM.

    Args:
        seed: seeds the random signs (the recipe's seed: one sign vector per run).
        n: the transform's size, a power of two (16, NVIDIA's recipe).
        device: where the matrix lives; None means the CPU.
    """
    return _rht_matrix_on(seed, n, torch.device("cpu" if device is None else device))


@functools.lru_cache(maxsize=64)
def _rht_matrix_on(seed: int, n: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor whatever mode asks first
        return (rht_signs(seed, n).unsqueeze(1) * hadamard(n)).to(device)


rht_matrix.cache_clear = _rht_matrix_on.cache_clear  # type: ignore[attr-defined]


def apply_rht(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """t @ blockdiag(r, r, ...) along the last dim (a multiple of r's size), in fp32 (fp64 if t is)."""
    n, dtype = r.shape[0], torch.promote_types(t.dtype, torch.float32)
    blocks = t.to(dtype).contiguous().view(-1, n)  # one (numel / n, n) x (n, n) GEMM
    return (blocks @ r.to(t.device, dtype)).view(t.shape)


# ----------------------------------------------------------------------------- operands and GEMM


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[-1] % multiple
    return F.pad(t, (0, extra)) if extra else t


class OperandInfo(NamedTuple):
    """What a GEMM operand was quantized to, as the hardware would read it (for a report / audit)."""

    elements: str  # "float8_e4m3fn" | "float4_e2m1fn"
    scales: str  # "float8_e8m0fnu" | "float8_e4m3fn" (+ an fp32 tensor scale for nvfp4)
    block: tuple[int, int]  # (1, 32), (1, 16) or (16, 16)
    scale_shape: tuple[int, int]  # one scale per 1 x block along the reduction dim (rows repeat a tile's)
    rounding: str  # "rne" | "stochastic"
    rht: bool


class Operand(NamedTuple):
    values: torch.Tensor  # dequantized fp32 without the tensor scale: exact
    tensor_scale: torch.Tensor  # fp32 0-d; 1 for mxfp8
    info: OperandInfo


class GemmRecord(NamedTuple):
    what: str  # "forward" | "dgrad" | "wgrad" (or a caller's label)
    format: str
    shape: tuple[int, int, int]  # rows, cols, reduction length (padded)
    a: OperandInfo
    b: OperandInfo
    module: str = ""  # the BlockScaledLinear's `label` (its name in the model), "" for a bare call


_OBSERVERS: list[Callable[[GemmRecord], None]] = []


@contextlib.contextmanager
def observe_gemms(callback: Callable[[GemmRecord], None]) -> Iterator[None]:
    """Calls `callback` with a GemmRecord for every emulated GEMM run inside (forward and backward)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def quantize_operand(
    t: torch.Tensor,
    recipe: BlockScaledRecipe,
    *,
    generator: torch.Generator | None = None,
    block_2d: bool = False,
    rht: torch.Tensor | None = None,
    amax_group: dist.ProcessGroup | None = None,
) -> Operand:
    """A 2-D GEMM operand quantized along its last dim: zero-padded to the block (both dims with
    block_2d), rotated in blocks along that dim if asked, then quantized. The padding is kept: the
    other operand's reduction dim is padded the same way.

    Args:
        t: the 2-D operand; its last dim is the GEMM's reduction dim.
        recipe: the block-scaled recipe (format, scale rule, finiteness check).
        generator: rounds the elements stochastically; None rounds to nearest even.
        block_2d: NVFP4 scales per 16x16 tile (the recipe's 2-D weights) instead of per 1x16 block.
        rht: the random Hadamard matrix to rotate by (rht_matrix), or None for no rotation.
        amax_group: a tensor-parallel group holding shards of one logical operand: NVFP4's tensor
            scale is taken from the amax all-reduced (MAX) over it, the whole operand's, so each
            shard's blocks quantize as on one device (MXFP8 has no tensor scale); None: this
            operand's own amax.
    """
    t = _pad_last(t, recipe.block_size)
    if rht is not None:
        t = apply_rht(t, rht)
    tensor_amax = None
    if amax_group is not None and recipe.format == "nvfp4":
        tensor_amax = t.detach().abs().amax().to(torch.float32)
        dist.all_reduce(tensor_amax, op=dist.ReduceOp.MAX, group=amax_group)
    rounding = "rne" if generator is None else "stochastic"
    if recipe.format == "mxfp8":
        q = bs.quantize_mxfp8(t, scale_mode=recipe.mx_scale_mode, check_finite=recipe.check_finite)
        info = OperandInfo(
            "float8_e4m3fn",
            "float8_e8m0fnu",
            (1, bs.MX_BLOCK),
            cast("tuple[int, int]", tuple(q.scale.shape)),  # a 2-D operand's scales; torch.Size has no length type
            rounding,
            rht is not None,
        )
        return Operand(q.dequantize(), torch.ones((), device=t.device), info)
    if block_2d:
        t = _pad_last(t.t(), bs.NVFP4_BLOCK).t()
    values, s_t = bs.nvfp4_dequantized(
        t.contiguous(),
        generator=generator,
        block_2d=block_2d,
        tensor_amax=tensor_amax,
        check_finite=recipe.check_finite,
    )
    info = OperandInfo(
        "float4_e2m1fn",
        "float8_e4m3fn",
        (16, 16) if block_2d else (1, 16),
        (t.shape[0], t.shape[1] // bs.NVFP4_BLOCK),
        rounding,
        rht is not None,
    )
    return Operand(values, s_t, info)


def emulated_mm(a: Operand, b: Operand, rows: int, cols: int, what: str = "gemm", module: str = "") -> torch.Tensor:
    """A x B^T -> fp32 (rows, cols): one fp32 GEMM of the dequantized operands (autocast off: the
    emulation decides the dtypes), then alpha = s_a * s_b. Observers get a GemmRecord.

    Args:
        a: the left operand, quantized along the reduction dim (quantize_operand).
        b: the right operand, transposed, quantized along the same dim.
        rows: the product's rows before padding (the padded rows are cut off).
        cols: the product's columns before padding.
        what: the GEMM's pass for observers: "forward", "dgrad", "wgrad" (or "gemm").
        module: the name of the module the GEMM belongs to, for observers; "" when unnamed.
    """
    with torch.autocast(a.values.device.type, enabled=False):
        out = a.values @ b.values.t()
    for observe in list(_OBSERVERS):
        observe(
            GemmRecord(
                what,
                "mxfp8" if a.info.elements == "float8_e4m3fn" else "nvfp4",
                (rows, cols, a.values.shape[-1]),
                a.info,
                b.info,
                module,
            )
        )
    return (out * (a.tensor_scale * b.tensor_scale))[:rows, :cols]


def _quantized_weight(
    w: torch.Tensor, recipe: BlockScaledRecipe, along_n: bool, group: dist.ProcessGroup | None
) -> Operand:
    """W for forward (along K) or dgrad (along N); with 2-D scaling both are one tile-quantized W."""
    if recipe.weight_2d:
        op = quantize_operand(w, recipe, block_2d=True, amax_group=group)
        return op._replace(values=op.values.t()) if along_n else op
    return quantize_operand(w.t() if along_n else w, recipe, amax_group=group)


class _BlockScaledLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: BlockScaledRecipe,
        generator: torch.Generator | None,
        label: str,
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        """The forward GEMM, Q(x) Q(W)^T, plus the bias.

        Args:
            ctx: autograd's context; keeps x, weight and the other arguments for backward.
            x: the input [..., K].
            weight: the Linear's weight [N, K].
            bias: the Linear's bias [N], or None.
            recipe: the block-scaled recipe of the three GEMMs.
            generator: the stochastic-rounding generator of the gradients (None: no SR).
            label: names the GEMMs for observers.
            group: the tensor-parallel group whose all-reduced amaxes give NVFP4's tensor scales,
                or None.
        """
        x2 = x.reshape(-1, x.shape[-1])
        out = emulated_mm(
            quantize_operand(x2, recipe, amax_group=group),
            _quantized_weight(weight, recipe, False, group),
            x2.shape[0],
            weight.shape[0],
            "forward",
            label,
        )
        out = out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.generator, ctx.has_bias, ctx.label, ctx.group = (
            recipe,
            generator,
            bias is not None,
            label,
            group,
        )
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        recipe, group = ctx.recipe, ctx.group
        gen = ctx.generator if recipe.stochastic_rounding else None
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.float32)
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        m, (n, k) = g2.shape[0], weight.shape
        grad_x = emulated_mm(
            quantize_operand(g2, recipe, generator=gen, amax_group=group),
            _quantized_weight(weight, recipe, True, group),
            m,
            k,
            "dgrad",
            ctx.label,
        )
        r = rht_matrix(recipe.seed, device=g2.device) if recipe.rht else None
        grad_w = emulated_mm(
            quantize_operand(g2.t(), recipe, generator=gen, rht=r, amax_group=group),
            quantize_operand(x2.t(), recipe, rht=r, amax_group=group),
            n,
            k,
            "wgrad",
            ctx.label,
        )
        grad_b = g2.sum(0).to(grad_out.dtype) if ctx.has_bias else None
        return (grad_x.to(x.dtype).reshape(x.shape), grad_w.to(weight.dtype), grad_b, None, None, None, None)


def block_scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: BlockScaledRecipe,
    generator: torch.Generator | None = None,
    label: str = "",
    amax_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """F.linear with all three GEMMs block-scaled (emulated).

    Args:
        x: the input [..., K].
        weight: the Linear's weight [N, K].
        bias: the Linear's bias [N], or None.
        recipe: the block-scaled recipe of the three GEMMs.
        generator: feeds stochastic rounding; required when the recipe asks for it, else None.
        label: names the GEMMs' module for observers; "" when unnamed.
        amax_group: x, weight and the output gradient are shards of tensors split over that group
            (tensor parallel): NVFP4's tensor scales come from all-reduced amaxes
            (quantize_operand); None on one device.
    """
    if recipe.stochastic_rounding and generator is None:
        raise ValueError("the recipe rounds gradients stochastically: pass a seeded torch.Generator")
    return _BlockScaledLinearFn.apply(x, weight, bias, recipe, generator, label, amax_group)


class BlockScaledLinear(nn.Linear):
    """nn.Linear whose matmuls run block-scaled (emulated). Its SR generator is seeded from the
    recipe's seed and `sr_stream` (one stream per module), so a run is reproducible from the seed;
    it is made on the weight's device at the first forward (a module built on meta and materialized
    later gets it then) and made again, from the seed, if the weight moves to another device."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: BlockScaledRecipe,
        sr_stream: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.sr_stream = sr_stream
        self.generator: torch.Generator | None = None
        # Its name in the model, set by the converter: observers (the audit) attribute the GEMMs,
        # backward ones included, where no module hook runs.
        self.label = ""

    def sr_generator(self) -> torch.Generator | None:
        if not self.recipe.stochastic_rounding:
            return None
        device = self.weight.device
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(
                (self.recipe.seed * 1_000_003 + self.sr_stream) % 2**63
            )
        return self.generator

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: BlockScaledRecipe, sr_stream: int = 0) -> BlockScaledLinear:
        """A BlockScaledLinear holding `linear`'s own weight and bias Parameters (not copies).

        Args:
            linear: the Linear converted.
            recipe: the block-scaled recipe of its GEMMs.
            sr_stream: numbers the module's stochastic-rounding generator (one per module).
        """
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            recipe=recipe,
            sr_stream=sr_stream,
            device="meta",
        )
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, DTensor):
            return self._forward_tensor_parallel(x, self.weight)
        return block_scaled_linear(x, self.weight, self.bias, self.recipe, self.sr_generator(), self.label)

    def _forward_tensor_parallel(self, x: torch.Tensor | DTensor, w: DTensor) -> torch.Tensor:
        """The emulation on this rank's shards, with DTensor placements on the way out: column-wise
        (W Shard(0): x replicated, the output's columns sharded, dx a partial sum) or row-wise
        (W Shard(1): x sharded along K, the output a partial sum reduced by the style). Each
        block lies inside one shard (block_scaled.check_tensor_parallel), so the operands
        quantize as on one device; only the fp32 sums of a row-wise output and of a column-wise
        dx are split into one partial per rank, rounded to the output dtype and then added."""
        mesh = w.device_mesh
        if mesh.ndim != 1 or len(w.placements) != 1:
            raise NotImplementedError(
                f"{self.label}: block-scaled Linear on a {mesh.ndim}-D mesh {w.placements}; "
                "one tensor-parallel dim is supported"
            )
        (place,) = w.placements
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate() if place.is_shard(0) else Shard(x.dim() - 1)], run_check=False)
        out_place: Placement
        if place.is_shard(0):
            x_local = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            out_place, bias = Shard(x.dim() - 1), self.bias
        elif place.is_shard(1):
            x_local = x.redistribute(mesh, [Shard(x.dim() - 1)]).to_local()
            out_place, bias = Partial(), None
        else:
            raise NotImplementedError(f"{self.label}: block-scaled Linear with weight placement {place}")
        local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
        out = block_scaled_linear(
            x_local, w.to_local(), local_bias, self.recipe, self.sr_generator(), self.label, amax_group=mesh.get_group()
        )
        out = DTensor.from_local(out, mesh, [out_place], run_check=False)
        return out + self.bias if place.is_shard(1) and self.bias is not None else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.format}"


# Odd, with low bits set: a CPU generator seeds its Mersenne Twister from the key's low 32 bits
# only (CUDA's Philox takes all 64), so the rank must change those.
RANK_KEY = 0x1E3779B97F4A7C15


def sr_key(seed: int, stream: int, step: int, rank: int) -> int:
    """A stochastic-rounding generator's seed: (recipe seed, module stream, step) as one process
    has it, plus `rank` times an odd constant (rank 0's key is the one-process key).

    Args:
        seed: the recipe's seed.
        stream: the module's stochastic-rounding stream number.
        step: the training step.
        rank: the rank's share of the key (trainer.run.sr_rank); 0 in one process.
    """
    return ((seed * 1_000_003 + stream) * 1_000_033 + step + rank * RANK_KEY) % 2**63
