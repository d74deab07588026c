"""Pieces shared by the benchmarks of bench/: the provenance header of a results table, the
PASS/FAIL target record, and the fresh worker process and /proc readings behind the peak-memory
measurements (Linux only)."""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lcsm._provenance import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]


def provenance_header(prog: str, argv: Sequence[str], threads: int, out: str | None = None) -> dict[str, str]:
    """Command, commit, date and machine: the first lines of every results table. The command is
    the suite's ``lcsm bench SUITE`` form (``prog``) with its options, however it was started:
    ``python -m bench.SUITE_bench`` runs the same code, and one spelling keeps tables comparable.
    The table's own file ``out`` is left out of the commit's "uncommitted changes" mark: rerunning
    a bench over its committed results rewrites that file before the next run reads the commit."""
    header = {
        "command": shlex.join([*prog.split(), *argv]),
        "git commit": git_commit(ignore=[out] if out else ()),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    header.update({f"machine {k}": v for k, v in machine_info(threads).items()})
    return header


def write_out(text: str, out: str | None, log: Callable[[str], None]) -> None:
    """Write a rendered table to ``out`` (``--out``), creating its folder; nothing when it is None."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        log(f"wrote {out}")


@dataclass
class Check:
    name: str
    measured: float | None  # None when a side was skipped
    op: str  # "<=" or ">="
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


def run_worker(module: str, flag: str, spec: dict[str, Any], timeout: float, env: dict[str, str]) -> Any | str:
    """Run ``python -m MODULE FLAG SPEC`` in a fresh process with ``env`` and return the JSON on
    the last line it prints, or a string saying why not."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", module, flag, json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"worker failed (exit {proc.returncode}): {tail}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_memory_worker(module: str, spec: dict[str, Any], timeout: float) -> Any | str:
    """Run ``python -m MODULE --memory-worker SPEC`` in a fresh process (so no earlier allocation
    of this one counts in its peak) and return the ``peak_bytes`` of the JSON on the last line it
    prints, or a string saying why not."""
    # A fixed mmap threshold makes glibc serve every large tensor by mmap and return it to the OS
    # when freed, so the resident set follows the live tensors instead of keeping freed heap pages.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
    out = run_worker(module, "--memory-worker", spec, timeout, env)
    return out if isinstance(out, str) else out["peak_bytes"]


def run_allocator_worker(module: str, spec: dict[str, Any], timeout: float) -> Any | str:
    """Run ``python -m MODULE --allocator-worker SPEC`` in a fresh process whose malloc starts
    from glibc's defaults (no MALLOC_* tuning inherited), so that the allocator the worker then
    applies (``spec["allocator"]``, as ``run.host_allocator``) is the only one its timings see;
    returns the worker's JSON or a string saying why not."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return run_worker(module, "--allocator-worker", spec, timeout, env)
