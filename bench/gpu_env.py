"""The GPU machine's Python environment, the first step of ``bench/gpu.sh`` (``$OUT/gpu_env.log``):
each module a later step imports, with its version and the file it came from, or the exception
its import raised, so that a missing or incompatible one is named before the step that needs it
fails deep in its own log. Exits 0 where fla's ops import (``fla.ops.gla``), 3 where they do not
(gpu.sh then retries with fla-core alone)."""

from __future__ import annotations

import importlib
import os
import shutil
import sys

# each module, and what needs it
MODULES = {
    "torch": "every step",
    "triton": "lcsm's and fla's kernels",
    "numpy": "tests/test_cuda.py (lcsm.tasks): without it the test step collects nothing",
    "pytest": "the test step",
    "xdist": "the test step's -n 8 (without it the tests run in one process)",
    "yaml": "the efficiency bench (lcsm.engine's config)",
    "safetensors": "the efficiency bench (lcsm.engine's checkpoints)",
    "einops": "every fla.ops module",
    "packaging": "every fla.ops module (fla.utils; fla-core does not declare it)",
    "transformers": ("fla.layers and fla.models (>= 5.6.2; with 4.57.1 and both fla wheels, every fla import fails)"),
    "fla": "fla's ops, layers and models",
    "fla.ops.gla": "gpu_bench's fla pass and bench/fla_warmup.py (all five fla ops need what it needs)",
    "fla.layers.gdn2": "bench/gpu_peers.py",
    "fla.models": "gpu_bench's fla models",
}


def describe(name: str) -> tuple[bool, str]:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    version = getattr(module, "__version__", None) or "no __version__"
    return True, f"{version} ({getattr(module, '__file__', None)})"


def main() -> int:
    print(f"python {sys.version.split()[0]} ({sys.executable})")
    print(f"PYTHONPATH {os.environ.get('PYTHONPATH', '')}")
    print(f"cc {shutil.which('cc') or 'absent: Triton cannot build its launchers'}")
    imported = {}
    for name, needed_by in MODULES.items():
        imported[name], text = describe(name)
        print(f"{name}: {text}  [needed by {needed_by}]", flush=True)
    if imported["torch"]:
        import torch

        if torch.cuda.is_available():
            print(f"CUDA {torch.version.cuda}: {torch.cuda.get_device_name()}")
        else:
            print("CUDA: no device visible (torch.cuda.is_available() is False)")
    return 0 if imported["fla.ops.gla"] else 3


if __name__ == "__main__":
    raise SystemExit(main())
