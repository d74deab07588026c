"""The layers that call native CPU kernels for parts of their own (the short convolution, mLSTM's
readout and block-diagonal projections, the gated RMSNorms, S4's kernel spectrum) against the same layers with those
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
CALLERS = ("packing", "mlstm", "mamba2", "gated_deltaproduct", "s4")
# (name, options): S4 by default (C~ formed for M = 20 roots: z = -1 among them) and with the
# parameter C~ (l_max, M = 21)
LAYERS = [
    *((name, {}) for name in ("mlstm", "mamba2", "mamba", "metala", "gated_deltaproduct", "comba", "longhorn", "s4")),
    ("s4", {"l_max": 21}),
]


def run(layer, x, state):
    leaves = {"x": x.clone().requires_grad_(), **dict(layer.named_parameters())}
    for p in layer.parameters():
        p.grad = None
    out, final = layer(leaves["x"], state=state, return_state=True)
    outputs = {"y": out, **{f"state.{k}": v for k, v in vars(final).items() if torch.is_tensor(v)}}
    outputs = {k: v.real if v.is_complex() else v for k, v in outputs.items()}
    return gradients(outputs, leaves)


def cast(state, dtype):
    """A layer state's real tensors (complex ones: their complex type) in ``dtype``."""
    if state is None:
        return None
    fields = {k: v.to(dtype.to_complex() if v.is_complex() else dtype) for k, v in vars(state).items()}
    return type(state)(**fields)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(("name", "options"), LAYERS, ids=[f"{n}{o or ''}" for n, o in LAYERS])
def test_native_parts_equal_the_pytorch_forms(name, options, with_state, dtype, monkeypatch):
    """float32: the native parts in float32 against the PyTorch forms in float64."""
    if native_scan.native_unavailable() is not None:
        pytest.skip(native_scan.native_unavailable())
    torch.manual_seed(0)
    layer = layers.build(name, 16, **options).double()
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    state = None
    if with_state:  # the state after a first segment, so that the convolutions read a history
        with torch.no_grad():
            _, state = layer(torch.randn(2, 5, 16, dtype=torch.float64), return_state=True)
    native = run(layer.to(dtype), x.to(dtype), cast(state, dtype))
    for module in CALLERS:
        monkeypatch.setattr(f"lcsm.layers.{module}.native_serves", lambda t: False)
    context = f"{name} {options} state {with_state} {dtype}"
    assert_close(native, run(layer.double(), x, state), dtype=dtype, context=context)
