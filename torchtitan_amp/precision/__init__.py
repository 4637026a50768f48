"""Mixed precision: decided once from the job config (the plan), then applied per parallelism path.

Deciding (config -> plan, and what the plan answers and reports):
- `plan.py`:       `PrecisionPlan.from_config` and the checks it runs; the questions the rest of the
                   code asks (path, dtypes, `is_safe`, `fp32_modules`, `compute_dtype`, ...);
- `report.py`:     precision_report.json and the start-up log lines.

Applying it (each a function of the plan; `PrecisionPlan` keeps a thin method per entry point):
- `tags.py`:       marks left on modules (fp32 by name, frozen), `mark_fp32_by_name`;
- `freeze.py`:     parameter storage dtype, training.freeze;
- `autocast.py`:   forward / backward contexts, fp32 islands, output cast (the autocast path);
- `fsdp.py`:       `MixedPrecisionPolicy` per `fully_shard` group, block input cast (the FSDP path);
- `comm_hooks.py`: the DDP gradient compress hook (safe modules in reduce_dtype, on gloo and nccl);
- `reducers.py`:   TP's partial gradients, reduced once per step;
- `float8.py`:     fp8 Linear conversion as planned (torchtitan_amp/precision/float8.py does the torchao work);
- `scaler.py`:     fp16 loss scaling (`LossScaler`, `build_scaler`).

A new capability lands as a decision in plan.py plus an applier module of its own.
"""

# `dist` and `dtype_name` stay reachable here as they were from the single module (tests patch
# `precision.dist.all_reduce`, which is torch.distributed's own, the one comm_hooks calls).
import torch.distributed as dist  # noqa: F401

from torchtitan_amp.core.errors import PrecisionError
from torchtitan_amp.core.rules import dtype_name
from torchtitan_amp.precision.comm_hooks import CompressHookState, compress_hook, install_comm_hook
from torchtitan_amp.precision.plan import PrecisionPlan, resolve_module_classes
from torchtitan_amp.precision.reducers import PartialGradReducer
from torchtitan_amp.precision.report import FP32_ISLANDS
from torchtitan_amp.precision.scaler import LossScaler

__all__ = ["FP32_ISLANDS", "CompressHookState", "LossScaler", "PartialGradReducer", "PrecisionError",
           "PrecisionPlan", "compress_hook", "dtype_name", "install_comm_hook", "resolve_module_classes"]
