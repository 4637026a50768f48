"""LoRA / QLoRA: low-rank adapters on frozen base Linears, in the dtypes the plan decides.

`LoraLinear` is an nn.Linear (so `weight` / `bias` keep their names: base checkpoints, Hugging Face
import and export and every path that asks "is this a Linear" see the base) with two adapter
Linears beside it, `lora_A` [r, in] and `lora_B` [out, r], as PEFT names them:

    y = x @ W.T (+ b) + scaling * lora_B(lora_A(dropout(x))),   scaling = alpha / r

The base parameters are frozen and stored in `plan.lora.base_dtype` (or torchao's NF4Tensor for
QLoRA); the adapters are trained with fp32 master weights. `apply_lora` runs on the whole model
after freeze.freeze and before it is split or parallelized; `init_adapters` after the model's own
init_weights (A kaiming-uniform, as PEFT's default, B zero: the model starts as the base).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.precision.lora_plan import LoraPlan
from torchtitan_amp.precision.tags import FP32_BY_NAME, FROZEN

if TYPE_CHECKING:
    from torchtitan_amp.precision.plan import PrecisionPlan

ADAPTER_NAMES = ("lora_A", "lora_B")
__all__ = ["LoraLinear", "LoraPlan", "apply_lora", "init_adapters", "merge", "quantize_base"]


def nf4_api() -> Any:
    """torchao's NF4 module (to_nf4, NF4Tensor, linear_nf4), or a PrecisionError line saying why not."""
    for name in ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor"):
        try:
            module = __import__(name, fromlist=["to_nf4"])
        except ImportError:
            continue
        if all(hasattr(module, a) for a in ("to_nf4", "NF4Tensor", "linear_nf4")):
            return module
    raise PrecisionError(
        "'lora.quantize_base' = 'nf4' needs torchao's NF4Tensor (torchao.dtypes.nf4tensor or "
        "torchao.quantization's nf4 workflow), which this environment lacks: pip install torchao"
    )


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4Tensor, or FSDP's DTensor shard of one."""
    return type(getattr(t, "_local_tensor", t)).__name__ == "NF4Tensor"


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or an NF4Tensor dequantized by torchao (NF4Tensor.get_original_weight)."""
    return cast(Any, t).get_original_weight() if is_nf4(t) else t


E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero row keeps a finite scale


def rowwise_e4m3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [out, in] as float8_e4m3fn codes with one fp32 scale per output row, amax / 448 (torchao's
    rowwise recipe): codes = RNE(w / scale), |codes| <= 448. Deterministic: the same `w` gives the
    same bits on every rank and every run."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / E4M3_MAX
    codes = (wf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_e4m3(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rowwise_e4m3's codes back to `dtype`: codes * scale in fp32, rounded once to `dtype`.

    Args:
        codes: float8_e4m3fn [out, in].
        scale: fp32 [out, 1], one per output row.
        dtype: the compute dtype the matmul runs in.
    """
    return (codes.float() * scale).to(dtype)


