"""What one field allows beyond its type and choices, declared on the field in sections.py
(`option(..., bounds=...)`): a numeric range, with values outside it that mean something (-1: derive
it), or a string's length and the characters it may not hold (for a list field, every item's).

One check serves every field as its value is set (fields._set), and the same description is what
--help shows and what the error message says is allowed, so the two cannot disagree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol


class Bounds(Protocol):
    """A single-field rule: what it allows, in words, and the one-line error for a value outside it."""

    def describe(self) -> str: ...

    def problem(self, name: str, value: Any) -> str | None:
        """The error naming `name` (section.key) and what is allowed, or None when `value` fits."""


def _number(x: float) -> str:
    # Bounds read as integers where they are ("0", not "0.0"), whatever the field's type.
    return str(int(x)) if float(x).is_integer() else repr(x)


@dataclass(frozen=True)
class Range:
    """low <= value <= high (strict with low_open / high_open; either end may be open-ended), or
    one of `also`: values outside the range with what each means ("" when the help says it).
    `note` explains a value inside the range, e.g. "0: greedy"."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[tuple[float, str], ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.low is None and self.high is None:
            raise ValueError("a Range needs low or high (a field with no bounds declares none)")

    def contains(self, value: float) -> bool:
        if any(value == special for special, _ in self.also):
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            span = (
                f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                f"{_number(self.high)}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            span = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            assert self.high is not None  # __post_init__: a Range has low or high
            span = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        if self.note:
            span += f" ({self.note})"
        specials = [f"{_number(v)} ({meaning})" if meaning else _number(v) for v, meaning in self.also]
        return " or ".join([*specials, span])

    def problem(self, name: str, value: Any) -> str | None:
        return None if self.contains(value) else f"'{name}' must be {self.describe()}, got {value}"


def at_least(low: float, *, also: dict[float, str] | None = None, note: str = "") -> Range:
    """value >= low, or one of `also`.

    Args:
        low: the smallest allowed value.
        also: values below `low` that are allowed too, each with what it means ("" when the help says
            it); None for none.
        note: what a value inside the range means, shown by --help (e.g. "0: off").
    """
    return Range(low=low, also=tuple((also or {}).items()), note=note)


def above(low: float) -> Range:
    """value > low."""
    return Range(low=low, low_open=True)


def between(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False, also: dict[float, str] | None = None
) -> Range:
    """low <= value <= high (strict at an open end), or one of `also`.

    Args:
        low: the lower end.
        high: the upper end.
        low_open: whether `low` itself is refused.
        high_open: whether `high` itself is refused.
        also: values outside the range that are allowed too, each with what it means ("" when the
            help says it); None for none.
    """
    return Range(low, high, low_open, high_open, tuple((also or {}).items()))


@dataclass(frozen=True)
class Text:
    """A string of min_len to max_len characters holding none of `forbidden`. With `each` (what an
    item is called in the message), the rule of every item of a list field."""

    min_len: int = 0
    max_len: int | None = None
    forbidden: str = ""
    each: str = ""

    def _fits(self, text: str) -> bool:
        longest = math.inf if self.max_len is None else self.max_len
        return self.min_len <= len(text) <= longest and not set(self.forbidden) & set(text)

    def _limits(self) -> str:
        if self.max_len is None:
            length = f"at least {self.min_len} characters" if self.min_len else ""
        elif self.min_len:
            length = f"{self.min_len}-{self.max_len} characters"
        else:
            length = f"at most {self.max_len} characters"
        forbidden = f"none of {' '.join(self.forbidden)}" if self.forbidden else ""
        return ", ".join(part for part in (length, forbidden) if part)

    def describe(self) -> str:
        return f"each {self.each} {self._limits()}" if self.each else self._limits()

    def problem(self, name: str, value: Any) -> str | None:
        if not self.each:
            return None if self._fits(value) else f"'{name}' = {value!r}: {self._limits()}"
        bad = next((item for item in value if not self._fits(item)), None)
        return None if bad is None else f"'{name}': each {self.each} must be {self._limits()}, got {bad!r}"
