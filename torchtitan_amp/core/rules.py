"""Rules that the runtime and the analytic model (memory/, plan_layout) must agree on, written
once and importing no torch: dtype names and sizes, pipeline stage split and placement, the FSDP
reshard-after-forward policy, model flavor names.
"""

from __future__ import annotations

import math
import sys
import typing
from collections.abc import Iterable
from typing import Literal

# ---------------------------------------------------------------------------------------------
# Dtypes, by the name torch gives them without the "torch." prefix

DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = typing.get_args(DtypeName)
# float8_e4m3fn: what torchao's fp8 all-gather sends and holds unsharded (memory.FsdpGroup).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


def dtype_name(dtype: object) -> str:
    """ "bfloat16" for torch.bfloat16 (any object whose str() is "torch.<name>"; no torch import)."""
    return str(dtype).removeprefix("torch.")


def short_name(dtype: object) -> str:
    """ "bf16" for torch.bfloat16 or "bfloat16"."""
    name = dtype_name(dtype)
    return SHORT.get(name, name)


# ---------------------------------------------------------------------------------------------
# Model families and their flavors (their shapes live in models/<family>/, which needs torch)

# The built-in families and flavors of models.FAMILIES. model.name / model.flavor are checked
# against the registry itself once it is imported (a tool or test may register a family or a
# flavor at run time), against this table before (nothing can have been registered then).
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama3": (
        "debugmodel",
        "debugmodel_h64",
        "debugmodel_tiny",
        "llama3_8b",
        "llama3_70b",
        "llama3_405b",
        "llama3_2_1b",
        "llama3_2_3b",
        "llama3_0_8b",
        "llama3_0_70b",
    ),
    "moe": (
        "debugmodel_moe",
        "debugmodel_moe_sigmoid",
        "debugmodel_moe_aux",
        "debugmodel_qwen3",
        "qwen3_30b_a3b",
        "moe_16b_gqa",
    ),
    "qwen3": ("debugmodel", "qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "qwen3_14b", "qwen3_32b"),
    "deepseek_v3": ("debugmodel", "deepseek_v3_16b", "deepseek_v3_671b", "deepseek_v3_671b_no_mtp", "debugmodel_mtp"),
    "gpt_oss": ("debugmodel", "gpt_oss_20b", "gpt_oss_120b"),
}
FLAVORS: tuple[str, ...] = FAMILIES["llama3"]
_MODELS_PACKAGE = "torchtitan_amp.models"


def _family_flavors() -> dict[str, tuple[str, ...]]:
    """family -> flavor names: models.FAMILIES' if that package is imported, else the built-in
    table, without importing torch (config parsing and --help stay torch-free)."""
    registry = getattr(sys.modules.get(_MODELS_PACKAGE), "FAMILIES", None)
    if registry is None:
        return FAMILIES
    return {name: tuple(family.flavors) for name, family in registry.items()}


def family_names() -> tuple[str, ...]:
    """The families model.name accepts."""
    return tuple(_family_flavors())


def flavor_names(family: str | None = None) -> tuple[str, ...]:
    """The flavors of `family` (e.g. a GPU check registers llama3_8b_2l into llama3's); None: every
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
    """The layers of each pipeline stage: after the given split points, else an even split.

    Args:
        n_layers: the model's number of transformer layers.
        num_stages: the number of pipeline stages (used when `split_points` is empty).
        split_points: the first layer of each of stages 1, 2, ...; empty for an even split
            (even_stage_starts).
    """
    starts = list(split_points)
    starts = [0] + starts if starts else even_stage_starts(n_layers, num_stages)
    ends = starts[1:] + [n_layers]
    return [range(s, e) for s, e in zip(starts, ends)]


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages pipeline rank `pp_rank` of `pp` holds under `schedule` (one per rank, or several
    interleaved: rank r holds r, r + pp, ...).

    Args:
        pp_rank: this rank's position in the pipeline, 0 .. pp - 1.
        pp: the pipeline-parallel degree.
        schedule: the pipeline schedule (a key of STAGES_PER_RANK: "GPipe", "1F1B", "Interleaved1F1B").
    """
    return [pp_rank + i * pp for i in range(STAGES_PER_RANK[schedule])]


