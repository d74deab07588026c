"""The native block-diagonal linear map (``lcsm.ops.native_block_diag``, C source
lcsm/ops/_native/blockdiag.h) against einsum in float64: outputs and the gradients of the input and
the blocks under random cotangents, in float64 and float32, at row counts the kernel's tiles of 256
rows do not divide; and its refusals."""

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
