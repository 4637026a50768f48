"""Mixed precision: decided once from the job config (the plan), then applied per parallelism path.

Deciding (config -> plan, and what the plan answers and reports):
- `plan.py`:       `PrecisionPlan.from_config` and the checks it runs; the questions the rest of the
                   code asks (path, dtypes, `is_safe`, `fp32_modules`, `compute_dtype`, ...);
- `report.py`:     precision_report.json (with its optimizer, context-parallel, router, expert-parallel
                   and fault-tolerance sections) and the start-up log lines.

Applying it (each a function taking the plan; callers call them, `autocast.forward_context(plan)`:
the plan imports none of them):
- `tags.py`:        the marks left on modules (fp32 by name, frozen) and tied-weight groups;
- `by_name.py`:     `mark_fp32_by_name`: modules kept in fp32 by name, tied modules aligned;
- `freeze.py`:      parameter storage dtype, training.freeze, `refreeze` after TP;
- `lora.py`:        [lora]: adapters on frozen base Linears (NF4 for QLoRA), their init, the merge;
                    `lora_plan.py` is the plan's decision for it (what plan.py imports);
- `autocast.py`:    forward / backward contexts, fp32 islands, output cast (the autocast path);
- `fsdp.py`:        `MixedPrecisionPolicy` per `fully_shard` group, block input cast (the FSDP path);
- `comm_hooks.py`:  the DDP gradient compress hook (safe modules in reduce_dtype, on gloo and nccl);
- `reducers.py`:    TP's partial gradients, reduced once per step;
- `block_scaled.py`: block-scaled training: the rules naming the Linears (and grouped experts) a
                    recipe converts, the conversion (emulated, or to torchao's modules), the SR
                    seeding per step, the report's section and the audit's GEMM check;
- `scaler.py`:      fp16 loss scaling (`LossScaler`, `build_scaler`);
- `memory_spec.py`: the plan as the memory model's `PrecisionSpec`;
- `audit.py`:       one real step recorded against the plan's promises (mixed_precision.audit).

The low-bit formats (precision/lowbit/): fp8 through torchao (and its Linear conversion), MXFP8 /
NVFP4 quantization and the block-scaled recipe, the emulated block-scaled Linear and grouped experts,
the mapping to torchao's block-scaled modules, quantization-error measures, and the capability
probes. Of them the plan imports the probes, the recipe and the emulated Linear's class only.

A new capability lands as a decision in plan.py plus an applier module of its own.
"""

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.precision.comm_hooks import CompressHookState, compress_hook, install_comm_hook
from torchtitan_amp.precision.plan import PrecisionPlan, resolve_module_classes
from torchtitan_amp.precision.reducers import PartialGradReducer
from torchtitan_amp.precision.report import FP32_ISLANDS
from torchtitan_amp.precision.scaler import LossScaler

__all__ = [
    "FP32_ISLANDS",
    "CompressHookState",
    "LossScaler",
    "PartialGradReducer",
    "PrecisionError",
    "PrecisionPlan",
    "compress_hook",
    "dtype_name",
    "install_comm_hook",
    "resolve_module_classes",
]
