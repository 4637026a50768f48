"""The precision plan: the only place where precision is decided.

`PrecisionPlan.from_config` turns the job config and the parallel layout into one of three paths:

- "fsdp":     data-parallel sharding is on; FSDP2 `MixedPrecisionPolicy` per module group does the
              casting, fp32 master params, fp32 policy for modules outside the safe list.
- "autocast": no sharding (single process, DDP/replicate, TP, PP); a forward-only `torch.autocast`
              around forward + loss, a separate backward context without autocast, and a gradient
              comm hook sending safe modules' gradients in `reduce_dtype` when DDP is on.
- "full":     one dtype everywhere (fp32, or pure bf16 when `training.dtype = "bfloat16"`).

Everything else (parallelize, trainer, checkpoint) asks the plan and never re-decides.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate

from torchtitan_amp import fp8
from torchtitan_amp.config import JobConfig
from torchtitan_amp.errors import PrecisionError
from torchtitan_amp.matmul_speed import LowPrecisionSpeed, low_precision_speed
from torchtitan_amp.parallel_dims import ParallelDims
from torchtitan_amp.rules import DTYPES, dtype_name, short_name

logger = logging.getLogger("torchtitan_amp")

Path_ = Literal["fsdp", "autocast", "full"]
_DTYPES = {name: getattr(torch, name) for name in DTYPES}

# Ops we keep in fp32 whatever the path. The norm and rotary upcasts live in the model (CPU
# autocast would otherwise run them in bf16); the loss upcast lives in `loss_fn`.
FP32_ISLANDS = ("RMSNorm (computes in fp32, returns input dtype)", "rotary tables and rotation",
                "cross-entropy on fp32 logits", "loss and metric accumulators")


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


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _user_class(module: nn.Module) -> type:
    """The model's own class: FSDP2 and replicate swap in dynamic subclasses of it."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


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
                    f"fp32 master weights (training.dtype = 'float32') and train in mixed precision")
    if not asked:
        return
    if mp.param_dtype == "bfloat16" and mp.reduce_dtype == "float16":
        raise PrecisionError(
            "'mixed_precision.reduce_dtype' = 'float16' with param_dtype = 'bfloat16' can overflow "
            "(bf16-range gradients exceed fp16's 65504); use reduce_dtype 'bfloat16' or 'float32'"
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
    avoid = ("--training.dtype float32" if pure
             else '--no-mixed_precision.enabled (or mixed_precision.enabled = "auto")')
    return (f"{speed.describe()}; training in {dtype_name(speed.dtype)} as configured anyway. "
            f"{avoid} trains in fp32 instead")


def _decision_line(setting: str, path: Path_, param: torch.dtype, storage: torch.dtype,
                   speed: LowPrecisionSpeed | None) -> str:
    """What the job trains in and why, in one line."""
    if path == "full":
        what = "fp32" if storage == torch.float32 else f"pure {short_name(storage)}"
    else:
        what = f"{short_name(param)} mixed precision ({path} path)"
    why = f": {speed.describe()}" if speed is not None else ""
    return f"mixed_precision.enabled = {setting} -> {what}{why}"


def _check_fp8(config: JobConfig, dims: ParallelDims, path: Path_, device_type: str, *, on_hardware: bool) -> None:
    """What fp8 cannot do here, refused in one line (never a silent bf16/fp32 fallback).
    `on_hardware` False (a dry run): the device and torchao are not this machine's to check."""
    mp = config.mixed_precision
    if mp.fp8_all_gather and (mp.fp8 != "tensorwise" or path != "fsdp"):
        raise PrecisionError(
            f"'mixed_precision.fp8_all_gather' needs fp8 = 'tensorwise' on the FSDP path (data-parallel "
            f"sharding with mixed precision); this job has fp8 = '{mp.fp8}' on the {path} path")
    if mp.fp8_all_gather and device_type != "cuda":
        raise PrecisionError(f"'mixed_precision.fp8_all_gather' needs CUDA/nccl: gloo ({device_type}) cannot "
                             "all-gather float8 tensors")
    if not on_hardware:
        return
    why = fp8.torchao_missing(mp.fp8, mp.fp8_all_gather) or fp8.matmul_unsupported(device_type)
    if why is not None:
        raise PrecisionError(f"'mixed_precision.fp8' = '{mp.fp8}': {why}")


def _optimizer_state_dtype(config: JobConfig, storage: torch.dtype) -> torch.dtype:
    """optimizer.state_dtype, with 'auto' = the storage dtype (what torch's AdamW keeps), and the
    optimizer settings no machine can honour refused."""
    o = config.optimizer
    state = storage if o.state_dtype == "auto" else _DTYPES[o.state_dtype]
    if o.stochastic_rounding and storage != torch.bfloat16:
        raise PrecisionError(
            f"'optimizer.stochastic_rounding' rounds bf16 weights; with 'training.dtype' = "
            f"'{config.training.dtype}' the weights take every update exactly (fp32 master weights): "
            f"drop it, or set training.dtype = 'bfloat16' for pure bf16 training")
    if (state != storage or o.stochastic_rounding) and "optimizer.implementation" in config.explicit:
        raise PrecisionError(
            f"'optimizer.implementation' = '{o.implementation}' picks a kernel of torch's AdamW, which "
            f"keeps its state in the parameters' dtype and rounds to nearest; with optimizer.state_dtype = "
            f"'{o.state_dtype}' / stochastic_rounding the step is torchtitan_amp's per-parameter AdamW: "
            f"drop optimizer.implementation")
    return state


def _choose_path(enabled: bool, param: torch.dtype, reduce: torch.dtype, dims: ParallelDims) -> Path_:
    """`enabled`: mixed precision asked for over fp32 storage (pure low precision is "full")."""
    if not enabled:
        return "full"
    if dims.fsdp_enabled:
        return "fsdp"
    if param == torch.float32 and (reduce == torch.float32 or not dims.ddp_enabled):
        return "full"
    return "autocast"


@dataclass(frozen=True)
class PrecisionPlan:
    path: Path_
    device_type: str
    storage_dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    output_dtype: torch.dtype
    safe_modules: tuple[type[nn.Module], ...]
    comm_hook: Literal["bf16_compress", "fp16_compress", "none"]
    grad_scaler: Literal["none", "GradScaler", "ShardedGradScaler"]
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
    fp32_names: tuple[str, ...] = ()  # fnmatch patterns of module names kept in fp32 (by name)
    frozen_names: tuple[str, ...] = ()  # training.freeze: fnmatch patterns of frozen modules
    optimizer_state_dtype: torch.dtype = torch.float32  # AdamW's exp_avg and exp_avg_sq
    stochastic_rounding: bool = False  # pure bf16: the updated weights are rounded stochastically

    # -----------------------------------------------------------------------------------------
    # Construction

    @classmethod
    def from_config(cls, config: JobConfig, dims: ParallelDims, device_type: str, *,
                    probe: Callable[[str, torch.dtype], LowPrecisionSpeed] | None = low_precision_speed,
                    ) -> "PrecisionPlan":
        """`probe` answers whether a low-precision matmul is native on `device_type` (measured
        on CPU); None when there is no hardware to ask (a dry run sizing a GPU job): then
        `mixed_precision.enabled = "auto"` means on."""
        mp = config.mixed_precision
        storage = _DTYPES[config.training.dtype]
        # Mixed precision asked for, or left to "auto" (pure low precision is the "full" path).
        asked = mp.enabled is not False and storage == torch.float32
        _check_settings(config, storage, asked)
        setting = _setting_name(config)
        low = _DTYPES[mp.param_dtype] if asked else storage  # what the matmuls would run in
        speed = probe(device_type, low) if probe is not None and low != torch.float32 else None
        enabled, notes, warnings = asked, [], []
        if speed is not None and not speed.native:
            if setting == "auto" and asked:
                enabled = False
            else:
                warnings.append(_emulated_warning(speed, config))
        param = _DTYPES[mp.param_dtype] if enabled else storage
        reduce = _DTYPES[mp.reduce_dtype] if enabled else storage
        output = _DTYPES[mp.output_dtype] if enabled else storage
        _check_device_support(device_type, param)
        safe = resolve_module_classes(mp.lower_precision_safe_modules) if enabled else ()
        path = _choose_path(enabled, param, reduce, dims)
        comm_hook = "none"
        if path == "autocast" and dims.ddp_enabled and reduce != torch.float32:
            comm_hook = "bf16_compress" if reduce == torch.bfloat16 else "fp16_compress"
        grad_scaler = "none"
        if param == torch.float16 and path != "full":
            # Ranks holding different gradient shards (FSDP, TP, PP) must agree on inf/nan, or
            # some would step while others skip; ShardedGradScaler all-reduces found_inf.
            sharded = path == "fsdp" or dims.tp_enabled or dims.pp_enabled
            grad_scaler = "ShardedGradScaler" if sharded else "GradScaler"
        elif enabled and "mixed_precision.init_scale" in config.explicit:
            notes.append("loss-scaling settings are ignored: only float16 needs a loss scale")
        if mp.enabled is False:
            notes.append("mixed_precision.enabled = false: every path trains in one dtype")
        scaler_kwargs = {"init_scale": mp.init_scale, "growth_factor": mp.growth_factor,
                         "backoff_factor": mp.backoff_factor, "growth_interval": mp.growth_interval}
        decision = _decision_line(setting, path, param, storage, speed)
        if mp.fp8 != "none":
            _check_fp8(config, dims, path, device_type, on_hardware=probe is not None)
            decision += f"; nn.Linear in fp8 ({mp.fp8}{', fp8 all-gather' if mp.fp8_all_gather else ''})"
        elif mp.fp8_all_gather:
            raise PrecisionError("'mixed_precision.fp8_all_gather' needs mixed_precision.fp8 = 'tensorwise'")
        state_dtype = _optimizer_state_dtype(config, storage)
        plan = cls(path, device_type, storage, param, reduce, output, safe, comm_hook, grad_scaler,
                   scaler_kwargs, tuple(notes), setting, speed, decision, tuple(warnings), mp.fp8,
                   tuple(mp.fp8_skip_modules), mp.fp8_all_gather, tuple(mp.fp32_module_names),
                   tuple(config.training.freeze), state_dtype, config.optimizer.stochastic_rounding)
        if config.optimizer.implementation == "fused" and not plan.fused_optimizer_ok:
            raise PrecisionError(
                "'optimizer.implementation' = 'fused' cannot run float16 with sharded gradients (FSDP, TP "
                "or PP): torch's ShardedGradScaler hands the fused AdamW an inf flag of shape [1] that its "
                "0-d step counters cannot take (torch 2.13 fails at the first step); use 'auto' or 'foreach'")
        return plan

    # -----------------------------------------------------------------------------------------
    # Questions the rest of the code asks

    @property
    def compute_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes the step's matmuls run in: storage (fp32 islands, or everything) and param."""
        return tuple(sorted({self.storage_dtype, self.param_dtype}, key=str))

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.param_dtype if self.path == "autocast" and self.param_dtype != torch.float32 else None

    def is_safe(self, module: nn.Module) -> bool:
        return isinstance(module, self.safe_modules) and not getattr(module, _FP32_BY_NAME, False)

    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        """What `module`'s own matmuls run in: param_dtype for safe modules off the "full" path,
        float8_e4m3fn for fp8 Linears (both recipes), the storage dtype otherwise. The report, the
        frozen storage dtype and the audit's promises all ask this."""
        if type(module).__name__ == "Float8Linear":
            return torch.float8_e4m3fn
        return self.param_dtype if self.path != "full" and self.is_safe(module) else self.storage_dtype

    def frozen_dtype(self, module: nn.Module) -> torch.dtype:
        """A frozen module's parameters are stored in what it computes in: no fp32 master copy is
        needed where nothing updates it (fp8 Linears are never frozen: fp8 skips them)."""
        return self.param_dtype if self.path != "full" and self.is_safe(module) else self.storage_dtype

    def freeze(self, model: nn.Module) -> dict[str, str]:
        """training.freeze: the matching modules' parameters (everything inside them) get
        requires_grad = False and their compute dtype as storage. Call on the whole model after
        mark_fp32_by_name and before it is split or parallelized. Returns {parameter: dtype}."""
        named = dict(model.named_modules())
        unmatched = [p for p in self.frozen_names if not any(fnmatch.fnmatchcase(n, p) for n in named if n)]
        if unmatched:
            raise PrecisionError(f"'training.freeze' entry {unmatched[0]!r} matches no module of the model "
                                 "(names such as 'tok_embeddings', 'layers.0', 'layers.*.attention')")
        frozen: dict[str, str] = {}
        for name, module in named.items():
            if not name or not any(fnmatch.fnmatchcase(name, p) for p in self.frozen_names):
                continue
            for sub_name, sub in module.named_modules(prefix=name):
                dtype = self.frozen_dtype(sub)
                for pname, p in list(sub.named_parameters(recurse=False)):
                    sub.register_parameter(pname, nn.Parameter(p.detach().to(dtype), requires_grad=False))
                    frozen[f"{sub_name}.{pname}"] = dtype_name(dtype)
                setattr(sub, _FROZEN, True)
        return frozen

    def refreeze(self, model: nn.Module) -> None:
        """TP's SequenceParallel and distribute_module re-register parameters as DTensors that
        require grad: frozen modules' parameters are frozen again after TP."""
        for module in model.modules():
            if getattr(module, _FROZEN, False):
                for p in module.parameters(recurse=False):
                    p.requires_grad_(False)

    def frozen_low_precision_modules(self, model: nn.Module) -> list[nn.Module]:
        """Frozen modules stored in param_dtype: their own FSDP groups, so that no group mixes them
        with fp32 trained parameters."""
        return [m for m in model.modules() if getattr(m, _FROZEN, False) and self.frozen_dtype(m) != self.storage_dtype
                and any(True for _ in m.parameters(recurse=False))]

    def mark_fp32_by_name(self, model: nn.Module) -> list[str]:
        """Tag the modules `fp32_names` match, and everything inside them, as outside the safe
        list: every path then asks `is_safe` and keeps them in fp32 (autocast islands, fp32 FSDP
        groups, fp32 gradient reduction, no fp8). Call on the whole model before it is split or
        parallelized; returns the names of the tagged modules that own parameters. A pattern
        naming no module is a PrecisionError."""
        named = dict(model.named_modules())
        unmatched = [p for p in self.fp32_names if not any(fnmatch.fnmatchcase(n, p) for n in named if n)]
        if unmatched:
            raise PrecisionError(f"'mixed_precision.fp32_module_names' entry {unmatched[0]!r} matches no module "
                                 "of the model (names such as 'output', 'layers.0', 'layers.*.attention.wo')")
        tagged = []
        for name, module in named.items():
            if name and any(fnmatch.fnmatchcase(name, p) for p in self.fp32_names):
                for sub_name, sub in module.named_modules(prefix=name):
                    setattr(sub, _FP32_BY_NAME, True)
                    if any(True for _ in sub.parameters(recurse=False)):
                        tagged.append(sub_name)
        return sorted(set(tagged))

    def fp32_modules(self, model: nn.Module) -> list[nn.Module]:
        """Modules owning parameters outside the safe list, in `model.modules()` order: they run in
        fp32 (autocast off on the autocast path, an fp32 FSDP group on the FSDP path)."""
        return [m for m in model.modules()
                if not self.is_safe(m) and any(True for _ in m.parameters(recurse=False))]

    def fsdp_policy(self, *, low_precision: bool, output_dtype: torch.dtype | None = None,
                    cast_forward_inputs: bool = True) -> MixedPrecisionPolicy:
        """Policy for one `fully_shard` group: safe modules in param/reduce dtype, others fp32.

        Transformer blocks pass `cast_forward_inputs=False` and get `cast_block_inputs` instead:
        FSDP's own input cast converts every floating argument, the rotary cos/sin tables too.
        """
        if self.path != "fsdp":
            return MixedPrecisionPolicy(output_dtype=output_dtype)
        if low_precision:
            return MixedPrecisionPolicy(self.param_dtype, self.reduce_dtype, output_dtype, cast_forward_inputs)
        # fp32 in, fp32 compute, and back to param dtype out, so the bf16 ops around it continue.
        return MixedPrecisionPolicy(torch.float32, torch.float32, output_dtype or self.param_dtype, True)

    def cast_block_inputs(self, block: nn.Module) -> None:
        """FSDP path: cast a block's hidden state (its first argument) to param_dtype, and nothing
        else. The rotary tables that follow it stay fp32 (an fp32 island): FSDP's
        `cast_forward_inputs` would round them to bf16, blurring positions by ~2**-9."""
        if self.path != "fsdp" or self.param_dtype == torch.float32:
            return
        dtype = self.param_dtype

        def cast_hidden_state(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                return (args[0].to(dtype),) + tuple(args[1:])
            return args

        block.register_forward_pre_hook(cast_hidden_state)

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Wraps forward + loss. Never wrap backward in it: autocast belongs to forward only."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    def apply_forward_context(self, module: nn.Module) -> None:
        """Run `module`'s forward (only) in the forward context: for pipeline stages, whose
        schedule interleaves forward and backward so no context can wrap forward alone."""
        _wrap_forward(module, self.forward_context)

    def check_fp8_modules(self, model: nn.Module) -> None:
        """Every fp8 skip pattern names a Linear of the model (a typo would convert it)."""
        if self.fp8 != "none":
            unmatched = fp8.unmatched_patterns(model, self.fp8_skip)
            if unmatched:
                raise PrecisionError(f"'mixed_precision.fp8_skip_modules' entry {unmatched[0]!r} matches no "
                                     "nn.Linear of the model (names such as 'output', 'layers.0.*')")

    def apply_fp8(self, model: nn.Module) -> list[str]:
        """Convert the model's fp8 Linears (before parallelizing); returns their names."""
        if self.fp8 == "none":
            return []
        return fp8.convert(model, self.fp8, self.fp8_skip, self.fp8_all_gather,
                           keep_fp32=lambda m: getattr(m, _FP32_BY_NAME, False) or getattr(m, _FROZEN, False))

    def after_optimizer_step(self, model_parts: list[nn.Module]) -> None:
        if self.fp8_all_gather:
            fp8.precompute_scales(model_parts)

    def apply_storage_dtype(self, model: nn.Module) -> None:
        """Store parameters (only) in storage_dtype: fp32 master weights for mixed precision,
        bf16 for pure-bf16 training. Buffers stay as built: the rotary tables must stay fp32."""
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(p.detach().to(self.storage_dtype), p.requires_grad))

    def apply_fp32_islands(self, model: nn.Module) -> None:
        """On the autocast path, run modules outside the safe list in fp32 (autocast off, float
        inputs upcast). The FSDP path gets the same from its fp32 groups' policy."""
        if self.autocast_dtype is None:
            return
        no_autocast = functools.partial(torch.autocast, self.device_type, enabled=False)
        for module in self.fp32_modules(model):
            if not getattr(module, "computes_in_fp32", False):
                _wrap_forward(module, no_autocast, cast_inputs=torch.float32)

    def backward_context(self) -> contextlib.AbstractContextManager:
        """Backward runs with autocast explicitly off, whatever a caller's context holds."""
        return torch.autocast(self.device_type, enabled=False)

    def cast_output(self, output: torch.Tensor) -> torch.Tensor:
        """On the autocast path the model's output dtype is ours to set (FSDP sets it itself)."""
        if self.path == "autocast" and output.is_floating_point():
            return output.to(self.output_dtype)
        return output

    def check_no_user_autocast(self) -> None:
        """Called at every step's entry: a caller's autocast would override this plan silently."""
        for device_type in {self.device_type, "cpu"}:
            if torch.is_autocast_enabled(device_type):
                dtype = dtype_name(torch.get_autocast_dtype(device_type))
                raise PrecisionError(
                    f"the train step is running inside a torch.autocast('{device_type}') region "
                    f"(dtype {dtype}); remove it and set mixed_precision.param_dtype = '{dtype}' "
                    f"in the job config instead"
                )

    def build_scaler(self) -> "LossScaler":
        if self.grad_scaler == "ShardedGradScaler":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return LossScaler(ShardedGradScaler(self.device_type, **self.scaler_kwargs))
        if self.grad_scaler == "GradScaler":
            return LossScaler(torch.amp.GradScaler(self.device_type, **self.scaler_kwargs))
        return LossScaler(None)

    def comm_hook_state(self, model: nn.Module, group: dist.ProcessGroup | None) -> "CompressHookState | None":
        """State for `compress_hook` on the DDP path, or None when gradients travel in fp32."""
        if self.comm_hook == "none":
            return None
        low = {id(p) for m in model.modules() if self.is_safe(m) for p in m.parameters(recurse=False)}
        return CompressHookState(group, self.reduce_dtype, frozenset(low))

    def partial_grad_reducer(self, model_parts: list[nn.Module]) -> "PartialGradReducer":
        """Who reduces the gradients DTensor leaves partial (TP's replicated norm weights under
        sequence parallel, outside FSDP): safe modules' in reduce_dtype, the rest in their own."""
        low = {id(p) for part in model_parts for m in part.modules() if self.is_safe(m) and self.path != "full"
               for p in m.parameters(recurse=False)}
        return PartialGradReducer(self.reduce_dtype, frozenset(low))

    # -----------------------------------------------------------------------------------------
    # Report

    def _param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"num_params": 0})
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            low = self.is_safe(module) and self.path != "full"
            # Off the "full" path storage is fp32: modules outside the safe list compute in it.
            compute = self.compute_dtype(module)
            name = _class_name(_user_class(module))
            reduce = self.reduce_dtype if low else self.storage_dtype
            if self.path == "autocast" and self.comm_hook == "none":
                reduce = self.storage_dtype
            frozen = not own[0].requires_grad
            g = groups[f"{name} {compute} {frozen}"]
            g.update(module_type=name, storage_dtype=dtype_name(own[0].dtype),
                     compute_dtype=dtype_name(compute), reduce_dtype="-" if frozen else dtype_name(reduce),
                     trained=not frozen)
            g["num_params"] += sum(p.numel() for p in own)
        return list(groups.values())

    def report(self, model: nn.Module) -> dict[str, Any]:
        groups = self._param_groups(model)
        return {
            "path": self.path,
            "param_dtype": dtype_name(self.param_dtype),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "output_dtype": dtype_name(self.output_dtype),
            "storage_dtype": dtype_name(self.storage_dtype),
            "autocast_dtype": dtype_name(self.autocast_dtype) if self.autocast_dtype else None,
            "comm_hook": self.comm_hook,
            "grad_scaler": self.grad_scaler,
            "lower_precision_safe_modules": [_class_name(c) for c in self.safe_modules],
            "fp32_modules": sorted({g["module_type"] for g in groups if g["compute_dtype"] == "float32"}),
            "fp32_islands": list(FP32_ISLANDS),
            "param_groups": groups,
            "mixed_precision_enabled": self.enabled_setting,
            "decision": self.decision,
            "low_precision_matmul": self.speed.to_dict() if self.speed else None,
            "compute_dtypes": [dtype_name(d) for d in self.compute_dtypes],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "fp8": self.fp8,
            "fp8_modules": sorted(n for n, m in _named_modules(model) if type(m).__name__ == "Float8Linear"),
            "fp8_all_gather": self.fp8_all_gather,
            "fp32_module_names": list(self.fp32_names),
            "optimizer": self.optimizer_summary(),
            "frozen": {n: dtype_name(p.dtype) for n, p in _named_parameters(model) if not p.requires_grad},
            "fp32_by_name": sorted(n for n, m in _named_modules(model) if getattr(m, _FP32_BY_NAME, False)
                                   and any(True for _ in m.parameters(recurse=False))),
        }

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

    def optimizer_summary(self) -> dict[str, Any]:
        mixed = self.mixed_state_optimizer
        return {"state_dtype": dtype_name(self.optimizer_state_dtype),
                "update": ("fp32 math per parameter (AdamWMixedState)" if mixed
                           else f"torch AdamW in {short_name(self.storage_dtype)}"),
                "weight_rounding": "stochastic" if self.stochastic_rounding else "nearest"}

    def log_and_write_report(self, model: nn.Module, dump_folder: str, is_writer: bool,
                             extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """`extra`: sections the job adds (gradient collectives and bytes per parameter, which
        the memory model computes from this plan)."""
        report = {**self.report(model), **(extra or {})}
        if is_writer:
            Path(dump_folder).mkdir(parents=True, exist_ok=True)
            (Path(dump_folder) / "precision_report.json").write_text(json.dumps(report, indent=2) + "\n")
            logger.info("precision: %s", self.decision)
            for warning in self.warnings:
                logger.warning("precision: %s", warning)
            logger.info("precision: path=%s param=%s reduce=%s output=%s comm_hook=%s scaler=%s",
                        self.path, short_name(self.param_dtype), short_name(self.reduce_dtype),
                        short_name(self.output_dtype), self.comm_hook, self.grad_scaler)
            logger.info("  %-40s %12s %8s %8s %8s", "module type", "params", "storage", "compute", "reduce")
            for g in report["param_groups"]:
                logger.info("  %-40s %12s %8s %8s %8s", g["module_type"].rsplit(".", 1)[-1] + ("" if g["trained"] else " (frozen)"),
                            f"{g['num_params']:,}", *(short_name(g[k]) for k in
                                                      ("storage_dtype", "compute_dtype", "reduce_dtype")))
            opt = report["optimizer"]
            logger.info("  optimizer: AdamW moments %s, update %s, weights rounded to %s", short_name(self.optimizer_state_dtype),
                        opt["update"], opt["weight_rounding"])
            for name, by_dtype in report.get("gradient_collectives", {}).items():
                logger.info("  gradient collective %s: %s per step", name,
                            ", ".join(f"{n:,} B {short_name(d)}" for d, n in sorted(by_dtype.items())))
            for note in self.notes:
                logger.info("  note: %s", note)
        return report


# The attribute mark_fp32_by_name sets: it travels with the module through deepcopy (pipeline
# stages), FSDP and TP, which keep the module objects.
_FP32_BY_NAME = "_torchtitan_amp_fp32_by_name"
_FROZEN = "_torchtitan_amp_frozen"


def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(f"{n}.{pn}" if n else pn, p) for n, m in _named_modules(model) for pn, p in m.named_parameters(recurse=False)]


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's modules by their names in the model; the trainer reports its pipeline stages
    as one ModuleList, whose index is not part of any module's name."""
    if isinstance(model, nn.ModuleList):
        return [(n.split(".", 1)[1], m) for n, m in model.named_modules() if "." in n]
    return list(model.named_modules())


