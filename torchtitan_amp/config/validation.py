"""The rules across fields that need no world size (those that do belong to `job.resolve`). What
one field allows alone (its type, choices and bounds) was checked as it was set (fields._set)."""

from __future__ import annotations

from torchtitan_amp.config.sections import JobConfig
from torchtitan_amp.core.errors import ConfigError
from torchtitan_amp.core.rules import flavor_names


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def validate(config: JobConfig) -> None:
    m = config.model
    # model.flavor's choices are every family's flavours; it must also belong to the chosen one.
    own = flavor_names(m.name)
    _require(m.flavor in own, f"'model.flavor' = {m.flavor!r} is not a flavour of model.name = {m.name!r}; "
             f"choose one of: {', '.join(repr(f) for f in own)}")
    v = config.validation
    _require(not v.sample_prompts or v.enable,
             "'validation.sample_prompts' are generated at every evaluation: set validation.enable = true")
    _require(config.checkpoint.enable or not config.checkpoint.last_save_hf,
             "'checkpoint.last_save_hf' converts the last checkpoint: it needs checkpoint.enable = true")
    ac = config.activation_checkpoint
    # Read only under mode = selective, so a stale value elsewhere is harmless.
    _require(
        ac.mode != "selective" or ac.selective_ac_option == "op" or ac.selective_ac_option.isdigit()
        and int(ac.selective_ac_option) >= 1,
        f"'activation_checkpoint.selective_ac_option' must be a positive integer or 'op', "
        f"got {ac.selective_ac_option!r}",
    )
    # Importability of lower_precision_safe_modules is checked by the precision plan, which owns
    # the meaning of those names; dtype combinations are checked there too.
    _require(not (config.mixed_precision.audit and config.compile.enable),
             "'mixed_precision.audit' records the eager model's ops; set compile.enable = false for the audit")
    _check_block_scaled(config)


def _check_block_scaled(config: JobConfig) -> None:
    """block_scaled against fp8 (both replace the same Linears), and a recipe option changed from its
    default under the other format (a dumped TOML holds every default: those pass)."""
    mp = config.mixed_precision
    _require(mp.block_scaled == "none" or mp.fp8 == "none",
             f"'mixed_precision.block_scaled' = '{mp.block_scaled}' and 'mixed_precision.fp8' = '{mp.fp8}' "
             "both convert the Linears: choose one")
    defaults = type(mp)()
    owner = {"nvfp4_weight_2d": "nvfp4", "nvfp4_rht": "nvfp4", "nvfp4_stochastic_rounding": "nvfp4",
             "mxfp8_scale_mode": "mxfp8"}
    for key, fmt in owner.items():
        _require(getattr(mp, key) == getattr(defaults, key) or mp.block_scaled == fmt,
                 f"'mixed_precision.{key}' = {getattr(mp, key)!r} belongs to the {fmt} recipe; this job has "
                 f"mixed_precision.block_scaled = '{mp.block_scaled}'")
