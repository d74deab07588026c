"""Argument checks shared by every layer of the package (ops, layers, models, tasks, engine).

Each check names the argument, the value it got and what it expected, returns the value (so a
constructor can write ``self.n = check_int("n", n, 1)``) and suggests the closest valid name where
the value is one of a fixed set.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

from lcsm._names import did_you_mean


def check_bool(name: str, value) -> bool:
    """value when it is True or False, else a ValueError naming the argument."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value


def check_int(name: str, value, minimum: int, *, allow_none: bool = False) -> int | None:
    """value when it is an int >= minimum (None too with allow_none), else a ValueError.

    bool is refused although it is an int subclass: ``heads=True`` is a mistake, not 1. Other
    integer types (numpy's) are refused too, with a hint: configs keep the value as given and write
    it to JSON, which takes only Python ints.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = ""
        if isinstance(value, Integral) and not isinstance(value, int):
            hint = f" ({type(value).__name__}: give a Python int, int(value))"
        raise ValueError(
            f"{name}: expected an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}{hint}"
        )
    return value


def check_float(
    name: str,
    value,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
) -> float | None:
    """value as a float when it is a finite real number within [low, high] (an end is excluded with
    low_open / high_open; None is accepted with allow_none), else a ValueError.

    NaN and the infinities are always refused: no option of lcsm means anything at them.
    """
    if value is None and allow_none:
        return None
    ok = (
        not isinstance(value, bool)
        and isinstance(value, Real)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high)
    )
    if not ok:
        raise ValueError(
            f"{name}: expected {_number_phrase(low, high, low_open, high_open)}"
            f"{' or None' if allow_none else ''}, got {value!r}"
        )
    return float(value)


def _number_phrase(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """'a positive finite number', 'a finite number >= 0', 'a number in (0, 1]', ..."""
    if low == 0 and low_open and high == math.inf:
        return "a positive finite number"
    if high == math.inf:
        return "a finite number" + ("" if low == -math.inf else f" {'>' if low_open else '>='} {low:g}")
    if low == -math.inf:
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_choice(name: str, value, choices: Iterable):
    """value when it is one of choices, else a ValueError listing them (and the closest one)."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(
            f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}"
            f"{did_you_mean(value, [str(c) for c in choices])}"
        )
    return value


def check_keys(owner: str, given, valid: Iterable[str], *, kind: str = "key", unknown: str | None = None) -> None:
    """A ValueError unless ``given`` is a mapping whose keys are all in ``valid``; it names every
    unknown key, with the closest valid one, and lists the valid ones.

    The message reads "<owner>: unknown <kind>(s) 'x' (did you mean 'y'?). Valid <kind>s: ...";
    ``unknown`` replaces "unknown <kind>(s)" where the owner reads better in a sentence
    ("mixer 'gla' has no option(s)").
    """
    valid = list(valid)
    if not isinstance(given, Mapping):
        raise ValueError(f"{owner}: expected a mapping of {kind}s to values, got {type(given).__name__}")
    bad = [k for k in given if k not in valid]
    if bad:
        hints = ", ".join(f"{k!r}{did_you_mean(k, valid)}" for k in bad)
        raise ValueError(
            f"{owner}: {unknown or f'unknown {kind}(s)'} {hints}. Valid {kind}s: {', '.join(valid) or 'none'}"
        )


def named_fields(cls: type) -> type:
    """A dataclass whose constructor names an unknown keyword's closest field and lists the valid
    ones, as ``check_keys`` does for a mapping (the dataclass's own TypeError names the keyword
    alone: ``ModelConfig(n_layer=4)``). Still a TypeError, as for any unexpected keyword."""
    init, fields = cls.__init__, [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            hints = ", ".join(f"{k!r}{did_you_mean(k, fields)}" for k in unknown)
            raise TypeError(f"{cls.__name__}: unknown field(s) {hints}. Valid fields: {', '.join(fields)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def with_older_spelling(
    current: Mapping[str, Any], older: Mapping[str, tuple[str, Any]], old_section: str, new_section: str
) -> dict[str, Any]:
    """``current`` (the keys of ``new_section``) with the settings an older config gave elsewhere
    added: ``older`` maps each key of ``new_section`` to (its key in ``old_section``, its value). A
    setting given both ways fails, naming both, rather than one silently winning."""
    merged = dict(current)
    for key, (old_key, value) in older.items():
        if key in merged:
            raise ValueError(
                f"{old_section}.{old_key}: the older spelling of {new_section}.{key}, and both are given "
                f"({old_section}.{old_key}: {value!r}, {new_section}.{key}: {merged[key]!r}); "
                f"give {new_section}.{key} alone"
            )
        merged[key] = value
    return merged
