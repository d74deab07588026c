"""The did-you-mean hint of every error about an unknown name, option or choice in lcsm."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest valid name, or '' when nothing is close."""
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
