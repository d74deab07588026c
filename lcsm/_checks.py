"""Argument checks shared by every layer of the package (ops, layers, models, tasks)."""

from __future__ import annotations


def check_bool(name: str, value) -> bool:
    """value when it is True or False, else a ValueError naming the argument."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return value
