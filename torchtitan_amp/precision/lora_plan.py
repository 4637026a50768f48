"""What the precision plan decides for [lora]: the adapters' shape, the frozen base's storage (the
Linears' compute dtype, or NF4 for QLoRA), fp32 adapters, and the layouts LoRA runs on. plan.py
asks `decide`; lora.py applies the result."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan_amp.config import JobConfig
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.distributed.parallel_dims import ParallelDims


@dataclass(frozen=True)
class LoraPlan:
    """What the plan decided for [lora]: the adapters' shape and every part's dtypes."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    base_dtype: torch.dtype  # the frozen base weights' storage (what NF4 dequantizes to, for QLoRA)
    nf4: bool  # QLoRA: the target Linears' base weights are torchao NF4Tensors
    adapter_dtype: torch.dtype  # the adapters' master weights, gradients and optimizer state
    compute_dtype: torch.dtype  # what the base and adapter matmuls run in
    nf4_shards: int = 1  # QLoRA on FSDP: the ranks each NF4 base is split over (lora.nf4_blocks)
    fp8: bool = False  # the target Linears' base weights are float8_e4m3fn with fp32 row scales

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parts(self) -> dict[str, dict[str, str | None]]:
        """Storage / compute / gradient dtype of each part, for the precision report."""
        compute, adapter = dtype_name(self.compute_dtype), dtype_name(self.adapter_dtype)
        base: dict[str, str | None] = {
            "storage_dtype": "nf4" if self.nf4 else "float8_e4m3fn" if self.fp8 else dtype_name(self.base_dtype),
            "compute_dtype": compute,
            "grad_dtype": None,  # frozen: no gradient
        }
        if self.fp8:
            base["scale_dtype"] = "float32"  # one per output row: amax / 448
        return {
            "base": base,
            "adapters": {"storage_dtype": adapter, "compute_dtype": compute, "grad_dtype": adapter},
        }


def decide(config: JobConfig, dims: ParallelDims, compute: torch.dtype) -> LoraPlan | None:
    """[lora] resolved: None when off; what cannot run is one PrecisionError line.

    Args:
        config: the job config ([lora], training.dtype, mixed_precision's fp8 / block_scaled).
        dims: the parallel layout (EP is refused; QLoRA on TP too).
        compute: what the plan's Linears compute in (param_dtype off the full path, else storage).
    """
    lo = config.lora
    if not lo.enable:
        return None
    if config.training.dtype != "float32":
        raise PrecisionError(
            f"'lora.enable' trains fp32 master adapters; 'training.dtype' = '{config.training.dtype}' stores "
            "every parameter in it: keep training.dtype = 'float32' (the base is frozen in the compute dtype)"
        )
    mp = config.mixed_precision
    if mp.fp8 != "none" or mp.block_scaled != "none":
        raise PrecisionError(
            "'lora.enable' with mixed_precision.fp8 / block_scaled: the converted Linears are not LoRA's "
            "target Linears; train the adapters in bf16 or fp32"
        )
    if dims.ep_enabled:
        raise PrecisionError(
            "'lora.enable' runs on data-parallel layouts (FSDP, DDP, HSDP), tensor, context and pipeline "
            "parallel: expert parallel's experts are grouped weights, not nn.Linear modules LoRA can adapt"
        )
    c = config.checkpoint
    if c.last_save_model_only or c.last_save_hf:
        raise PrecisionError(
            "'lora.enable' with checkpoint.last_save_model_only / last_save_hf: a LoRA checkpoint holds the "
            "adapters; merge and export them with torchtitan_amp.checkpoint.lora_export (export_merged_hf, export_peft)"
        )
    if lo.quantize_base == "nf4" and dims.tp_enabled:
        raise PrecisionError(
            "'lora.quantize_base' = 'nf4' (QLoRA) runs on one process, FSDP, HSDP, DDP, context and pipeline "
            "parallel: tensor parallel's split of the base weight is not carried for torchao's NF4Tensor here; "
            "use 'none' (a bf16 base) under tensor parallel"
        )
    if lo.quantize_base == "fp8" and (dims.tp_enabled or dims.fsdp_enabled):
        raise PrecisionError(
            "'lora.quantize_base' = 'fp8' runs on one process, DDP and pipeline parallel: its float8_e4m3fn "
            "base is quantized after the base is loaded, by replacing each base weight, which the split "
            "parameters of FSDP (context parallel included) and tensor parallel do not allow; use 'nf4' or 'none' there"
        )
    return LoraPlan(
        rank=lo.rank,
        alpha=lo.alpha,
        dropout=lo.dropout,
        targets=tuple(lo.target_modules),
        base_dtype=compute,
        nf4=lo.quantize_base == "nf4",
        adapter_dtype=torch.float32,
        compute_dtype=compute,
        nf4_shards=dims.fsdp_shard if lo.quantize_base == "nf4" else 1,
        fp8=lo.quantize_base == "fp8",
    )
