"""The rules across fields that need no world size (those that do belong to `job.resolve`). What
one field allows alone (its type, choices and bounds) was checked as it was set (fields._set)."""

from __future__ import annotations

import re

from torchtitan_amp.config.hardware_sections import FaultToleranceConfig
from torchtitan_amp.config.sections import JobConfig
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.core.rules import flavor_names


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    m = config.model
    # model.flavor's choices are every family's flavors; it must also belong to the chosen one.
    own = flavor_names(m.name)
    _require(
        m.flavor in own,
        f"'model.flavor' = {m.flavor!r} is not a flavor of model.name = {m.name!r}; "
        f"choose one of: {', '.join(repr(f) for f in own)}",
    )
    v = config.validation
    _require(
        not v.sample_prompts or v.enable,
        "'validation.sample_prompts' are generated at every evaluation: set validation.enable = true",
    )
    _require(
        config.checkpoint.enable or not config.checkpoint.last_save_hf,
        "'checkpoint.last_save_hf' converts the last checkpoint: it needs checkpoint.enable = true",
    )
    ac = config.activation_checkpoint
    # Read only under mode = selective, so a stale value elsewhere is harmless.
    _require(
        ac.mode != "selective"
        or ac.selective_ac_option == "op"
        or ac.selective_ac_option.isdigit()
        and int(ac.selective_ac_option) >= 1,
        f"'activation_checkpoint.selective_ac_option' must be a positive integer or 'op', "
        f"got {ac.selective_ac_option!r}",
    )
    # Importability of lower_precision_safe_modules is checked by the precision plan, which owns
    # the meaning of those names; dtype combinations are checked there too.
    _require(
        not (config.mixed_precision.audit and config.compile.enable),
        "'mixed_precision.audit' records the eager model's ops; set compile.enable = false for the audit",
    )
    validate_fault_tolerance(config)
    _check_block_scaled(config)


# What a replica group under torchft may not combine with: torchft owns the replicate dimension,
# and the cross-group all-reduce covers FSDP's and plain gradients only.
_FT_EXCLUSIVE = (
    (
        "parallelism.data_parallel_replicate_degree",
        lambda c: c.parallelism.data_parallel_replicate_degree,
        "torchft owns the replicate dimension: keep it 1 and set fault_tolerance.group_size",
    ),
    (
        "parallelism.tensor_parallel_degree",
        lambda c: c.parallelism.tensor_parallel_degree,
        "not supported with fault_tolerance.enable: use FSDP inside a group",
    ),
    (
        "parallelism.pipeline_parallel_degree",
        lambda c: c.parallelism.pipeline_parallel_degree,
        "not supported with fault_tolerance.enable: use FSDP inside a group",
    ),
    (
        "parallelism.context_parallel_degree",
        lambda c: c.parallelism.context_parallel_degree,
        "not supported with fault_tolerance.enable: use FSDP inside a group",
    ),
    (
        "parallelism.expert_parallel_degree",
        lambda c: c.parallelism.expert_parallel_degree,
        "not supported with fault_tolerance.enable: use FSDP inside a group",
    ),
)


# torchft's lighthouse address: a URL with a scheme, a host and a port (torchft's client needs all three;
# without them it fails only after its connect timeout).
_LIGHTHOUSE_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}/?$")


def lighthouse_problem(address: str, source: str) -> str | None:
    """Why `address` (named `source` in the message) is not a lighthouse URL, or None."""
    if _LIGHTHOUSE_URL.match(address):
        return None
    return f"{source} = {address!r} must be a URL http://HOST:PORT (torchft's lighthouse, e.g. http://localhost:29510)"