class _Fp8BaseLinear(torch.autograd.Function):
    """x @ deq(W).T (+ b) for a frozen fp8 base, saving the 1-byte codes and the scales for backward
    (not the dequantized weight, which would keep a compute-dtype copy of every base alive between
    forward and backward), dequantized again there: the input's gradient g @ deq(W), as F.linear's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Any, dtype: Any) -> Any:
        """F.linear(x, dequantize_e4m3(codes, scale, dtype), bias).

        Args:
            ctx: autograd's context (keeps codes, scale and dtype for backward).
            x: the input, in the compute dtype.
            codes: the frozen float8_e4m3fn base [out, in].
            scale: its fp32 row scales [out, 1].
            bias: the frozen base bias, or None.
            dtype: the compute dtype.
        """
        ctx.save_for_backward(codes, scale)
        ctx.dtype = dtype
        return F.linear(x, dequantize_e4m3(codes, scale, dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        codes, scale = ctx.saved_tensors
        w = dequantize_e4m3(codes, scale, ctx.dtype)
        return grad.to(w.dtype) @ w, None, None, None, None


def is_fp8_base(m: nn.Module) -> bool:
    return isinstance(m, LoraLinear) and m.weight.dtype == torch.float8_e4m3fn


class LoraLinear(nn.Linear):
    """A frozen base Linear plus a trained low-rank update (module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, adapter_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=adapter_dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=adapter_dtype)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.compute_dtype = base.weight.dtype  # what an fp8 base dequantizes to

    def base_weight(self) -> torch.Tensor:
        """The base weight as the matmul takes it: an fp8 base dequantized to the compute dtype."""
        if self.weight.dtype == torch.float8_e4m3fn:
            return dequantize_e4m3(self.weight, cast(torch.Tensor, self.weight_scale), self.compute_dtype)
        return dequantized(self.weight)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_nf4(self.weight):
            out = nf4_api().linear_nf4(x, self.weight)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if self.weight.dtype == torch.float8_e4m3fn:
            return cast(
                torch.Tensor, _Fp8BaseLinear.apply(x, self.weight, self.weight_scale, self.bias, self.compute_dtype)
            )
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_forward(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def reset_adapters(self) -> None:
        """PEFT's default init: A kaiming-uniform (a = sqrt(5), nn.Linear's own), B zero."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def merged_weight(self) -> torch.Tensor:
        """W + scaling * B @ A in fp32 (the base dequantized from NF4 or fp8 first)."""
        w = self.base_weight()
        b, a = self.lora_B.weight.detach().float(), self.lora_A.weight.detach().float()
        return w.detach().float() + self.scaling * (b @ a)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def target_modules(model: nn.Module, patterns: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The Linears `patterns` name; a pattern matching nothing, or a match that is not an nn.Linear,
    is one PrecisionError line."""
    named = {n: m for n, m in model.named_modules() if n}
    matched: dict[str, nn.Linear] = {}
    for pattern in patterns:
        hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise PrecisionError(
                f"'lora.target_modules' entry {pattern!r} matches no module of the model "
                "(names such as 'layers.*.attention.wq', 'layers.*.feed_forward.w1')"
            )
        for n in hits:
            if not isinstance(named[n], nn.Linear) or isinstance(named[n], LoraLinear):
                raise PrecisionError(
                    f"'lora.target_modules' entry {pattern!r} matches '{n}', a {type(named[n]).__name__}: "
                    "LoRA adapts nn.Linear modules only"
                )
            matched[n] = named[n]
    return matched


def apply_lora(plan: PrecisionPlan, model: nn.Module) -> list[str]:
    """Freeze every parameter of the model, and replace each target Linear by a LoraLinear whose
    base is stored in the plan's base dtype (NF4 is applied later, on materialized weights:
    `quantize_base`). Returns the adapted modules' names."""
    lp = plan.lora
    if lp is None:
        return []
    targets = target_modules(model, lp.targets)
    made: dict[int, nn.Parameter] = {}  # a shared (tied) parameter stays one
    for module in model.modules():
        # What it computes in (lp.base_dtype for a lower-precision-safe target; fp32 by name: fp32).
        dtype = plan.frozen_dtype(module)
        for pname, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            module.register_parameter(pname, made[id(p)])
            setattr(module, FROZEN, True)
    for name, linear in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = LoraLinear(linear, lp.rank, lp.alpha, lp.dropout, lp.adapter_dtype)
        for tag, value in vars(linear).items():
            if tag.startswith("_torchtitan_amp"):  # the plan's marks (fp32 by name, frozen)
                setattr(wrapped, tag, value)
                if tag == FP32_BY_NAME:  # an fp32-by-name Linear's adapters compute in fp32 too
                    setattr(wrapped.lora_A, tag, value)
                    setattr(wrapped.lora_B, tag, value)
        setattr(parent, child, wrapped)
    return sorted(targets)


def lora_modules(model: nn.Module) -> list[LoraLinear]:
    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def adapter_modules(model: nn.Module) -> list[nn.Module]:
    """Every LoraLinear's lora_A and lora_B, in model order: FSDP shards them in groups of their
    own (per block) before the frozen base's groups, which would otherwise take them in."""
    return [a for m in lora_modules(model) for a in (m.lora_A, m.lora_B)]


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by name: what trains, is checkpointed and exported."""
    return {n: p for n, p in model.named_parameters() if any(f".{a}." in f".{n}" for a in ADAPTER_NAMES)}


def init_adapters(model: nn.Module) -> None:
    """A kaiming-uniform, B zero on every LoraLinear (after the model's init_weights)."""
    with torch.no_grad():
        for m in lora_modules(model):
            m.reset_adapters()


@contextlib.contextmanager
def nf4_bases_aside(model: nn.Module) -> Iterator[None]:
    """While a model initialises on its shards: every NF4 base weight replaced by a meta stand-in
    of its shape (the init's writes to it go nowhere: the load fills the NF4 base), then put back."""
    aside = {m: cast(nn.Parameter, m.weight) for m in lora_modules(model) if is_nf4(m.weight)}
    for m, w in aside.items():
        m._parameters["weight"] = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)
    try:
        yield
    finally:
        for m, w in aside.items():
            m._parameters["weight"] = w


def materialize_nf4(model: nn.Module, device: torch.device) -> None:
    """After `to_empty` of a model whose NF4 bases were quantized on meta: torchao's empty_like
    moves only the sharded inner tensors, so each base's scaler mean and NF4 code table get
    storage on `device` too (the load's copy_ fills all five)."""
    for m in lora_modules(model):
        if is_nf4(m.weight):
            local = cast(Any, getattr(m.weight, "_local_tensor", m.weight))
            for attr in ("scaler_mean", "nf4"):
                if getattr(local, attr).is_meta:
                    setattr(local, attr, torch.empty_like(getattr(local, attr), device=device))


def to_fp8(m: LoraLinear) -> None:
    """`m`'s base weight (in its compute dtype) becomes float8_e4m3fn codes plus a non-persistent
    fp32 `weight_scale` buffer [out, 1] (rowwise_e4m3); the state dict keeps the `weight` key."""
    codes, scale = rowwise_e4m3(m.weight)
    m.compute_dtype = m.weight.dtype
    m.weight = nn.Parameter(codes, requires_grad=False)
    m.register_buffer("weight_scale", scale, persistent=False)


@contextlib.contextmanager
def fp8_bases_loadable(models: list[nn.Module]) -> Iterator[None]:
    """While a checkpoint loads: each fp8 base weight replaced by its dequantized copy in the compute
    dtype (what a load copies whole weights into), then re-quantized (rowwise_e4m3, bitwise the same
    as the fresh run's); a copy the load left untouched gets its own fp8 codes back unchanged."""
    aside = {}
    for model in models:
        for m in lora_modules(model):
            if is_fp8_base(m):
                w, held = m.weight, m.base_weight()
                aside[m] = (w, held.clone())
                m.weight = nn.Parameter(held, requires_grad=False)
    try:
        yield
    finally:
        for m, (w, before) in aside.items():
            if torch.equal(m.weight, before):
                m.weight = w
            else:
                to_fp8(m)


def quantize_base(plan: PrecisionPlan, model: nn.Module) -> None:
    """QLoRA: each LoraLinear's (materialized, whole) base weight becomes a torchao NF4Tensor, in
    blocks that FSDP's plan.lora.nf4_shards ranks split evenly; an fp8 base: to_fp8."""
    if plan.lora is not None and plan.lora.fp8:
        for m in lora_modules(model):
            if is_fp8_base(m):
                continue
            if not m.weight.is_meta:
                to_fp8(m)
            else:  # the dry run: 1-byte codes and the scales, on meta
                codes = torch.empty(m.weight.shape, dtype=torch.float8_e4m3fn, device="meta")
                m.compute_dtype = m.weight.dtype
                m.weight = nn.Parameter(codes, requires_grad=False)
                m.register_buffer("weight_scale", torch.empty(m.out_features, 1, device="meta"), persistent=False)
        return
    if plan.lora is None or not plan.lora.nf4:
        return
    api = nf4_api()
    shards = plan.lora.nf4_shards
    for name, m in model.named_modules():
        if isinstance(m, LoraLinear) and not is_nf4(m.weight):
            if hasattr(m.weight, "_local_tensor"):  # a DTensor: the model was split before its init
                raise PrecisionError(
                    f"'lora.quantize_base' = 'nf4' on FSDP quantizes each base weight whole before FSDP "
                    f"splits it; '{name}.weight' was split first (a model above the full-init size "
                    "initialises on its shards): start QLoRA from a pretrained base "
                    "(checkpoint.initial_load_path), whose load quantizes each weight whole"
                )
            if m.weight.shape[0] % shards:
                raise PrecisionError(
                    f"'lora.quantize_base' = 'nf4' on FSDP {shards}: '{name}.weight' has {m.weight.shape[0]} rows, "
                    f"which {shards} ranks do not split evenly (NF4 shards whole rows); leave it out of "
                    "lora.target_modules or change data_parallel_shard_degree"
                )
            blocks, scaler_block = nf4_blocks(name, m.weight.numel(), shards)
            m.weight = nn.Parameter(api.to_nf4(m.weight.detach(), blocks, scaler_block), requires_grad=False)


def nf4_rows(whole: torch.Tensor, shard: torch.Tensor, start: int) -> torch.Tensor:
    """The rows [start, start + len(shard)) of torchao's NF4 of the `whole` weight, in `shard`'s
    blocks: what FSDP's split of the whole NF4 gives that rank (what a checkpoint load copies in).

    Args:
        whole: the whole weight, as one process holds it.
        shard: this rank's NF4 shard (its row count and block sizes).
        start: the shard's first row in the whole weight.
    """
    local = cast(Any, shard)
    whole_nf4 = nf4_api().to_nf4(whole.to(local.dtype), local.block_size, local.scaler_block_size)
    return whole_nf4.split(shard.shape[0])[start // shard.shape[0]]


def is_split_nf4(t: Any) -> bool:
    """QLoRA's NF4 base split by FSDP (a DTensor over an NF4Tensor)."""
    return isinstance(t, torch.Tensor) and is_nf4(t) and hasattr(t, "_local_tensor")


def load_nf4_whole(params: dict[str, Any], read: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Fill FSDP's NF4 shards from a checkpoint of whole weights, a block at a time: `read` fills
    each weight whole, and each rank keeps its rows of torchao's NF4 of it (nf4_rows), the split
    of one quantization as FSDP's all-gather assumes, not an NF4 of the rows alone.

    Args:
        params: the NF4 DTensor parameters by state-dict key.
        read: fills a {key: empty full tensor} dict with the checkpoint's weights (in place).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    blocks: dict[str, list[str]] = {}
    for key in params:  # one block's whole weights in memory at once, not the model's
        blocks.setdefault(".".join(key.split(".")[:2]) if key.startswith("layers.") else key, []).append(key)
    for keys in blocks.values():
        whole = {k: torch.empty(params[k].shape, dtype=params[k].dtype) for k in keys}
        read(whole)
        for k in keys:
            p = params[k]
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = p._local_tensor
            local.copy_(nf4_rows(whole[k], local, offset[0]).to(local.device))


NF4_BLOCK = 64  # QLoRA's: 64 weights share one absmax scale
NF4_SCALER_BLOCK = 256  # and 256 scales share one (double quantization)


def nf4_blocks(name: str, numel: int, shards: int = 1) -> tuple[int, int]:
    """QLoRA's block sizes for a weight of `numel` elements: 64, and 256 scales per scaler block, or
    the largest power of two below 256 that divides a small weight's scale count (torchao needs both
    to divide) into a multiple of `shards` scaler blocks (FSDP splits each of torchao's inner tensors
    over its ranks); a weight that is no whole number of 64-blocks is one PrecisionError line.

    Args:
        name: the module's name, for the message.
        numel: the weight's element count.
        shards: the ranks FSDP splits the weight over (1 on one process).
    """
    if numel % NF4_BLOCK:
        raise PrecisionError(
            f"'lora.quantize_base' = 'nf4': '{name}.weight' has {numel} elements, not a multiple of "
            f"NF4's block of {NF4_BLOCK}; leave it out of lora.target_modules or use quantize_base = 'none'"
        )
    scales = numel // NF4_BLOCK
    scaler = NF4_SCALER_BLOCK
    while scaler > 1 and (scales % scaler or (scales // scaler) % shards):
        scaler //= 2
    if (scales // scaler) % shards:
        raise PrecisionError(
            f"'lora.quantize_base' = 'nf4' on FSDP {shards}: '{name}.weight' has {scales} NF4 blocks, "
            f"which {shards} ranks do not split evenly; leave it out of lora.target_modules"
        )
    return NF4_BLOCK, scaler


def merge(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in (W + scaling * B @ A), in fp32 and
    without adapter keys: what a base checkpoint or a Hugging Face export holds."""
    merged = {m: m.merged_weight() for m in lora_modules(model)}
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if any(part in ADAPTER_NAMES for part in name.split(".")):
            continue
        for pname, p in module.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            value = merged[module] if pname == "weight" and module in merged else p.detach()
            out[key] = dequantized(value).float()
    return out


def audit(plan: PrecisionPlan, parts: list[nn.Module]) -> dict[str, list[str]]:
    """What one step left for the audit to check against the plan: the adapters' gradient dtypes
    (promised: adapter_dtype, fp32) and the base parameters holding a gradient (promised: none).
    Empty without [lora]."""
    if plan.lora is None:
        return {}
    grads, based = set(), set()
    for part in parts:
        adapters = adapter_parameters(part)
        for name, p in part.named_parameters():
            if name in adapters and p.grad is not None:
                grads.add(str(p.grad.dtype).removeprefix("torch."))
            elif name not in adapters and p.grad is not None:
                based.add(name)
    return {"adapter gradients": sorted(grads), "base parameters with a gradient": sorted(based)}


def base_dtypes(model: nn.Module) -> dict[str, str]:
    """Each frozen base parameter's storage ("nf4:<dtype>" for QLoRA's, the dtype it was quantized
    from, then ":<scaler block>" where FSDP's split chose a smaller one than one process's): a
    LoRA checkpoint records them, so that its export rebuilds the base the adapters trained against."""
    adapters = adapter_parameters(model)
    out = {}
    for name, p in model.named_parameters():
        if name not in adapters:
            if p.dtype == torch.float8_e4m3fn:  # quantized from the adapted module's compute dtype
                owner = cast(LoraLinear, model.get_submodule(name.rpartition(".")[0]))
                out[name] = "fp8:" + str(owner.compute_dtype).removeprefix("torch.")
                continue
            out[name] = ("nf4:" if is_nf4(p) else "") + str(p.dtype).removeprefix("torch.")
            scaler = getattr(getattr(p, "_local_tensor", p), "scaler_block_size", None)
            if is_nf4(p) and scaler != nf4_blocks(name, p.numel())[1]:
                out[name] += f":{scaler}"
    return out


def nf4_of(name: str, weight: torch.Tensor, stored: str) -> torch.Tensor:
    """`weight` quantized as base_dtypes recorded it.

    Args:
        name: the module's name, for messages.
        weight: the whole base weight, in the dtype it was quantized from.
        stored: base_dtypes' entry, "nf4:<dtype>" or "nf4:<dtype>:<scaler block>".
    """
    _, _, scaler = stored.removeprefix("nf4:").partition(":")
    blocks = (NF4_BLOCK, int(scaler)) if scaler else nf4_blocks(name, weight.numel())
    return nf4_api().to_nf4(weight, *blocks)
