"""Rules that the runtime and the analytic model (memory/, plan_layout) must agree on, written
once and importing no torch: dtype names and sizes, pipeline stage split and placement, the FSDP
reshard-after-forward policy, model flavour names.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Iterable
from typing import Literal

# ---------------------------------------------------------------------------------------------
# Dtypes, by the name torch gives them without the "torch." prefix

DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(DtypeName)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype: object) -> str:
    """"bfloat16" for torch.bfloat16 (any object whose str() is "torch.<name>"; no torch import)."""
    return str(dtype).removeprefix("torch.")


def short_name(dtype: object) -> str:
    """"bf16" for torch.bfloat16 or "bfloat16"."""
    name = dtype_name(dtype)
    return SHORT.get(name, name)

# ---------------------------------------------------------------------------------------------
# Model flavours (their shapes live in models/llama.py, which needs torch)

# The built-in entries of models/llama.py's LLAMA3_FLAVORS. model.flavor is checked against the
# registry itself (flavor_names), not this list: a tool may register a shape at run time.
FLAVORS: tuple[str, ...] = ("debugmodel", "debugmodel_h64", "llama3_8b", "llama3_70b", "llama3_405b")
_LLAMA_MODULE = "torchtitan_amp.models.llama"


def flavor_names() -> tuple[str, ...]:
    """The flavours model.flavor accepts: the names in models/llama.py's LLAMA3_FLAVORS, which a
    tool may extend at run time (gpu_checks registers llama3_8b_2l). Until that module is imported
    nothing can have been registered, so the built-in names answer then, without importing torch
    (config parsing and --help stay torch-free)."""
    registry = getattr(sys.modules.get(_LLAMA_MODULE), "LLAMA3_FLAVORS", None)
    return tuple(registry) if registry is not None else FLAVORS


# ---------------------------------------------------------------------------------------------
# Pipeline stages

# Stages each rank holds per schedule; looped placement: pp rank r holds stages r, r + pp, ...
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B"]
STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}
PP_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


def even_stage_starts(n_layers: int, num_stages: int) -> list[int]:
    """First layer of each stage of an even split; earlier stages take the remainder (the last
    stage also carries the output head)."""
    base, extra = divmod(n_layers, num_stages)
    sizes = [base + (i < extra) for i in range(num_stages)]
    return [sum(sizes[:i]) for i in range(num_stages)]


def stage_layer_ranges(n_layers: int, num_stages: int, split_points: Iterable[int] = ()) -> list[range]:
    """Layers of each stage: after the given split points (first layers of stages 1..), else even."""
    starts = list(split_points)
    starts = [0] + starts if starts else even_stage_starts(n_layers, num_stages)
    ends = starts[1:] + [n_layers]
    return [range(s, e) for s, e in zip(starts, ends)]


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` of `pp` holds under `schedule`."""
    return [pp_rank + i * pp for i in range(STAGES_PER_RANK[schedule])]


# ---------------------------------------------------------------------------------------------
# FSDP


ReshardPolicy = Literal["default", "always", "never"]


def reshard_after_forward(policy: ReshardPolicy, is_last: bool, pp_enabled: bool) -> bool:
    """Whether an FSDP group frees its gathered parameters after forward.

    "default" follows torchtitan: yes, except the last group (backward needs it at once), and no
    group at all under pipeline parallel, where each stage runs forward once per microbatch and
    resharding would all-gather again every time.
    """
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not is_last and not pp_enabled

