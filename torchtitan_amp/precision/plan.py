"""The precision plan: the only place where precision is decided.

`PrecisionPlan.from_config` turns the job config and the parallel layout into one of three paths:

- "fsdp":     data-parallel sharding is on; FSDP2 `MixedPrecisionPolicy` per module group does the
              casting, fp32 master params, fp32 policy for modules outside the safe list.
- "autocast": no sharding (single process, DDP/replicate, TP, PP); a forward-only `torch.autocast`
              around forward + loss, a separate backward context without autocast, and a gradient
              comm hook sending safe modules' gradients in `reduce_dtype` when DDP is on.
- "full":     one dtype everywhere (fp32, or pure bf16 when `training.dtype = "bfloat16"`).

Everything else (parallelize, trainer, checkpoint) asks the plan and never re-decides. This module
decides and answers, and imports none of the modules next to it that apply the decision (see the
package's docstring): each of them takes the plan, and callers call them with it. Of the low-bit
formats (precision/lowbit/) it imports the probes (lowbit/capability.py: is torchao installed, can
this device multiply in fp8, does it have block-scaled kernels), the block-scaled recipe and the
emulated Linear's class (what its matmuls compute in). What the report says of the plan is
report.py's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from torchtitan_amp.config import JobConfig
from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.matmul_speed import LOWP_ENV, LowPrecisionSpeed, low_precision_speed
from torchtitan_amp.core.rules import DTYPES, dtype_name, short_name
from torchtitan_amp.distributed.context_parallel import ContextParallel
from torchtitan_amp.distributed.parallel_dims import ParallelDims
from torchtitan_amp.models import get_family
from torchtitan_amp.models.attention import decide_backend
from torchtitan_amp.precision.lora_plan import LoraPlan
from torchtitan_amp.precision.lora_plan import decide as decide_lora
from torchtitan_amp.precision.lowbit import capability
from torchtitan_amp.precision.lowbit.formats import BlockScaledRecipe, recipe_of
from torchtitan_amp.precision.lowbit.linear import BlockScaledLinear
from torchtitan_amp.precision.tags import FP32_BY_NAME

if TYPE_CHECKING:
    import torch.distributed as dist

Path_ = Literal["fsdp", "autocast", "full"]
CommHook = Literal["bf16_compress", "fp16_compress", "none"]
ScalerName = Literal["none", "GradScaler", "ShardedGradScaler"]
_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def resolve_module_classes(names: list[str]) -> tuple[type[nn.Module], ...]:
    """Import each fully qualified class name; any failure is a config error naming it."""
    classes = []
    for name in names:
        module_name, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name) if module_name else None
        except (ImportError, AttributeError):
            cls = None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise PrecisionError(
                f"'mixed_precision.lower_precision_safe_modules' entry '{name}' is not an importable "
                f"nn.Module class (use a fully qualified name such as 'torch.nn.Linear')"
            )
        classes.append(cls)
    return tuple(classes)


def _check_device_support(device_type: str, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        return
    if not torch.amp.is_autocast_available(device_type):
        raise PrecisionError(f"mixed precision is not available on device type '{device_type}'")
    # Emulated bf16 (pre-Ampere GPUs) is allowed here; native or not is matmul_speed's question.
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=True):
        raise PrecisionError(
            "'mixed_precision.param_dtype' = 'bfloat16' but this GPU has no bf16 support; "
            "use 'float16' (with loss scaling) or set mixed_precision.enabled = false"
        )
    if device_type == "cuda" and dtype == torch.float16 and torch.cuda.get_device_capability() < (5, 3):
        raise PrecisionError("'mixed_precision.param_dtype' = 'float16' needs a GPU with compute capability >= 5.3")


def _check_settings(config: JobConfig, storage: torch.dtype, asked: bool) -> None:
    """Settings no machine can honour. Checked whatever "auto" then decides on this machine, so
    that a config is refused (or accepted) the same way everywhere."""
    mp = config.mixed_precision
    if storage != torch.float32 and mp.enabled is not False and _DTYPES[mp.param_dtype] != storage:
        raise PrecisionError(
            f"'training.dtype' = '{config.training.dtype}' (pure low-precision training) conflicts "
            f"with 'mixed_precision.param_dtype' = '{mp.param_dtype}'; set mixed_precision.enabled "
            f"= false, or drop training.dtype to train in mixed precision"
        )
    if storage != torch.float32 and mp.enabled is not False:
        # Pure low precision has no fp32 master copy to reduce or compute in: these would be ignored
        # (with enabled = false the user has switched the whole section off, these included).
        for key, value in (("reduce_dtype", mp.reduce_dtype), ("lower_precision_safe_modules", None)):
            if f"mixed_precision.{key}" in config.explicit and (value is None or _DTYPES[value] != storage):
                raise PrecisionError(
                    f"'mixed_precision.{key}' has no effect with 'training.dtype' = '{config.training.dtype}': "
                    f"every parameter, gradient and reduction is {config.training.dtype}; drop it, or keep "
                    f"fp32 master weights (training.dtype = 'float32') and train in mixed precision"
                )
    if not asked:
        return
    for key in ("reduce_dtype", "cp_reduce_dtype"):
        if mp.param_dtype == "bfloat16" and getattr(mp, key) == "float16":
            raise PrecisionError(
                f"'mixed_precision.{key}' = 'float16' with param_dtype = 'bfloat16' can overflow "
                f"(bf16-range gradients exceed fp16's 65504); use {key} 'bfloat16' or 'float32'"
            )
    resolve_module_classes(mp.lower_precision_safe_modules)


def _setting_name(config: JobConfig) -> str:
    """mixed_precision.enabled as the user left it, for the report and the start-up line."""
    mp = config.mixed_precision
    if mp.enabled is not True and mp.enabled is not False:
        # Naming the dtype is asking for it: "auto" only decides for users who did not.
        if "mixed_precision.param_dtype" in config.explicit:
            return f"auto, param_dtype = {mp.param_dtype} set"
        return "auto"
    return "true" if mp.enabled else "false"


def _emulated_warning(speed: LowPrecisionSpeed, config: JobConfig) -> str:
    pure = config.training.dtype != "float32"
    avoid = "--training.dtype float32" if pure else '--no-mixed_precision.enabled (or mixed_precision.enabled = "auto")'
    return (
        f"{speed.describe()}; training in {dtype_name(speed.dtype)} as configured anyway. "
        f"{avoid} trains in fp32 instead"
    )


def _decision_line(
    setting: str, path: Path_, param: torch.dtype, storage: torch.dtype, speed: LowPrecisionSpeed | None
) -> str:
    """What the job trains in and why, in one line."""
    if path == "full":
        what = "fp32" if storage == torch.float32 else f"pure {short_name(storage)}"
    else:
        what = f"{short_name(param)} mixed precision ({path} path)"
    why = f": {speed.describe()}" if speed is not None else ""
    return f"mixed_precision.enabled = {setting} -> {what}{why}"


def _check_fp8(
    config: JobConfig, dims: ParallelDims, path: Path_, device_type: str, *, on_hardware: bool, run_kernels: bool = True
) -> None:
    """What fp8 cannot do here, refused in one line (never a silent bf16/fp32 fallback).
    `on_hardware` False (a dry run): the device and torchao are not this machine's to check."""
    mp = config.mixed_precision
    if mp.fp8_all_gather and (mp.fp8 != "tensorwise" or path != "fsdp"):
        raise PrecisionError(
            f"'mixed_precision.fp8_all_gather' needs fp8 = 'tensorwise' on the FSDP path (data-parallel "
            f"sharding with mixed precision); this job has fp8 = '{mp.fp8}' on the {path} path"
        )
    if mp.fp8_all_gather and device_type != "cuda":
        # A dry run checks its target (dry_run.device), a real run its own device.
        raise PrecisionError(
            f"'mixed_precision.fp8_all_gather' needs CUDA/nccl: gloo ({device_type}) cannot "
            "all-gather float8 tensors" + ("" if on_hardware else " (dry_run.device = 'cuda' sizes it)")
        )
    if not on_hardware:
        return
    why = capability.fp8_torchao_missing(mp.fp8, mp.fp8_all_gather) or capability.fp8_matmul_unsupported(
        device_type, mp.fp8, run_kernels
    )
    if why is not None:
        raise PrecisionError(f"'mixed_precision.fp8' = '{mp.fp8}': {why}")


