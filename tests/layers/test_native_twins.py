"""The layers that call native CPU kernels for parts of their own (the short convolution, mLSTM's
readout and block-diagonal projections, the gated RMSNorms) against the same layers with those
kernels turned off (``native_serves`` False: the PyTorch operations other devices and compiled
graphs run): output, final state and every gradient, in float64, with and without an initial
state. The kernels' own tests (tests/ops/test_native_*.py) check each against its definition;
this checks that each layer hands them the right operands."""

import pytest
import torch

from lcsm import layers
from lcsm.ops import native_scan
from lcsm.testing import assert_close, gradients

# every module that asks native_serves before calling a native kernel
CALLERS = ("packing", "mlstm", "mamba2", "gated_deltaproduct")
NAMES = ["mlstm", "mamba2", "mamba", "metala", "gated_deltaproduct", "comba", "longhorn"]


def run(layer, x, state):
    leaves = {"x": x.clone().requires_grad_(), **dict(layer.named_parameters())}
    for p in layer.parameters():
        p.grad = None
    out, final = layer(leaves["x"], state=state, return_state=True)
    outputs = {"y": out, **{f"state.{k}": v for k, v in vars(final).items() if torch.is_tensor(v)}}
    outputs = {k: v.real if v.is_complex() else v for k, v in outputs.items()}
    return gradients(outputs, leaves)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_native_parts_equal_the_pytorch_forms(name, with_state, monkeypatch):
    if native_scan.native_unavailable() is not None:
        pytest.skip(native_scan.native_unavailable())
    torch.manual_seed(0)
    layer = layers.build(name, 16).double()
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    state = None
    if with_state:  # the state after a first segment, so that the convolutions read a history
        with torch.no_grad():
            _, state = layer(torch.randn(2, 5, 16, dtype=torch.float64), return_state=True)
    native = run(layer, x, state)
    for module in CALLERS:
        monkeypatch.setattr(f"lcsm.layers.{module}.native_serves", lambda t: False)
    assert_close(native, run(layer, x, state), dtype=torch.float64, context=f"{name} state {with_state}")
