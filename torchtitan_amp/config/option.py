"""The field helper every config section declares its fields with (`option`), and the boolean
that may also be "auto"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal

from torchtitan_amp.config.bounds import Bounds

# A boolean that may also be "auto" (mixed_precision.enabled).
BoolOrAuto = bool | Literal["auto"]
_AUTO = "auto"


def option(
    default: Any, help: str, choices: Callable[[], tuple[str, ...]] | None = None, bounds: Bounds | None = None
) -> Any:
    """A config field: a dataclass field carrying its --help line, allowed set and bounds as metadata.

    Returns the `dataclasses.field` to assign to the section's attribute.

    Args:
        default: the field's default value; a list default is copied for each new config.
        help: the --help line for the field (what it does, not what was measured).
        choices: a function returning the allowed values, for a set that grows at run time (asked
            each time a value is set); None when the field's Literal type is the allowed set, or
            any value of its type is allowed.
        bounds: what a value must be beyond its type (bounds.py), checked as it is set and shown by
            --help; None for no bounds.
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if bounds is not None:
        meta["bounds"] = bounds
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
