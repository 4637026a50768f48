"""The config as people read it: the resolved TOML (--job.print_config, config.toml in the dump
folder) and --help, one line per field with its default, allowed values and bounds."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from torchtitan_amp.config.fields import _section_type, field_bounds, field_choices
from torchtitan_amp.config.sections import JobConfig, section_names


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON string escapes are valid TOML basic-string escapes: quotes and backslashes survive.
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return repr(value)


def _format_choice(value: Any) -> str:
    return _format_value(value) if isinstance(value, bool) else str(value)


def to_toml(config: JobConfig) -> str:
    lines: list[str] = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_format_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Overrides: --section.key VALUE, --section.key=VALUE; booleans as a bare flag (true),",
        "--section.key true|false or --no-section.key; lists comma-separated.",
        "Precedence: CLI > TOML (--job.config_file) > defaults.",
    ]
    for section in section_names():
        lines += ["", f"[{section}]"]
        for f in dataclasses.fields(_section_type(section)):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            choices = field_choices(section, f.name)
            allowed = f"  {{{', '.join(_format_choice(c) for c in choices if c != '')}}}" if choices else ""
            bounds = field_bounds(section, f.name)
            limits = f"  ({bounds.describe()})" if bounds is not None else ""
            lines.append(f"  --{section}.{f.name} (default {_format_value(default)}){allowed}{limits}")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
