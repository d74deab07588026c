"""The native depthwise causal convolution (``lcsm.ops.native_causal_conv``, C source
lcsm/ops/_native/conv.h) against torch's grouped conv1d in float64: the output and the gradients of
x, the history, the weight and the bias under random cotangents, in float64 and float32, with and
without SiLU, a history and a bias, at lengths the kernel's tiles of 128 steps do not divide and
lengths shorter than the history; and its refusals."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.ops import native_causal_conv
from lcsm.ops import native_scan as native
from lcsm.testing import assert_op_matches


def reference(x, weight, bias, history, silu):
    B, _, C = x.shape
    W = weight.shape[-1]
    before = history if history is not None else x.new_zeros(B, W - 1, C)
    y = F.conv1d(torch.cat([before, x], 1).transpose(1, 2), weight, bias, groups=C).transpose(1, 2)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("T,W", [(300, 4), (130, 2), (2, 4), (1, 1), (129, 3)])
@pytest.mark.parametrize("with_history,with_bias", [(True, True), (False, False), (True, False)])
def test_against_conv1d(T, W, silu, with_history, with_bias, dtype):
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())
    g = torch.Generator().manual_seed(T * 10 + W)
    B, C = 2, 5
    x = {"x": torch.randn(B, T, C, generator=g, dtype=torch.float64)}
    x["weight"] = torch.randn(C, 1, W, generator=g, dtype=torch.float64)
    if with_bias:
        x["bias"] = torch.randn(C, generator=g, dtype=torch.float64)
    if with_history and W > 1:
        x["history"] = torch.randn(B, W - 1, C, generator=g, dtype=torch.float64)

    assert_op_matches(
        native_causal_conv,
        reference,
        x,
        dtype,
        context=f"T {T} W {W} silu {silu} history {with_history} bias {with_bias}",
        silu=silu,
        **{k: None for k in ("bias", "history") if k not in x},
    )


def test_refusals():
    x, w = torch.zeros(2, 7, 3), torch.zeros(3, 1, 4)
    with pytest.raises(
        ValueError,
        match=r"native_causal_conv: expected x \[B, T, C\] and weight \[C, 1, W\], got \[2, 7, 3\], \[3, 4\]",
    ):
        native_causal_conv(x, w[:, 0], None, None)
    with pytest.raises(
        ValueError, match=r"native_causal_conv: expected history \[B, W - 1, C\] = \[2, 3, 3\], got \[2, 4, 3\]"
    ):
        native_causal_conv(x, w, None, torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match=r"native_causal_conv: expected bias \[C\] = \[3\], got \[4\]"):
        native_causal_conv(x, w, torch.zeros(4), None)
