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
# Model families and their flavours (their shapes live in models/<family>/, which needs torch)

# The built-in families and flavours of models.FAMILIES. model.name / model.flavor are checked
# against the registry itself once it is imported (a tool or test may register a family or a
# flavour at run time), against this table before (nothing can have been registered then).
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama3": ("debugmodel", "debugmodel_h64", "debugmodel_tiny", "llama3_8b", "llama3_70b", "llama3_405b",
               "llama3_2_1b", "llama3_2_3b", "llama3_0_8b", "llama3_0_70b"),
    "moe": ("debugmodel_moe", "debugmodel_moe_sigmoid", "debugmodel_moe_aux", "debugmodel_qwen3", "qwen3_30b_a3b",
            "deepseek_v3_16b"),
}
FLAVORS: tuple[str, ...] = FAMILIES["llama3"]
_MODELS_PACKAGE = "torchtitan_amp.models"


def _family_flavors() -> dict[str, tuple[str, ...]]:
    """family -> flavour names: models.FAMILIES' if that package is imported, else the built-in
    table, without importing torch (config parsing and --help stay torch-free)."""
    registry = getattr(sys.modules.get(_MODELS_PACKAGE), "FAMILIES", None)
    if registry is None:
        return FAMILIES
    return {name: tuple(family.flavors) for name, family in registry.items()}


def family_names() -> tuple[str, ...]:
    """The families model.name accepts."""
    return tuple(_family_flavors())


def flavor_names(family: str | None = None) -> tuple[str, ...]:
    """The flavours of `family` (e.g. gpu_checks registers llama3_8b_2l into llama3's); None: every
    family's, in registry order without repeats (what model.flavor may hold before model.name is
    known; config.validate then checks it against the chosen family's)."""
    table = _family_flavors()
    if family is not None:
        return table.get(family, ())
    return tuple(dict.fromkeys(name for names in table.values() for name in names))


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