def _block_scaled(
    config: JobConfig, dims: ParallelDims, device_type: str, *, on_hardware: bool, run_kernels: bool = True
) -> tuple[BlockScaledRecipe | None, bool, str]:
    """The block-scaled recipe (None: off), whether it is emulated, and the decision line's words.
    `emulate = true` runs the bit-exact emulation anywhere; otherwise torchao's kernels where the
    device and torchao have them and torchao can honour the recipe, else refused in one line:
    never a silent bf16 fallback, never a silently different recipe."""
    mp = config.mixed_precision
    recipe = recipe_of(
        mp.block_scaled,
        mp.mxfp8_scale_mode,
        mp.nvfp4_weight_2d,
        mp.nvfp4_rht,
        mp.nvfp4_stochastic_rounding,
        config.training.seed,
    )
    if recipe is None:
        return None, False, ""
    where = f"'mixed_precision.block_scaled' = '{mp.block_scaled}'"
    if mp.block_scaled_emulate is True:
        return (
            recipe,
            True,
            (
                f"; nn.Linear in {recipe.format}, emulated (bit-exact quantization, fp32 GEMMs: "
                f"{capability.EMULATION_COST})"
            ),
        )
    fix = f"set mixed_precision.block_scaled_emulate = true to emulate ({capability.EMULATION_COST})"
    # A dry run sizes its target: neither this machine's device nor its torchao is asked.
    why = capability.block_scaled_kernels_missing(recipe.format, device_type, run_kernels) if on_hardware else None
    if why is not None:
        raise PrecisionError(f"{where} needs block-scaled tensor cores: {why}; {fix}")
    refused = capability.block_scaled_recipe_refused(recipe, dims.tp, _gemm_rows(config, dims))
    if refused is None and mp.block_scaled_experts:
        refused = (
            "mixed_precision.block_scaled_experts = true: the grouped experts' GEMMs are emulated only "
            "(torchao's grouped MXFP8 kernels are not wired here)"
        )
    if refused is not None:
        raise PrecisionError(f"{where} on torchao's kernels: {refused}; {fix}")
    return (
        recipe,
        False,
        f"; nn.Linear in {recipe.format}, torchao kernels ({capability.TORCHAO_MODULES[recipe.format]})",
    )


