"""Pieces shared by the benchmarks of bench/: the PASS/FAIL target record and the /proc readings
behind the peak-memory measurements (Linux only)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Check:
    name: str
    measured: Optional[float]        # None when a side was skipped
    op: str                          # "<=" or ">="
    target: float
    note: str = ""

    @property
    def result(self) -> str:
        if self.measured is None:
            return f"SKIP ({self.note})" if self.note else "SKIP"
        ok = self.measured <= self.target if self.op == "<=" else self.measured >= self.target
        return "PASS" if ok else "FAIL"


def proc_status_kib(field_name: str) -> int:
    """One ``kB`` field of /proc/self/status (VmRSS: resident set now, VmHWM: its peak)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field_name}:\s+(\d+) kB", text, re.M).group(1))