# ---------------------------------------------------------------------------------------------
# FSDP


ReshardPolicy = Literal["default", "always", "never"]
# When a pipeline stage under FSDP reduce-scatters its gradients (parallelism.pipeline_fsdp_reduce).
PipelineFsdpReduce = Literal["per_step", "per_microbatch"]


def reshard_after_forward(policy: ReshardPolicy, is_last: bool, pp_enabled: bool) -> bool:
    """Whether an FSDP group frees its gathered parameters after forward.

    "default" follows torchtitan: yes, except the last group (backward needs it at once), and no
    group at all under pipeline parallel, where each stage runs forward once per microbatch and
    resharding would all-gather again every time.

    Args:
        policy: parallelism.fsdp_reshard_after_forward: "default", "always" or "never".
        is_last: whether the group is the last one to run forward (the model's final norm and output).
        pp_enabled: whether pipeline parallel is on.
    """
    if policy == "always":
        return True
    if policy == "never":
        return False
    return not is_last and not pp_enabled


# ---------------------------------------------------------------------------------------------
# Attention kernels: which SDPA kernel runs a model's attention call (torch 2.11-2.13), told by
# the call's device type, dtype, head size and mask kind. The model picks how it hands keys and
# values from it (grouped or repeated), config validation refuses context parallel where CUDA
# would build a mask, and the memory model counts what the kernel saves.
#
# On CUDA the model runs its attention under SDPA_PRIORITY (models/llama3/model.py, through
# torch.nn.attention.sdpa_kernel with set_priority): flash, then efficient, then math, cuDNN
# attention off. Left alone, torch moves cuDNN attention to the front of its order on sm90 and
# sm100 (sdp_utils.cpp, check_prefer_cudnn_attention: the cuDNN torch 2.11's CUDA 13 wheels bundle
# qualifies), and a non-grouped 16-bit causal call would then run cuDNN, not what this rule, the
# memory model and the selective-AC save list assume; pinned, the rule is what runs.

# "causal": a causal flag, or torch's lower-right causal bias (context parallel's query chunks
# against a prefix of the window's keys); "mask": an explicit bool mask (block_causal).
AttentionMask = Literal["causal", "mask"]
_HALF = ("bfloat16", "float16")
# The SDPA backends the model's attention may run on CUDA, in priority order (SDPBackend names).
SDPA_PRIORITY = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
# Flash runs on compute capability 8.0 up to 12.1; on 8.6-8.9 and 12.0-12.1 (consumer parts) it
# refuses training with head_dim in (192, 224] (sdp_utils.cpp,
# check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120).
_FLASH_CAPABILITY = ((8, 0), (12, 1))
_FLASH_NO_TRAINING_CAPABILITY = (((8, 6), (8, 9)), ((12, 0), (12, 1)))
_FLASH_NO_TRAINING_HEAD_DIM = (192, 224)


def _flash_runs(dtype: str, head_dim: int, mask: str, capability: tuple[int, int] | None, training: bool) -> bool:
    if not (mask == "causal" and dtype in _HALF and head_dim <= 256):
        return False
    if capability is None:  # not asked: a data-centre part (sm80, sm90, sm100)
        return True
    low, high = _FLASH_CAPABILITY
    if not low <= tuple(capability) <= high:
        return False
    lo_dim, hi_dim = _FLASH_NO_TRAINING_HEAD_DIM
    consumer = any(a <= tuple(capability) <= b for a, b in _FLASH_NO_TRAINING_CAPABILITY)
    return not (training and consumer and lo_dim < head_dim <= hi_dim)