def _gemm_rows(config: JobConfig, dims: ParallelDims) -> list[tuple[int, str, bool]]:
    """(tokens, the fields that set them, with backward) of each kind of Linear GEMM the job runs:
    training's micro-batches, evaluation batches, one token at a time when sampling."""
    t, v = config.training, config.validation
    per, field = (
        (config.parallelism.pipeline_parallel_microbatch_size, "parallelism.pipeline_parallel_microbatch_size")
        if dims.pp_enabled
        else (t.local_batch_size, "training.local_batch_size")
    )
    rows = [(per * t.seq_len // dims.cp, f"{field} x training.seq_len / context_parallel_degree", True)]
    if v.enable:
        rows.append(
            (
                (v.local_batch_size or t.local_batch_size) * (v.seq_len or t.seq_len) // dims.cp,
                "validation.local_batch_size x validation.seq_len / context_parallel_degree",
                False,
            )
        )
    if v.enable and v.sample_prompts:
        rows.append((1, "validation.sample_prompts (decoding one token a step)", False))
    return rows


def _diloco(config: JobConfig) -> dict[str, Any]:
    """The plan's DiLoCo decisions: pseudo-gradients cross the groups in
    fault_tolerance.pseudo_gradient_dtype (float32 unless asked: each group's pseudo-gradient is a
    difference of weights sync_steps apart, and bf16 keeps only 8 bits of it); the global weights
    and the outer momentum are float32 whatever the parameters' dtype, since the outer step adds
    an update far smaller than the weights to them (in bf16 most such updates round away)."""
    ft = config.fault_tolerance
    if not ft.enable or ft.semi_sync_method != "diloco":
        return {}
    return {
        "sync_steps": ft.sync_steps,
        "pseudo_gradient_dtype": _DTYPES[ft.pseudo_gradient_dtype],
        "outer_state_dtype": torch.float32,
    }


def _attention(config: JobConfig, device_type: str, dims: ParallelDims) -> dict[str, Any]:
    """model.attention_backend resolved (models.attention.decide_backend, which refuses what
    cannot run in one line), with the family's masks beyond causal / documents."""
    masks = getattr(get_family(config.model.name).model_cls, "attention_masks", ())
    decided = decide_backend(config.model.attention_backend, device_type, config.model.attn_mask_type, masks, dims.cp)
    return {"attention_backend": decided.backend, "attention_reason": decided.reason}


def _optimizer_state_dtype(config: JobConfig, storage: torch.dtype) -> torch.dtype:
    """optimizer.state_dtype, with 'auto' = the storage dtype (what torch's AdamW keeps), and the
    optimizer settings no machine can honour refused."""
    o = config.optimizer
    state = storage if o.state_dtype == "auto" else _DTYPES[o.state_dtype]
    if o.stochastic_rounding and storage != torch.bfloat16:
        raise PrecisionError(
            f"'optimizer.stochastic_rounding' rounds bf16 weights; with 'training.dtype' = "
            f"'{config.training.dtype}' the weights take every update exactly (fp32 master weights): "
            f"drop it, or set training.dtype = 'bfloat16' for pure bf16 training"
        )
    if (state != storage or o.stochastic_rounding) and "optimizer.implementation" in config.explicit:
        raise PrecisionError(
            f"'optimizer.implementation' = '{o.implementation}' picks a kernel of torch's AdamW, which "
            f"keeps its state in the parameters' dtype and rounds to nearest; with optimizer.state_dtype = "
            f"'{o.state_dtype}' / stochastic_rounding the step is torchtitan_amp's per-parameter AdamW: "
            f"drop optimizer.implementation"
        )
    return state


def _router_dtype(config: JobConfig, enabled: bool, storage: torch.dtype) -> torch.dtype:
    """mixed_precision.router_dtype: fp64 is always allowed (more than asked for); bf16 only
    where mixed precision is on, as it rounds routing below the dtype the job trains in."""
    asked = getattr(torch, config.mixed_precision.router_dtype)  # float64 is not a training dtype
    if asked == torch.bfloat16 and not enabled and storage != torch.bfloat16:
        raise PrecisionError(
            "'mixed_precision.router_dtype' = 'bfloat16' routes in bf16 while this job trains in "
            f"{dtype_name(storage)} (mixed precision off or not native here); use 'float32' or 'float64'"
        )
    return asked


def _choose_path(enabled: bool, param: torch.dtype, reduce: torch.dtype, dims: ParallelDims) -> Path_:
    """`enabled`: mixed precision asked for over fp32 storage (pure low precision is "full")."""
    if not enabled:
        return "full"
    if dims.fsdp_enabled:
        return "fsdp"
    if param == torch.float32 and (reduce == torch.float32 or not dims.ddp_enabled):
        return "full"
    return "autocast"


def _comm_hook(path: Path_, reduce: torch.dtype, dims: ParallelDims) -> CommHook:
    """DDP's gradient compress hook: only on the autocast path, when gradients travel below fp32."""
    if path == "autocast" and dims.ddp_enabled and reduce != torch.float32:
        return "bf16_compress" if reduce == torch.bfloat16 else "fp16_compress"
    return "none"


def _grad_scaler(param: torch.dtype, path: Path_, dims: ParallelDims) -> ScalerName:
    """fp16 needs a loss scale. Ranks holding different gradient shards (FSDP, TP, PP) must agree
    on inf/nan, or some would step while others skip; ShardedGradScaler all-reduces found_inf."""
    if param != torch.float16 or path == "full":
        return "none"
    return "ShardedGradScaler" if path == "fsdp" or dims.tp_enabled or dims.pp_enabled else "GradScaler"


def _notes(config: JobConfig, dims: ParallelDims, grad_scaler: ScalerName, enabled: bool) -> tuple[str, ...]:
    """The start-up notes: settings that were given but have no effect in this job."""
    notes = []
    if grad_scaler == "none" and enabled and "mixed_precision.init_scale" in config.explicit:
        notes.append("loss-scaling settings are ignored: only float16 needs a loss scale")
    if config.mixed_precision.enabled is False:
        notes.append("mixed_precision.enabled = false: every path trains in one dtype")
    if "mixed_precision.cp_reduce_dtype" in config.explicit and not dims.cp_enabled:
        notes.append("mixed_precision.cp_reduce_dtype has no effect: context_parallel_degree is 1")
    return tuple(notes)


def _scaler_kwargs(config: JobConfig) -> dict[str, float]:
    """The loss scaler's settings, as torch's GradScaler takes them."""
    mp = config.mixed_precision
    return {
        "init_scale": mp.init_scale,
        "growth_factor": mp.growth_factor,
        "backoff_factor": mp.backoff_factor,
        "growth_interval": mp.growth_interval,
    }


def _check_plan_composes(plan: PrecisionPlan, config: JobConfig) -> None:
    """Decisions that cannot run together with the rest of the job: each a config error."""
    if plan.replica_groups and plan.grad_scaler != "none":
        # Each group's gradients would cross groups scaled by its own loss scale, and a healed
        # group would start from init_scale: the average would mix scales.
        raise PrecisionError(
            "float16 loss scaling is not supported with fault_tolerance.enable: train in "
            "bfloat16 (mixed_precision.param_dtype = 'bfloat16')"
        )
    if config.optimizer.implementation == "fused" and not plan.fused_optimizer_ok:
        raise PrecisionError(
            "'optimizer.implementation' = 'fused' cannot run float16 with sharded gradients (FSDP, TP "
            "or PP): torch's ShardedGradScaler hands the fused AdamW an inf flag of shape [1] that its "
            "0-d step counters cannot take (torch 2.13 fails at the first step); use 'auto' or 'foreach'"
        )


@dataclass(frozen=True)
class PrecisionPlan:
    path: Path_
    device_type: str
    storage_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype
    safe_modules: tuple[type[nn.Module], ...]
    comm_hook: CommHook
    grad_scaler: ScalerName
    scaler_kwargs: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # mixed_precision.enabled as configured: "true", "false", "auto" (or "auto, param_dtype = X
    # set": an explicit dtype is honoured like "true")
    enabled_setting: str = "true"
    speed: LowPrecisionSpeed | None = None  # the low-precision matmul check, when one was made
    decision: str = ""  # the start-up line saying what precision the job trains in, and why
    warnings: tuple[str, ...] = ()
    fp8: Literal["none", "tensorwise", "rowwise"] = "none"  # torchao float8 recipe of the Linears
    fp8_skip: tuple[str, ...] = ()  # fnmatch patterns of Linears kept out of fp8
    fp8_all_gather: bool = False  # FSDP all-gathers fp8 weights (tensorwise only)
    block_scaled: BlockScaledRecipe | None = None  # MXFP8 / NVFP4 recipe of the converted Linears
    block_scaled_emulated: bool = False  # quantized bit-exactly, multiplied in fp32; False: torchao kernels
    block_scaled_skip: tuple[str, ...] = ()  # fnmatch patterns of Linears kept out
    block_scaled_edge_layers: int = 0  # first and last blocks kept out
    block_scaled_experts: bool = False  # the routed experts' grouped GEMMs in the recipe too
    fp32_names: tuple[str, ...] = ()  # fnmatch patterns of module names kept in fp32 (by name)
    frozen_names: tuple[str, ...] = ()  # training.freeze: fnmatch patterns of frozen modules
    optimizer_state_dtype: torch.dtype = torch.float32  # AdamW's exp_avg and exp_avg_sq
    stochastic_rounding: bool = False  # pure bf16: the updated weights are rounded stochastically
    # Context parallel (cp > 1): the dtype the cp ranks' key/value gradients are summed in
    cp_reduce_dtype: torch.dtype = torch.float32
    context_parallel_degree: int = 1
    # Mixture of experts: what routers compute their logits, scores, top-k and weights in
    router_dtype: torch.dtype = torch.float32
    expert_parallel_degree: int = 1
    # fault_tolerance.enable: the torchft replica groups whose gradients are averaged (0: off)
    replica_groups: int = 0
    # fault_tolerance.semi_sync_method = "diloco": every `sync_steps` inner steps the groups average
    # their pseudo-gradients in pseudo_gradient_dtype; the global weights and the outer (Nesterov)
    # momentum are kept in outer_state_dtype (0 sync_steps: gradients averaged every step)
    sync_steps: int = 0
    pseudo_gradient_dtype: torch.dtype = torch.float32
    outer_state_dtype: torch.dtype = torch.float32
    # model.attention_backend resolved (models.attention.decide_backend): "sdpa" or "flex", and why.
    # Either way softmax statistics are fp32 and the output is in q/k/v's dtype.
    attention_backend: str = "sdpa"
    attention_reason: str = ""
    # [lora]: adapters on frozen base Linears (lora_plan.py), None when off
    lora: LoraPlan | None = None

    # -----------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_config(
        cls,
        config: JobConfig,
        dims: ParallelDims,
        device_type: str,
        *,
        probe: Callable[[str, torch.dtype], LowPrecisionSpeed] | None = low_precision_speed,
        run_kernels: bool = True,
    ) -> PrecisionPlan:
        """The plan for a job: its path, dtypes, low-bit formats and the start-up line saying why.
        Raises PrecisionError for a setting this job cannot honour.

        Args:
            config: the job's configuration (mixed_precision, training.dtype, optimizer, ...).
            dims: the job's parallel layout, which picks the path, the hook and the scaler.
            device_type: the torch device type the job trains on ("cuda", "cpu", ...).
            probe: answers whether a low-precision matmul is native on `device_type` (measured
                on CPU); None when there is no hardware to ask (a dry run sizing a GPU job):
                then `mixed_precision.enabled = "auto"` means on.
            run_kernels: False in the launcher's pre-flight: the fp8 and block-scaled probes read
                the GPU's capability and run no kernel (no CUDA context before torchrun starts);
                the ranks run them.
        """
        mp = config.mixed_precision
        storage = _DTYPES[config.training.dtype]
        # Mixed precision asked for, or left to "auto" (pure low precision is the "full" path).
        asked = mp.enabled is not False and storage == torch.float32
        _check_settings(config, storage, asked)
        setting = _setting_name(config)
        low = _DTYPES[mp.param_dtype] if asked else storage  # what the matmuls would run in
        speed = probe(device_type, low) if probe is not None and low != torch.float32 else None
        enabled, warnings = asked, []
        if speed is not None and not speed.native:
            if setting == "auto" and asked:
                enabled = False
            else:
                warnings.append(_emulated_warning(speed, config))
        param = _DTYPES[mp.param_dtype] if enabled else storage
        reduce = _DTYPES[mp.reduce_dtype] if enabled else storage
        if probe is not None:  # a dry run sizes a device this machine may not have: nothing to ask
            _check_device_support(device_type, param)
        path = _choose_path(enabled, param, reduce, dims)
        grad_scaler = _grad_scaler(param, path, dims)
        router = _router_dtype(config, enabled, storage)
        decision = _decision_line(setting, path, param, storage, speed)
        if mp.fp8 != "none":
            _check_fp8(config, dims, path, device_type, on_hardware=probe is not None, run_kernels=run_kernels)
            decision += f"; nn.Linear in fp8 ({mp.fp8}{', fp8 all-gather' if mp.fp8_all_gather else ''})"
        elif mp.fp8_all_gather:
            raise PrecisionError("'mixed_precision.fp8_all_gather' needs mixed_precision.fp8 = 'tensorwise'")
        block_scaled, emulated, words = _block_scaled(
            config, dims, device_type, on_hardware=probe is not None, run_kernels=run_kernels
        )
        decision += words
        plan = cls(
            path=path,
            device_type=device_type,
            storage_dtype=storage,
            param_dtype=param,
            reduce_dtype=reduce,
            output_dtype=_DTYPES[mp.output_dtype] if enabled else storage,
            safe_modules=resolve_module_classes(mp.lower_precision_safe_modules) if enabled else (),
            comm_hook=_comm_hook(path, reduce, dims),
            grad_scaler=grad_scaler,
            scaler_kwargs=_scaler_kwargs(config),
            notes=_notes(config, dims, grad_scaler, enabled),
            enabled_setting=setting,
            speed=speed,
            decision=decision,
            warnings=tuple(warnings),
            fp8=mp.fp8,
            fp8_skip=tuple(mp.fp8_skip_modules),
            fp8_all_gather=mp.fp8_all_gather,
            block_scaled=block_scaled,
            block_scaled_emulated=emulated,
            block_scaled_skip=tuple(mp.block_scaled_skip_modules),
            block_scaled_edge_layers=mp.block_scaled_edge_layers,
            block_scaled_experts=block_scaled is not None and mp.block_scaled_experts,
            fp32_names=tuple(mp.fp32_module_names),
            frozen_names=tuple(config.training.freeze),
            optimizer_state_dtype=_optimizer_state_dtype(config, storage),
            stochastic_rounding=config.optimizer.stochastic_rounding,
            cp_reduce_dtype=_DTYPES[mp.cp_reduce_dtype] if enabled else storage,
            context_parallel_degree=dims.cp,
            router_dtype=router,
            expert_parallel_degree=dims.ep,
            replica_groups=config.fault_tolerance.group_size if config.fault_tolerance.enable else 0,
            **_diloco(config),
            **_attention(config, device_type, dims),
            lora=decide_lora(config, dims, param if path != "full" else storage),
        )
        _check_plan_composes(plan, config)
        return plan

    # -----------------------------------------------------------------------------------------
    # Questions the rest of the code asks

    @property
    def compute_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes the step's matmuls run in: storage (fp32 islands, or everything) and param."""
        return tuple(sorted({self.storage_dtype, self.param_dtype}, key=str))

    @property
    def measured_here(self) -> bool:
        """Whether this rank's decision rests on a timing of this machine ("auto" on a CPU; an
        explicit setting only warns from it), which another rank may measure otherwise: the ranks
        must then check that they agree."""
        return self.enabled_setting == "auto" and self.speed is not None and self.speed.source == "measured"

    @property
    def what_trains(self) -> str:
        """The decision in a few words, the same on every rank that decided alike."""
        return (
            f"{self.path} path, {short_name(self.param_dtype)} compute, {short_name(self.storage_dtype)} "
            f"storage, {short_name(self.reduce_dtype)} reduce"
        )

    def disagreement(self, by_rank: list[str]) -> str | None:
        """One error line when the ranks' `what_trains` differ (None when they agree): one rank
        computing in bf16 while another computes in fp32 trains a model nobody asked for, or dies
        in its first all-gather (gloo: "Received data size doesn't match")."""
        if len(set(by_rank)) <= 1:
            return None
        other = next(r for r, w in enumerate(by_rank) if w != by_rank[0])
        return (
            f"mixed_precision.enabled = {self.enabled_setting}: the ranks decided differently (rank 0: "
            f"{by_rank[0]}; rank {other}: {by_rank[other]}) because each timed this CPU's low-precision "
            f"matmul on its own; set mixed_precision.enabled = true or false, or {LOWP_ENV}=native|emulated"
        )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.param_dtype if self.path == "autocast" and self.param_dtype != torch.float32 else None

    def is_safe(self, module: nn.Module) -> bool:
        """In lower_precision_safe_modules: by class, or through `safe_as` for modules that are
        Linears in another form (MoE's grouped experts declare safe_as = nn.Linear)."""
        safe_as = getattr(module, "safe_as", None)
        listed = isinstance(module, self.safe_modules) or (
            safe_as is not None and issubclass(safe_as, self.safe_modules)
        )
        return listed and not getattr(module, FP32_BY_NAME, False)

    def routes(self, module: nn.Module) -> bool:
        """A token router (declares `router_dtype`): computes in the plan's router_dtype."""
        return hasattr(type(module), "router_dtype")

    def apply_router_dtype(self, model: nn.Module) -> list[str]:
        """Tell every router what to route in; returns their names (for the report)."""
        names = []
        for name, module in model.named_modules():
            if self.routes(module):
                module.router_dtype = self.router_dtype
                names.append(name)
        return names

    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        """What `module`'s own matmuls run in: param_dtype for safe modules off the "full" path,
        float8_e4m3fn for fp8 Linears (both recipes), the storage dtype otherwise. The report, the
        frozen storage dtype and the audit's promises all ask this."""
        if type(module).__name__ == "Float8Linear":
            return torch.float8_e4m3fn
        # The emulation's GEMMs (a Linear's, or grouped experts'): dequantized operands in fp32.
        if isinstance(module, BlockScaledLinear) or getattr(module, "block_scaled_mm", None) is not None:
            return torch.float32
        if self.routes(module):
            return self.router_dtype
        return self.param_dtype if self.path != "full" and self.is_safe(module) else self.storage_dtype

    def frozen_dtype(self, module: nn.Module) -> torch.dtype:
        """A frozen module's parameters are stored in what it computes in: no fp32 master copy is
        needed where nothing updates it (fp8 Linears are never frozen: fp8 skips them)."""
        return self.param_dtype if self.path != "full" and self.is_safe(module) else self.storage_dtype

    def fp32_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules owning parameters outside the safe list, in `model.modules()` order: they run in
        fp32 (autocast off on the autocast path, an fp32 FSDP group on the FSDP path)."""
        return [m for m in model.modules() if not self.is_safe(m) and any(True for _ in m.parameters(recurse=False))]

    @property
    def fused_optimizer_ok(self) -> bool:
        """torch's fused AdamW takes the scaler's inf flag into its 0-d step counters, which
        ShardedGradScaler's shape-[1] flag breaks (torch 2.13): `auto` picks foreach then."""
        return self.grad_scaler != "ShardedGradScaler"

    @property
    def mixed_state_optimizer(self) -> bool:
        """torch's AdamW keeps moments in the parameters' dtype and rounds to nearest; anything
        else needs optim.AdamWMixedState."""
        return self.optimizer_state_dtype != self.storage_dtype or self.stochastic_rounding

    def context_parallel(self, group: dist.ProcessGroup) -> ContextParallel:
        """What the model's attention gathers keys and values with over the cp group: they travel
        in the activations' dtype (the gather is exact), their gradients are summed in
        cp_reduce_dtype."""
        return ContextParallel(group, self.cp_reduce_dtype)

    def cross_group_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype torchft's cross-group all-reduce averages a gradient in: the one its group
        reduced it in (each param group's reduce dtype). Lower would round a second time what the
        group summed; higher would cost bytes without undoing the group's rounding."""
        return grad_dtype
