"""The native gated RMSNorm (``lcsm.ops.native_gated_rms_norm``, C source
lcsm/ops/_native/rmsnorm.h) against its definition as PyTorch operations in float64, in both
orders (Mamba-2's gate first, fla's norm first): the output and the gradients of y, z and the
weight under random cotangents, in float64 and float32, with one and several groups, at row
counts the kernel's tiles of 256 rows do not divide; and its refusals."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.ops import native_gated_rms_norm
from lcsm.ops import native_scan as native
from lcsm.testing import assert_op_matches

EPS = 1e-5


def reference(y, z, weight, group, eps, gate_first):
    a = y * F.silu(z) if gate_first else y
    a = a.unflatten(-1, (-1, group))
    normed = (a * torch.rsqrt(a.square().mean(-1, keepdim=True) + eps)).flatten(-2) * weight
    return normed if gate_first else normed * F.silu(z)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("lead,C,group", [((2, 150), 12, 12), ((1, 300), 12, 4), ((3,), 5, 1), ((1, 257), 64, 16)])
def test_against_pytorch(lead, C, group, gate_first, dtype):
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())
    g = torch.Generator().manual_seed(C + group)
    x = {
        "y": torch.randn(*lead, C, generator=g, dtype=torch.float64),
        "z": torch.randn(*lead, C, generator=g, dtype=torch.float64) * 2,
        "weight": 1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64),
    }

    assert_op_matches(
        native_gated_rms_norm,
        reference,
        x,
        dtype,
        context=f"{lead} C {C} group {group} gate first {gate_first}",
        group=group,
        eps=EPS,
        gate_first=gate_first,
    )


def test_refusals():
    y = torch.zeros(2, 6)
    expected = r"native_gated_rms_norm: expected y and z \[\.\.\., C\] and weight \[C\] with C a multiple of group, got"
    with pytest.raises(ValueError, match=expected + r" \[2, 6\], \[2, 6\], \[6\], group 4"):
        native_gated_rms_norm(y, y, torch.ones(6), 4, EPS, True)
    with pytest.raises(ValueError, match=expected + r" \[2, 6\], \[2, 5\], \[6\], group 3"):
        native_gated_rms_norm(y, torch.zeros(2, 5), torch.ones(6), 3, EPS, True)
