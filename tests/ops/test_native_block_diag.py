"""The native block-diagonal linear map (``lcsm.ops.native_block_diag``, C source
lcsm/ops/_native/blockdiag.h) against einsum in float64: outputs and the gradients of the input and
the blocks under random cotangents, in float64 and float32, at row counts the kernel's tiles of 256
rows do not divide; that it reads nothing past its tensors; and its refusals."""

import subprocess
import sys

import pytest
import torch

from lcsm.ops import native_block_diag
from lcsm.ops import native_scan as native
from lcsm.testing import assert_op_matches


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    nb, _, bi = w.shape
    return torch.einsum("...no,nuo->...nu", x.unflatten(-1, (nb, bi)), w).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "lead,blocks", [((2, 7), (3, 4, 4)), ((300,), (2, 3, 2)), ((1, 1), (1, 1, 1)), ((2, 257), (5, 2, 3))]
)
def test_against_einsum(lead, blocks, dtype):
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, blocks[0] * blocks[2], generator=g, dtype=torch.float64)
    w = torch.randn(*blocks, generator=g, dtype=torch.float64)

    assert_op_matches(native_block_diag, reference, {"x": x, "w": w}, dtype, context=f"{lead} {blocks}")


def test_refusals():
    expected = r"native_block_diag: expected x \[\.\.\., NB \* BI\] .*got \[2, 7\], \[3, 2, 2\]"
    with pytest.raises(ValueError, match=expected):
        native_block_diag(torch.zeros(2, 7), torch.zeros(3, 2, 2))


def test_reads_nothing_past_its_rows():
    """Forward and backward on inputs and cotangents that end where an inaccessible page begins
    (in a subprocess: a read past them is a fault): 4 x 4 blocks (the written-out path) and odd row
    counts. GCC 12 -O3 once vectorised the weight gradient's 4 x 4 loop into a read of one row past
    each tile's end, which faulted (exit -11) in mLSTM's training at T 1023."""
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())
    done = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


GUARDED = """
import ctypes, mmap, torch
from lcsm.ops import native_block_diag

libc, page = ctypes.CDLL(None), mmap.PAGESIZE
kept = []

def guarded(rows, cols):  # a [rows, cols] float32 tensor whose last byte ends at a PROT_NONE page
    size = rows * cols * 4
    pages = -(-size // page) + 1
    m = mmap.mmap(-1, pages * page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mprotect(ctypes.c_void_p(start + (pages - 1) * page), page, 0) == 0
    kept.append(m)
    t = torch.frombuffer(m, dtype=torch.float32, count=rows * cols, offset=(pages - 1) * page - size)
    return t.view(rows, cols).copy_(torch.randn(rows, cols))

for rows in (1023, 511, 257, 256, 1):
    x, dy = guarded(rows, 256).requires_grad_(), guarded(rows, 256)
    w = torch.randn(64, 4, 4, requires_grad=True)
    native_block_diag(x, w).backward(dy)
"""
