"""SwiGLU's gate by the native kernel (``lcsm.ops.native_silu_mul``, C source
lcsm/ops/_native/glu.h) against silu(a) * b as PyTorch operations in float64: the output and the
gradients of a and b under random cotangents, in float64 and float32, at sizes the kernel's tiles
of 16384 elements and its vectors do not divide, with large gates of either sign (where silu
saturates) and non-contiguous operands; the GLU channel mixer's dispatch to it; its refusal."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.models.blocks import GLU
from lcsm.ops import native_scan as native
from lcsm.ops import native_silu_mul
from lcsm.testing import assert_matches_reference, assert_op_matches


def skip_without_kernel():
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())


def reference(a, b):
    return F.silu(a) * b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(3,), (2, 7, 5), (1, 16385), (3, 70, 344)])
def test_against_pytorch(shape, dtype):
    skip_without_kernel()
    g = torch.Generator().manual_seed(sum(shape))
    a = torch.randn(*shape, generator=g, dtype=torch.float64) * 4
    a.view(-1)[:2] = torch.tensor([-60.0, 60.0], dtype=torch.float64)[: a.numel()]
    x = {"a": a, "b": torch.randn(*shape, generator=g, dtype=torch.float64)}
    assert_op_matches(native_silu_mul, reference, x, dtype, context=f"{shape}")


def test_non_contiguous_operands():
    skip_without_kernel()
    g = torch.Generator().manual_seed(1)
    both = torch.randn(4, 9, 2 * 6, generator=g, dtype=torch.float64)
    x = {"a": both[..., :6], "b": both[..., 6:].transpose(0, 1).contiguous().transpose(0, 1)}
    assert not x["a"].is_contiguous()
    assert_op_matches(native_silu_mul, reference, x, torch.float64)


def test_glu_takes_the_kernel_on_the_cpu(monkeypatch):
    """Eager float CPU inputs run the native gate, equal to the mixer written out; inputs
    ``native_serves`` refuses (a traced call, another device or dtype) keep the PyTorch form."""
    skip_without_kernel()
    torch.manual_seed(0)
    glu = GLU(6, 10).double()
    calls = []
    kernel = native_silu_mul
    monkeypatch.setattr("lcsm.models.blocks.native_silu_mul", lambda a, b: calls.append(a.shape) or kernel(a, b))
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    assert_matches_reference(glu, x, lambda x: glu.down_proj(F.silu(glu.gate_proj(x)) * glu.up_proj(x)))
    assert calls
    monkeypatch.setattr("lcsm.models.blocks.native_serves", lambda t: False)
    calls.clear()
    glu(x)
    assert not calls


def test_refusal():
    with pytest.raises(ValueError, match=r"native_silu_mul: expected a and b of one shape, got \[2, 3\], \[3\]"):
        native_silu_mul(torch.zeros(2, 3), torch.zeros(3))