def _wrap_forward(module: nn.Module, context: Callable[[], contextlib.AbstractContextManager],
                  cast_inputs: torch.dtype | None = None) -> None:
    """Make `module(...)` run its forward inside `context()`, optionally upcasting float inputs.

    An instance attribute, not a wrapper module, so parameter names (and checkpoints) are unchanged.
    """
    forward = module.forward

    def cast(x: Any) -> Any:
        return x.to(cast_inputs) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    @functools.wraps(forward)
    def forward_in_context(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs is not None:
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        with context():
            return forward(*args, **kwargs)

    module.forward = forward_in_context


# ---------------------------------------------------------------------------------------------
# Loss scaling


class LossScaler:
    """fp16 dynamic loss scaling behind one interface; a no-op when the plan needs none.

    Contract per optimizer step: `scale(loss)` every micro-batch, `unscale_(opt)` once before
    clipping, `step(opt)` returns False when the step was skipped for inf/nan gradients.
    """

    def __init__(self, scaler: torch.amp.GradScaler | None) -> None:
        self.scaler = scaler
        self.skipped_steps = 0
        # The scale as a Python float, read back from the device once per step (in `step`), so
        # that `get_scale()` in the loop and the log never synchronises. Only `update()` and
        # `load_state_dict` change it. Before the first `scale()` this is init_scale (no sync).
        self._scale = scaler.get_scale() if scaler else 1.0

    @property
    def enabled(self) -> bool:
        return self.scaler is not None

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            if self.scaler._scale is None:
                # A pipeline stage without the loss never called scale(): create the scale the
                # same lazy way, so that unscale_ / step / update run (and agree) on every rank.
                device = next(p.device for g in optimizer.param_groups for p in g["params"])
                self.scaler.scale(torch.zeros((), device=device))
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        self.scaler.step(optimizer)
        self.scaler.update()
        # update() backs the scale off exactly when this step found inf/nan and skipped.
        before, self._scale = self._scale, self.scaler.get_scale()
        stepped = self._scale >= before
        self.skipped_steps += not stepped
        return stepped

    def get_scale(self) -> float:
        return self._scale

    def state_dict(self) -> dict[str, Any]:
        state = self.scaler.state_dict() if self.scaler else {}
        return {"scaler": state, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()
        self.skipped_steps = int(state.get("skipped_steps", 0))


# ---------------------------------------------------------------------------------------------
# Gradients DTensor leaves partial


@dataclass
class PartialGradReducer:
    """Sums, once per step, the gradients that are still partial sums over a mesh dimension.

    Under TP with sequence parallel (and no FSDP, which reduces them itself) DTensor leaves a
    replicated parameter's gradient Partial, and every later use all-reduces it again: 4 times
    per step in fp32 on torch 2.13 (the gradient norm, then three AdamW ops), outside the plan
    (pytorch#190626). This does it once, flat per (mesh dims, wire dtype), in the plan's dtype.
    """

    dtype: torch.dtype  # reduce_dtype, for lower-precision-safe modules' parameters
    low_precision_params: frozenset[int]

    def __call__(self, params: list[nn.Parameter]) -> None:
        buckets: dict[tuple[Any, ...], list[nn.Parameter]] = defaultdict(list)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                if any(pl.is_partial() and pl.reduce_op != "sum" for pl in g.placements):
                    p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
                    continue
                wire = self.dtype if id(p) in self.low_precision_params else g.dtype
                dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_partial())
                buckets[(g.device_mesh, dims, wire)].append(p)
        for (mesh, dims, wire), group in buckets.items():
            self._reduce(group, mesh, dims, wire)

    def _reduce(self, params: list[nn.Parameter], mesh: Any, dims: tuple[int, ...], wire: torch.dtype) -> None:
        grads = [p.grad.to_local() for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).to(wire)
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for p, g in zip(params, grads):
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
            placements = [Replicate() if pl.is_partial() else pl for pl in p.grad.placements]
            p.grad = DTensor.from_local(g, mesh, placements, run_check=False, shape=p.grad.shape,
                                        stride=p.grad.stride())


# ---------------------------------------------------------------------------------------------
# DDP gradient compression that honours lower_precision_safe_modules and works on gloo and nccl


@dataclass
class CompressHookState:
    group: dist.ProcessGroup | None
    dtype: torch.dtype
    low_precision_params: frozenset[int]
    # Bytes this rank put on the wire for gradients, by dtype name: what tests and benchmarks read.
    bytes_sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _bucket_slices(bucket: dist.GradBucket) -> Iterator[tuple[int, int, int]]:
    """(parameter id, start, end) of each gradient inside the bucket's flat buffer."""
    buffer = bucket.buffer()
    base, size = buffer.data_ptr(), buffer.element_size()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        start = (g.data_ptr() - base) // size
        yield id(p), start, start + g.numel()


def _all_reduce_mean(flat: torch.Tensor, state: CompressHookState) -> torch.futures.Future:
    world = dist.get_world_size(state.group)
    flat.div_(world)
    state.bytes_sent[dtype_name(flat.dtype)] += flat.numel() * flat.element_size()
    return dist.all_reduce(flat, group=state.group, async_op=True).get_future()


def _gather(buffer: torch.Tensor, ranges: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    if len(ranges) == 1:
        start, end = ranges[0]
        return buffer[start:end].to(dtype, copy=True)
    return torch.cat([buffer[s:e] for s, e in ranges]).to(dtype)


def _scatter(buffer: torch.Tensor, ranges: list[tuple[int, int]], flat: torch.Tensor) -> None:
    offset = 0
    for start, end in ranges:
        buffer[start:end].copy_(flat[offset:offset + end - start])
        offset += end - start


# No annotations on purpose: DDP compares them to the real classes, and this module's postponed
# annotations are strings.
def compress_hook(state, bucket):  # type: ignore[no-untyped-def]
    """All-reduce safe modules' gradients in `state.dtype`, the rest in fp32; return fp32.

    torch's bf16_compress_hook refuses non-NCCL backends by name and casts whole buckets, so it
    can neither run on gloo nor keep norm/embedding gradients in fp32.
    """
    buffer = bucket.buffer()
    ranges: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for pid, start, end in _bucket_slices(bucket):
        ranges[pid in state.low_precision_params].append((start, end))
    parts: list[tuple[list[tuple[int, int]], torch.Tensor]] = []
    futures = []
    for low, dtype in ((True, state.dtype), (False, buffer.dtype)):
        if ranges[low]:
            flat = _gather(buffer, ranges[low], dtype)
            parts.append((ranges[low], flat))
            futures.append(_all_reduce_mean(flat, state))

    def decompress(_: torch.futures.Future) -> torch.Tensor:
        # Inside a callback of an nccl future the current stream waits on that collective only;
        # wait() on each other future makes it wait on theirs too before the flat buffers are read.
        for fut in futures:
            fut.wait()
        for rngs, flat in parts:
            _scatter(buffer, rngs, flat)
        return buffer

    # Chained from a collective's own future, never collect_all: collect_all's future carries no
    # CUDA events, and an nccl future completes when the all-reduce is queued, so its callback
    # could read the buffers before nccl has written them (each rank keeping its own gradient).
    return futures[0].then(decompress)


def install_comm_hook(model: nn.Module, state: CompressHookState | None) -> None:
    if state is not None:
        model.register_comm_hook(state, compress_hook)

