"""Host memory for the CPU forms, without changing the caller's malloc settings (docs/eos.md,
"Host memory on the CPU").

glibc's mmap threshold starts at 128 KiB and rises to the size of each larger mapped block the
process frees, up to 32 MiB (the trim threshold to twice it). A process whose tensors stay small
keeps it low, and every chunked call then maps, faults in and unmaps its buffers again. The first
CPU call of an operator allocates and frees one untouched block just under the ceiling, as freeing
any tensor of that size would; no ``mallopt`` setting changes, so a process that chose its own
thresholds (which turns glibc's dynamic threshold off) keeps them.
"""

from __future__ import annotations

import ctypes
import platform

import torch

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems (4 * 1024 * 1024 * sizeof(long)); the block
# must stay under it, header included, for free() to move the threshold.
_DYNAMIC_CEILING = 32 * 2**20
_BLOCK = _DYNAMIC_CEILING - 2**16

_state = {"primed": None}


def prime_host_heap(x: object) -> bool | None:
    """Once per process, on the first call with a CPU tensor ``x`` (an operator's input): malloc
    and free one block of ``_BLOCK`` bytes so glibc's dynamic mmap threshold reaches its ceiling.
    Returns whether this process was primed (None: not yet asked). Anything but a CPU tensor is
    left to the operator's own checks. Skipped while torch.compile traces (the graph has no place
    for a foreign call; the first eager call primes)."""
    # tracing is ruled out before the state is branched on: a branch on it inside a traced graph
    # becomes a guard, and the first eager call's priming would then recompile the graph
    if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or torch.compiler.is_compiling():
        return _state["primed"]
    if _state["primed"] is None:
        _state["primed"] = _malloc_and_free(_BLOCK)
    return _state["primed"]


def _malloc_and_free(nbytes: int) -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    block = libc.malloc(nbytes)
    if not block:
        return False
    libc.free(block)
    return True
