"""Tables of the agent's config file read into frozen dataclasses, every value checked.

One reader for every table ([health], [policy], [cuda]): an unknown key or a value of the wrong kind
is an error naming the table, the key and what is expected, so a typo never leaves a default
silently in place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from agent.errors import InvalidArgumentError

C = TypeVar("C")


def from_table(
    cls: type[C], d: Mapping[str, object], table: str, positive: frozenset[str] = frozenset()
) -> C:
    """`cls` with the overrides in `d`: ints are whole numbers ≥ 0, floats finite numbers ≥ 0
    (> 0 for the keys in `positive`), tuples lists of whole numbers, bools true or false, strs strings."""
    kinds = {f.name: str(f.type) for f in fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, raw in d.items():
        if key not in kinds:
            raise InvalidArgumentError(
                f"unknown key {key!r} in [{table}]", hint=f"known settings: {', '.join(kinds)}"
            )
        values[key] = _value(table, key, raw, kinds[key], key in positive)
    return cls(**values)


def _value(table: str, key: str, raw: object, kind: str, positive: bool) -> Any:
    if kind.startswith("tuple[str"):
        if isinstance(raw, (list, tuple)) and all(isinstance(v, str) for v in raw):
            return tuple(raw)
        want = "a list of strings"
    elif kind.startswith("tuple"):
        if isinstance(raw, (list, tuple)) and all(_count(v) is not None for v in raw):
            return tuple(int(v) for v in raw)  # type: ignore[call-overload]
        want = "a list of whole numbers"
    elif kind == "str":
        if isinstance(raw, str):
            return raw
        want = "a string"
    elif kind == "bool":
        if isinstance(raw, bool):
            return raw
        want = "true or false"
    elif kind == "int":
        n = _count(raw)
        if n is not None:
            return n
        want = "a whole number ≥ 0"
    else:
        x = _number(raw)
        if x is not None and (x > 0 or not positive):
            return x
        want = "a number > 0" if positive else "a number ≥ 0"
    raise InvalidArgumentError(
        f"[{table}] {key} = {raw!r} is not valid: expected {want}",
        hint=f"fix the [{table}] table of the agent's config file",
    )


def _count(v: object) -> int | None:
    """v as a non-negative int; None for anything else (bools included: TOML true is not 1)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _number(v: object) -> float | None:
    """v as a finite float ≥ 0; None for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) and v >= 0 else None
