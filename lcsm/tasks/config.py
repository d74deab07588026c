"""Task configuration: the base of every task's typed options, and the checks they share."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from lcsm._names import check_options


@dataclass(frozen=True)
class TaskConfig:
    """Base of every task's typed configuration: a frozen dataclass validated on construction.

    Subclasses declare their fields with defaults and check them in ``__post_init__``; the fields
    are exactly the options ``build`` accepts, and all of them together determine the data (the
    cache key hashes them).
    """

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, task_name: str, **options) -> TaskConfig:
        """Build from keyword options; unknown names fail with the closest valid ones."""
        check_options(f"task {task_name!r}", options, cls.option_names())
        return cls(**options)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def check_positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return float(value)