def attention_kernel(
    device: str, dtype: str, head_dim: int, mask: str, capability: tuple[int, int] | None = None, training: bool = True
) -> str:
    """The SDPA kernel a call runs under SDPA_PRIORITY, keys and values handed as
    `takes_grouped_kv` says:

    cuda  "flash" for "causal" in bfloat16/float16 with head_dim <= 256 (it rejects explicit
          masks; a head_dim not a multiple of 8 is padded, a copy of q, k and v) on compute
          capability 8.0-12.1, except training with head_dim in (192, 224] on 8.6-8.9 and
          12.0-12.1; else "efficient" (float32 too; head_dim a multiple of 8 in 16 bits, of 4 in
          float32, on sm80 and newer), which takes the lower-right bias as a flag and a bool mask
          as an additive copy; else "math": the scores materialised (and the lower-right bias as
          a mask tensor).
    cpu   "cpu_flash" (any float dtype, any head_dim, masks taken); the lower-right bias is
          built as an [n, end] mask per call by design (torch.nn.attention.bias).
    other "unknown" (nothing is assumed about it).

    torch's own checks: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (flash: 16-bit,
    head_dim <= 256, grouped heads taken; efficient: check_batch_size_and_num_heads_dense<false>,
    no grouped heads) and torch/nn/attention/bias.py (the lower-right dispatch).

    Args:
        device: the device type the call runs on ("cuda", "cpu", or another).
        dtype: the dtype name of q, k and v ("bfloat16", "float16", "float32", "float64").
        head_dim: the size of one attention head.
        mask: the mask kind (AttentionMask): "causal" (a causal flag or the lower-right causal bias)
            or "mask" (an explicit bool mask).
        capability: the CUDA compute capability (major, minor); None when not asked (the memory model,
            a dry run) means a data-centre part (8.0, 9.0, 10.0).
        training: whether the inputs require gradients.
    """
    if device == "cpu":
        return "cpu_flash"
    if device != "cuda":
        return "unknown"
    if _flash_runs(dtype, head_dim, mask, capability, training):
        return "flash"
    alignment = 8 if dtype in _HALF else 4
    if dtype in (*_HALF, "float32") and head_dim % alignment == 0:
        return "efficient"
    return "math"


def takes_grouped_kv(
    device: str, dtype: str, head_dim: int, mask: str, capability: tuple[int, int] | None = None, training: bool = True
) -> bool:
    """Whether attention is handed the kv_heads keys and values themselves (SDPA's enable_gqa)
    rather than each repeated to the query heads (repeat_kv, a copy autograd saves).

    CUDA's flash kernel takes grouped heads and sums dK/dV over a group from per-head 16-bit
    gradients, as repeat_kv's backward does; the efficient kernel refuses them (with enable_gqa
    SDPA would fall to math). CPU's flash kernel takes them, bitwise as repeated in float32 and
    float64; in 16 bits its backward accumulates dK/dV over a group in 16 bits (measured, torch
    2.13: 1.5x the error of repeat_kv at 8 query heads per kv head, 2.6x at 32), so those repeat.

    Args:
        device: the device type the call runs on ("cuda", "cpu", or another).
        dtype: the dtype name of q, k and v.
        head_dim: the size of one attention head.
        mask: the mask kind: "causal" or "mask" (attention_kernel).
        capability: the CUDA compute capability (major, minor); None: a data-centre part.
        training: whether the inputs require gradients.
    """
    kernel = attention_kernel(device, dtype, head_dim, mask, capability, training)
    return kernel == "flash" or (kernel == "cpu_flash" and dtype in ("float32", "float64"))


def materialises_causal_mask(
    device: str, dtype: str, head_dim: int, capability: tuple[int, int] | None = None, training: bool = True
) -> bool:
    """Whether a lower-right causal bias becomes a mask tensor: always on CPU (by design, one
    [n, end] mask per chunk shared by the batch and heads), on CUDA only where neither flash nor
    efficient takes the call (the math fallback: a mask and the whole score matrix).

    Args:
        device: the device type the call runs on ("cuda", "cpu", or another).
        dtype: the dtype name of q, k and v.
        head_dim: the size of one attention head.
        capability: the CUDA compute capability (major, minor); None: a data-centre part.
        training: whether the inputs require gradients.
    """
    return attention_kernel(device, dtype, head_dim, "causal", capability, training) in ("cpu_flash", "math")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama 3 SwiGLU width: 2/3 of 4*dim (keeps the param count of a 4*dim two-matrix MLP), times the
    multiplier, rounded up to multiple_of.

    Args:
        dim: the model width.
        multiple_of: the width is rounded up to a multiple of this.
        ffn_dim_multiplier: a factor on the width before rounding; None for 1.
    """
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)
