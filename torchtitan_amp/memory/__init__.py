"""Analytic per-rank memory and communication of a training layout: pure functions, no torch.

Used by the fake-backend dry run (`torchtitan_amp/train/dry_run.py`, for the terms a meta model cannot
show: activations, TP and PP traffic), by the layout planner (`torchtitan_amp/tools/plan_layout.py`, for
everything) and by the memory estimate script. Every number is bytes on one rank for one
optimizer step, computed from shapes alone; the formulas are stated next to the code and in
docs/scaling.md. tests/test_dry_run.py checks the parameter, gradient and optimizer terms and
every traffic term here against real multi-process runs (exact, per rank, by dtype) and the
per-layer activation term against the tensors autograd saves (exact).

The model family's terms are apart from the shared accounting:
- `llama.py`:       Llama 3's shapes (`ModelDims`), parameters with their TP sharding
                    (`param_specs`) and activation bytes per token (`activation_terms`);
- `deepseek_v3.py`: DeepSeek-V3's (`MLADims`): the MoE family's with MLA's parameters in place of
                    grouped-query attention's;
- `gpt_oss.py`:     gpt-oss's (`GptOssDims`): the MoE family's with biases and attention sinks;
- `moe.py`:         the MoE family's (`MoEDims`): routers, experts split by EP, total vs active
                    parameters, routed-token activations, the EP all-to-all;
- `specs.py`:       what the accounting is told: `PrecisionSpec`, `Layout`, `Stage`, `ParamSpec`,
                    `ActivationTerms`;
- `sizes.py`:       bytes by dtype (`ByDtype`, `add_bytes`, `merge`, ...) and their formatting;
- `stages.py`:      pipeline stages, schedule passes, microbatches in flight;
- `shards.py`:      TP and FSDP2 shard sizes;
- `state.py`:       parameters, gradients and AdamW state (`state_bytes`);
- `fsdp.py`:        FSDP2 groups, their traffic, calls and transient buffers;
- `collectives.py`: data-parallel, TP, CP and PP traffic, gradient collectives, `comm` (all of it);
- `activations.py`: peak activations per AC mode (`activation_bytes`);
- `totals.py`:      the whole estimate (`estimate`, `MemoryEstimate`, `transient_bytes`).
Every name is re-exported here: callers use `memory.X`.

Conventions
- A collective's volume is the size of the full tensor it produces or consumes: an all-gather's
  output, a reduce-scatter's input, an all-reduce's buffer, a send's tensor. (A ring moves
  (n-1)/n of that per rank, twice for an all-reduce: the planner's cost model applies that.)
- Sizes are split the way torch splits them: `torch.chunk` rows (ceil(n/k) per rank, the last
  ranks short or empty) for TP and FSDP, and FSDP2 pads each parameter's dim 0 to a multiple of
  the shard degree for its collectives.
- dtypes are names: "float32", "bfloat16", "float16".
"""

# DTYPE_BYTES, SHORT, STAGES_PER_RANK and stage_layer_ranges are also used as memory.X by callers.
from torchtitan_amp.core.rules import DTYPE_BYTES, SHORT, STAGES_PER_RANK, stage_layer_ranges
from torchtitan_amp.memory.activations import ActivationEstimate, activation_bytes
from torchtitan_amp.memory.collectives import (
    comm,
    cp_comm,
    ddp_comm,
    dp_comm,
    grad_comm,
    pp_comm,
    recomputed_blocks,
    tp_comm,
    tp_partial_grad_comm,
)
from torchtitan_amp.memory.deepseek_v3 import MLADims
from torchtitan_amp.memory.fsdp import (
    FsdpGroup,
    fsdp_calls,
    fsdp_comm,
    fsdp_gathers_per_step,
    fsdp_groups,
    fsdp_transient,
)
from torchtitan_amp.memory.gpt_oss import GptOssDims
from torchtitan_amp.memory.llama import ModelDims, activation_terms, param_specs
from torchtitan_amp.memory.moe import MoEDims
from torchtitan_amp.memory.shards import chunk_size, fsdp_local_numel, fsdp_padded_numel, tp_local_shape
from torchtitan_amp.memory.sizes import ByDtype, add_bytes, fmt_by_dtype, fmt_bytes, merge, sum_bytes
from torchtitan_amp.memory.specs import ActivationTerms, Layout, ParamSpec, PrecisionSpec, Stage
from torchtitan_amp.memory.stages import (
    in_flight_at_peak,
    in_flight_microbatches,
    interleaved_order,
    rank_order,
    rank_stages,
    schedule_ops,
    stage_ops,
)
from torchtitan_amp.memory.state import ADAMW_STEP_BYTES, StateBytes, diloco_bytes, peak_with_diloco, state_bytes
from torchtitan_amp.memory.totals import MemoryEstimate, estimate, transient_bytes

__all__ = [
    "ADAMW_STEP_BYTES",
    "DTYPE_BYTES",
    "SHORT",
    "STAGES_PER_RANK",
    "ActivationEstimate",
    "ActivationTerms",
    "ByDtype",
    "FsdpGroup",
    "Layout",
    "MemoryEstimate",
    "ModelDims",
    "MoEDims",
    "GptOssDims",
    "MLADims",
    "ParamSpec",
    "PrecisionSpec",
    "Stage",
    "StateBytes",
    "activation_bytes",
    "activation_terms",
    "add_bytes",
    "chunk_size",
    "diloco_bytes",
    "peak_with_diloco",
    "comm",
    "cp_comm",
    "ddp_comm",
    "dp_comm",
    "estimate",
    "fmt_by_dtype",
    "fmt_bytes",
    "fsdp_calls",
    "fsdp_comm",
    "fsdp_gathers_per_step",
    "fsdp_groups",
    "fsdp_local_numel",
    "fsdp_padded_numel",
    "fsdp_transient",
    "grad_comm",
    "in_flight_at_peak",
    "in_flight_microbatches",
    "interleaved_order",
    "merge",
    "param_specs",
    "pp_comm",
    "rank_order",
    "rank_stages",
    "recomputed_blocks",
    "schedule_ops",
    "stage_layer_ranges",
    "stage_ops",
    "state_bytes",
    "sum_bytes",
    "tp_comm",
    "tp_local_shape",
    "tp_partial_grad_comm",
    "transient_bytes",
]
