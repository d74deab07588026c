"""Task configuration: the base of every task's typed options."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from lcsm._checks import check_keys


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
        if "packing" in options and "packing" not in cls.option_names():
            raise ValueError(
                f"task {task_name!r}: option 'packing' packs the documents of a text stream into rows "
                "with boundaries, which only the 'lm' task has; remove it"
            )
        check_keys(f"task {task_name!r}", options, cls.option_names(), kind="option")
        return cls(**options)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def check_data_dir(value) -> None:
    """A real-data task's ``data_dir``: a directory path or None (not "", which Path reads as the
    current directory)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"data_dir: expected a directory path or null, got {value!r}")
