"""How the training process allocates host memory (``run.host_allocator``).

glibc's malloc serves every block above its mmap threshold (at most 32 MB) with a fresh ``mmap``
and unmaps it on ``free``; the kernel then zero-fills each 4 KB page at its first touch. A CPU
training step allocates and frees gigabytes of such blocks (activations, logits, the chunked
operator's [B, H, n, K, D] states), so page faults become a large share of its time: two LM
training runs of ``experiments/lcsm_lm/base.yaml`` spent 55% of their CPU time in the kernel.

"retain" tells glibc to serve every block from its heap (``M_MMAP_MAX`` = 0) and never to give
freed memory back (``M_TRIM_THRESHOLD`` at its maximum), so the next step reuses the pages it
already touched. It changes no number, only where the bytes live; peak resident memory grows by
what fragmentation keeps (about 20% in the measurement of ``docs/engine.md``). The setting holds
for the rest of the process (glibc has no way back to its dynamic defaults), which is why it is
``lcsm train``'s default and not the library's: a Python caller's process is its own. "system"
leaves malloc as it is; so does "retain" where the C library is not glibc (macOS, musl), and says so.
"""

from __future__ import annotations

import ctypes
import platform

HOST_ALLOCATORS = ("retain", "system")

# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
_INT_MAX = 2**31 - 1
# what "retain" sets: no block served by mmap, no freed memory given back
RETAIN = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, _INT_MAX))


def mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    """glibc's mallopt for each (option, value) in turn; whether glibc took every one."""
    fn = ctypes.CDLL(None).mallopt
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(fn(option, value) for option, value in settings)


_retained = False


def use_host_allocator(choice: str) -> str:
    """Apply ``choice`` ("retain" or "system", validated by ``TrainConfig``) to this process;
    returns what it did, for the run's record."""
    global _retained
    if choice == "system":
        return "retain (set earlier in this process, which keeps it)" if _retained else "system"
    libc, version = platform.libc_ver()
    if libc != "glibc":
        return f"system (retain needs glibc; this C library is {libc or 'unknown'})"
    if not mallopt(RETAIN):
        raise OSError(
            f"run.host_allocator: glibc {version} refused mallopt (M_MMAP_MAX 0, M_TRIM_THRESHOLD "
            f"{_INT_MAX}); set run.host_allocator: system"
        )
    _retained = True
    return f"retain (glibc {version}: no mmap, no trim)"
