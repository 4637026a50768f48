"""What the schema allows: section and key lookup with suggestions, the allowed values and bounds
of a field, typing a value from TOML or from the command line into the field's type, and the one
check of a value against its field as it is set."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Any, Literal

from torchtitan_amp.config.bounds import Bounds
from torchtitan_amp.config.option import _AUTO, BoolOrAuto
from torchtitan_amp.config.sections import MOVED_FIELDS, JobConfig, section_names
from torchtitan_amp.core.errors import ConfigError


def _section_type(section: str) -> type:
    return typing.get_type_hints(JobConfig)[section]


@functools.cache
def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(_section_type(section))


def _suggest(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _check_known(section: str, key: str | None) -> None:
    sections = section_names()
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'{_suggest(section, sections)} (sections: {', '.join(sections)})"
        )
    if key is not None:
        keys = list(_field_types(section))
        if key not in keys:
            moved = MOVED_FIELDS.get(f"{section}.{key}")
            if moved is not None:
                raise ConfigError(
                    f"unknown config key '{section}.{key}': it moved to '{moved}' ([{moved.partition('.')[0]}])"
                )
            dotted = [f"{section}.{k}" for k in keys]
            raise ConfigError(f"unknown config key '{section}.{key}'{_suggest(f'{section}.{key}', dotted)}")


def choices_of(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a field's type: a Literal's, or true/false/"auto"."""
    if tp == BoolOrAuto:
        return (True, False, _AUTO)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def _field(section: str, key: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(_section_type(section)) if f.name == key)


def field_choices(section: str, key: str) -> tuple[Any, ...] | None:
    """The allowed values of `section.key` now: its `choices` callable's, else its type's."""
    choices = _field(section, key).metadata.get("choices")
    return tuple(choices()) if choices is not None else choices_of(_field_types(section)[key])


def field_bounds(section: str, key: str) -> Bounds | None:
    """What a value of `section.key` must be beyond its type and choices (bounds.py), if anything."""
    return _field(section, key).metadata.get("bounds")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "a string"
    if tp == BoolOrAuto:
        return 'true, false or "auto"'
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(
        tp, "a list of strings"
    )


def _is_flag(tp: Any) -> bool:
    """Fields that take --no-x and a bare --x."""
    return tp is bool or tp == BoolOrAuto


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list


def _from_toml(name: str, tp: Any, value: Any) -> Any:
    """Type-check a TOML value: TOML already typed it, so only exact kinds are accepted."""
    if _is_list(tp):
        if isinstance(value, str):
            return _split_list(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp == BoolOrAuto:
        if isinstance(value, bool) or value == _AUTO:
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str or typing.get_origin(tp) is Literal:
        if isinstance(value, str):
            return value
    raise ConfigError(f"'{name}' must be {_type_name(tp)}, got {value!r}")


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _from_cli(name: str, tp: Any, text: str) -> Any:
    """Parse a CLI string into the field's type."""
    try:
        if _is_list(tp):
            return _split_list(text)
        if _is_flag(tp):
            if tp == BoolOrAuto and text.lower() == _AUTO:
                return _AUTO
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if tp is int:
            return int(text)
        if tp is float:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        return text
    except ValueError:
        raise ConfigError(f"'--{name}' must be {_type_name(tp)}, got {text!r}") from None


def _set(config: JobConfig, section: str, key: str, value: Any, source: str) -> None:
    """Set a typed value after checking it against everything its field declares: its choices and
    its bounds. A value is refused where it is given, even when a later source overrides it, as
    a wrongly typed one is."""
    choices = field_choices(section, key)
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"'{section}.{key}' = {value!r} is not allowed; choose one of: {allowed}")
    bounds = field_bounds(section, key)
    problem = bounds.problem(f"{section}.{key}", value) if bounds is not None else None
    if problem is not None:
        raise ConfigError(problem)
    setattr(getattr(config, section), key, value)
    config.sources[f"{section}.{key}"] = source
