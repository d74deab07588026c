"""Where a result came from: the commit and the machine (recorded by benchmarks and reports)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def machine_info(threads: int | None = None) -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": cpu,
        "cores": f"{os.cpu_count()} logical, {usable} usable by this process",
        "torch": torch.__version__,
        "threads": str(threads if threads is not None else torch.get_num_threads()),
        "python": platform.python_version(),
    }


def device_name(device: torch.device) -> str:
    """ "cpu", or the accelerator's name ("cuda:0 NVIDIA H100 80GB HBM3")."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)


def git_commit(ignore: Sequence[Path] = ()) -> str:
    """Short hash of HEAD of the source checkout, marked when the tracked files have changes
    outside the folders or files ``ignore`` (a report's own folder, a bench's own table:
    regenerating them changes them). A copy of the tree without its git history (the GPU machine of
    ``bench/gpu.sh``) names its commit in the environment variable ``LCSM_GIT_COMMIT``."""
    if os.environ.get("LCSM_GIT_COMMIT"):
        return os.environ["LCSM_GIT_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=30
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "-z", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    folders = [Path(f).resolve() for f in ignore]
    entries, changed = status.split("\0"), []
    while entries:
        entry = entries.pop(0)
        if len(entry) > 3:
            changed.append(entry[3:])
            if entry[0] in "RC":  # a rename or copy: its source path is the next entry
                changed.append(entries.pop(0))
    dirty = any(not any(f == d or d in f.parents for d in folders) for f in ((REPO / c).resolve() for c in changed))
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")
