"""The depthwise causal convolution every convolving mixer shares (``packing.depthwise_causal``,
W shifted multiply-adds) against torch's grouped ``F.conv1d`` on the transposed layout: outputs
and every gradient, with and without bias, widths that do and do not exceed T."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.layers.packing import depthwise_causal, short_conv
from lcsm.testing import assert_close, gradients


def conv1d_reference(full, weight, bias):
    return F.conv1d(full.transpose(1, 2), weight, bias, groups=full.shape[2]).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,W", [(1, 4), (7, 1), (7, 2), (33, 4), (3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_grouped_conv1d(dtype, T, W, bias):
    g = torch.Generator().manual_seed(T * 10 + W)
    B, C = 2, 5
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {
        "full": torch.randn(B, W - 1 + T, C, generator=g, dtype=wide).to(dtype),
        "weight": torch.randn(C, 1, W, generator=g, dtype=wide).to(dtype),
        "bias": torch.randn(C, generator=g, dtype=wide).to(dtype) if bias else None,
    }
    wrt = {k: v.requires_grad_() for k, v in leaves.items() if v is not None}
    got = gradients({"y": depthwise_causal(**leaves)}, wrt)
    assert got["y"].dtype == dtype and got["y"].shape == (B, T, C)
    # the reference in float32 at least: torch's CPU conv1d has no bfloat16 depthwise backward
    ref_leaves = {k: None if v is None else v.detach().to(wide).requires_grad_() for k, v in leaves.items()}
    ref = gradients({"y": conv1d_reference(**ref_leaves)}, {k: v for k, v in ref_leaves.items() if v is not None})
    assert_close(got, ref, dtype=dtype, context=f"depthwise_causal, T={T} W={W} bias={bias}")


def test_short_conv_continues_from_its_history():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, 3, generator=g, dtype=torch.float64)
    weight, bias = (
        torch.randn(3, 1, 4, generator=g, dtype=torch.float64),
        torch.randn(3, generator=g, dtype=torch.float64),
    )
    whole, last = short_conv(x, weight, bias, None, None)
    first, history = short_conv(x[:, :6], weight, bias, None, None)
    second, last2 = short_conv(x[:, 6:], weight, bias, None, history)
    assert_close({"y": torch.cat([first, second], 1), "last": last2}, {"y": whole, "last": last})
    assert torch.equal(last, x[:, -3:])
