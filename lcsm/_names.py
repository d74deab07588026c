"""Error messages for unknown names and options, shared by every registry and config in lcsm."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or '' when nothing is close."""
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_options(owner: str, given: Mapping[str, object], valid: Iterable[str]) -> None:
    """Raise ValueError naming every unknown option of ``owner``, with hints and the valid list."""
    valid = list(valid)
    unknown = [k for k in given if k not in valid]
    if unknown:
        hints = ", ".join(f"{k!r}{did_you_mean(k, valid)}" for k in unknown)
        raise ValueError(f"{owner}: unknown option(s) {hints}. Valid options: {', '.join(valid) or 'none'}")
