"""Resolving a job config: defaults, then the TOML file, then CLI overrides (CLI > TOML > defaults),
torchtitan's aliases mapped onto their canonical fields, then the parse-time checks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torchtitan_amp.config.fields import (
    _AUTO,
    _FALSE,
    _TRUE,
    _check_known,
    _field_types,
    _from_cli,
    _from_toml,
    _is_flag,
    _set,
)
from torchtitan_amp.config.sections import JobConfig
from torchtitan_amp.config.validation import validate
from torchtitan_amp.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file '{path}' is not UTF-8 text") from None


def apply_toml(config: JobConfig, data: dict[str, Any]) -> None:
    for section, values in data.items():
        _check_known(section, None)
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' must be a TOML table ([{section}])")
        types_ = _field_types(section)
        for key, value in values.items():
            _check_known(section, key)
            _set(config, section, key, _from_toml(f"{section}.{key}", types_[key], value), "toml")


def _is_option(arg: str) -> bool:
    """`--x...` is the next option, not a value (negative numbers have one dash; a value that
    really starts with `--` can be given as --section.key=--value)."""
    return arg.startswith("--") and len(arg) > 2


def parse_cli(argv: list[str]) -> list[tuple[str, str, str]]:
    """Split argv into (section, key, raw value) triples; booleans may be bare flags."""
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument '{arg}': use --section.key value (see --help)")
        name, eq, inline = arg[2:].partition("=")
        negated = name.startswith("no-")
        if negated:
            name = name[3:]
        section, _, key = name.partition(".")
        _check_known(section, key)
        tp = _field_types(section)[key]
        if negated:
            if not _is_flag(tp) or eq:
                raise ConfigError(f"'--no-{name}' only applies to boolean fields without a value")
            out.append((section, key, "false"))
        elif eq:
            out.append((section, key, inline))
        elif _is_flag(tp) and (i + 1 == len(argv) or argv[i + 1].lower() not in _TRUE + _FALSE + (_AUTO,)):
            out.append((section, key, "true"))
        elif i + 1 < len(argv) and not _is_option(argv[i + 1]):
            i += 1
            out.append((section, key, argv[i]))
        else:
            raise ConfigError(f"'--{name}' needs a value")
        i += 1
    return out


def load_config(argv: list[str]) -> JobConfig:
    """Resolve defaults, then the TOML named by --job.config_file, then CLI overrides."""
    overrides = parse_cli(argv)
    config = JobConfig()
    # The last --job.config_file wins, like every other repeated override.
    config_file = next((v for s, k, v in reversed(overrides) if (s, k) == ("job", "config_file")), "")
    if config_file:
        apply_toml(config, load_toml(config_file))
    for section, key, raw in overrides:
        name = f"{section}.{key}"
        _set(config, section, key, _from_cli(name, _field_types(section)[key], raw), "cli")
    _resolve_aliases(config)
    validate(config)
    return config


def _resolve_aliases(config: JobConfig) -> None:
    """Map torchtitan's spellings onto mixed_precision.*: precedence decides between sources,
    and both spellings set differently in the same source (TOML or CLI) is an error."""
    pairs = (
        ("training.mixed_precision_param", "mixed_precision.param_dtype"),
        ("training.mixed_precision_reduce", "mixed_precision.reduce_dtype"),
    )
    rank = {"toml": 1, "cli": 2}
    for alias, canonical in pairs:
        a_sec, a_key = alias.split(".")
        c_sec, c_key = canonical.split(".")
        alias_value = getattr(getattr(config, a_sec), a_key)
        if not alias_value:
            continue
        canonical_value = getattr(getattr(config, c_sec), c_key)
        alias_rank = rank[config.sources.get(alias, "cli")]
        canonical_rank = rank.get(config.sources.get(canonical, ""), 0)
        if canonical_rank == alias_rank and canonical_value != alias_value:
            where = "on the command line" if alias_rank == rank["cli"] else "in the config file"
            raise ConfigError(
                f"'{alias}' = {alias_value!r} conflicts with '{canonical}' = {canonical_value!r} "
                f"{where}; set only one of them"
            )
        if alias_rank > canonical_rank:
            setattr(getattr(config, c_sec), c_key, alias_value)
            config.sources[canonical] = config.sources[alias]
        # Mirror the winner so the resolved config (--job.print_config) is self-consistent.
        setattr(getattr(config, a_sec), a_key, getattr(getattr(config, c_sec), c_key))