def validate_fault_tolerance(config: JobConfig) -> None:
    """The rules of [fault_tolerance] across fields, when it is on (and the one setting that would
    otherwise be silently ignored when it is off)."""
    ft: FaultToleranceConfig = config.fault_tolerance
    _require(
        ft.enable or ft.semi_sync_method == "none",
        f"'fault_tolerance.semi_sync_method' = '{ft.semi_sync_method}' needs fault_tolerance.enable = true "
        "(and the replica groups' settings: docs/fault_tolerance.md); without it the job trains as one group",
    )
    if not ft.enable:
        return
    problem = lighthouse_problem(ft.lighthouse, "'fault_tolerance.lighthouse'") if ft.lighthouse else None
    _require(problem is None, problem or "")
    _require(
        ft.group_size >= 1,
        "'fault_tolerance.group_size' must be the number of replica groups (>= 1) when fault_tolerance.enable = true",
    )
    _require(
        ft.replica_id < ft.group_size,
        f"'fault_tolerance.replica_id' = {ft.replica_id} must be below fault_tolerance.group_size = {ft.group_size}",
    )
    _require(
        ft.min_replica_size <= ft.group_size,
        f"'fault_tolerance.min_replica_size' = {ft.min_replica_size} "
        f"is more than the fault_tolerance.group_size = {ft.group_size} groups there are",
    )
    _check_diloco_fields(ft)
    for name, value, why in _FT_EXCLUSIVE:
        _require(value(config) == 1, f"'{name}' = {value(config)}: {why}")
    # The group saving the shared checkpoint can change between saves (checkpoint/replicas.py): a
    # background upload of one group could meet the next group's save of the same folder.
    _require(
        config.checkpoint.async_mode == "disabled",
        f"'checkpoint.async_mode' = '{config.checkpoint.async_mode}' is not supported with "
        "fault_tolerance.enable: use 'disabled'",
    )
    _require(
        not config.checkpoint.create_seed_checkpoint,
        "'checkpoint.create_seed_checkpoint' runs without fault_tolerance.enable (one process, no replica groups)",
    )
    # One group saves the shared checkpoint: only at a sync is its local model every group's (train/diloco.py).
    c = config.checkpoint
    _require(
        not (c.enable and ft.semi_sync_method == "diloco" and c.interval % ft.sync_steps),
        f"'checkpoint.interval' = {c.interval} must be a multiple of fault_tolerance.sync_steps = "
        f"{ft.sync_steps} under semi_sync_method = 'diloco': checkpoints are saved at syncs, where "
        "every replica group holds the same weights",
    )


# Read only under semi_sync_method = 'diloco': set elsewhere, they would silently do nothing.
_DILOCO_ONLY = ("sync_steps", "outer_lr", "outer_momentum", "pseudo_gradient_dtype")


def _check_diloco_fields(ft: FaultToleranceConfig) -> None:
    """A DiLoCo setting changed from its default while the groups average gradients every step (a
    dumped TOML holds every default: those pass)."""
    defaults = type(ft)()
    for key in _DILOCO_ONLY:
        _require(
            ft.semi_sync_method == "diloco" or getattr(ft, key) == getattr(defaults, key),
            f"'fault_tolerance.{key}' = {getattr(ft, key)!r} applies to semi_sync_method = 'diloco'; this "
            f"job has fault_tolerance.semi_sync_method = '{ft.semi_sync_method}'",
        )


def _check_block_scaled(config: JobConfig) -> None:
    """block_scaled against fp8 (both replace the same Linears), and a recipe option changed from its
    default under the other format (a dumped TOML holds every default: those pass)."""
    mp = config.mixed_precision
    _require(
        mp.block_scaled == "none" or mp.fp8 == "none",
        f"'mixed_precision.block_scaled' = '{mp.block_scaled}' and 'mixed_precision.fp8' = '{mp.fp8}' "
        "both convert the Linears: choose one",
    )
    _require(
        not mp.block_scaled_experts or mp.block_scaled != "none",
        "'mixed_precision.block_scaled_experts' = true needs mixed_precision.block_scaled = 'mxfp8' or 'nvfp4'",
    )
    defaults = type(mp)()
    owner = {
        "nvfp4_weight_2d": "nvfp4",
        "nvfp4_rht": "nvfp4",
        "nvfp4_stochastic_rounding": "nvfp4",
        "mxfp8_scale_mode": "mxfp8",
    }
    for key, fmt in owner.items():
        _require(
            getattr(mp, key) == getattr(defaults, key) or mp.block_scaled == fmt,
            f"'mixed_precision.{key}' = {getattr(mp, key)!r} belongs to the {fmt} recipe; this job has "
            f"mixed_precision.block_scaled = '{mp.block_scaled}'",
        )
