"""minGRU and minLSTM against the paper's sequential formulas (Feng et al. 2024, sections 3.1 and
3.2, with the log-space variant's positive candidate g), written out step by step in plain
(not log) space: the mixers' log-space gates and EOS scan must give the same outputs, final state
and every gradient in float64."""

import pytest
import torch

from lcsm import layers
from lcsm.testing import assert_close, assert_matches_reference

D_MODEL = 6


def g(x):
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


def make(name, expand, seed=0):
    torch.manual_seed(seed)
    mixer = layers.build(name, D_MODEL, expand=expand).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.mul_(3.0)  # gates from near 0 to near 1, candidates on both branches of g
    return mixer


def reference(mixer, x, h0=None):
    """h_t = a_t h_{t-1} + b_t g(W_h x_t) step by step: minGRU a = 1 - z, b = z; minLSTM
    a = f / (f + i), b = i / (f + i)."""
    d_h = mixer.d_hidden
    W, bias = mixer.in_proj.weight, mixer.in_proj.bias
    W_h, b_h = W[:d_h], bias[:d_h]
    h = x.new_zeros(x.shape[0], d_h) if h0 is None else h0
    outs = []
    for t in range(x.shape[1]):
        x_t = x[:, t]
        cand = g(x_t @ W_h.T + b_h)
        if mixer.registry_name == "mingru":
            z = torch.sigmoid(x_t @ W[d_h:].T + bias[d_h:])
            h = (1 - z) * h + z * cand
        else:
            f = torch.sigmoid(x_t @ W[d_h : 2 * d_h].T + bias[d_h : 2 * d_h])
            i = torch.sigmoid(x_t @ W[2 * d_h :].T + bias[2 * d_h :])
            h = f / (f + i) * h + i / (f + i) * cand
        outs.append(h)
    return torch.stack(outs, 1) @ mixer.out_proj.weight.T, h


@pytest.mark.parametrize("name", ["mingru", "minlstm"])
@pytest.mark.parametrize("expand", [1, 2])
def test_matches_sequential_formula(name, expand):
    mixer = make(name, expand)
    x = torch.randn(2, 37, D_MODEL, dtype=torch.float64)
    assert_matches_reference(mixer, x, lambda x: reference(mixer, x)[0], f"{name}, expand={expand}")


@pytest.mark.parametrize("name", ["mingru", "minlstm"])
def test_final_state_and_carried_state(name):
    mixer = make(name, 2, seed=1)
    x = torch.randn(3, 20, D_MODEL, dtype=torch.float64)
    h0 = torch.rand(3, mixer.d_hidden, dtype=torch.float64)
    state = mixer.init_state(3)
    state.memory = h0.view(3, 1, 1, -1)
    y, out_state = mixer(x, state=state, return_state=True)
    y_ref, h_ref = reference(mixer, x, h0)
    assert_close({"y": y, "h": out_state.memory.view(3, -1)}, {"y": y_ref, "h": h_ref}, context=name)


def test_options_checked():
    with pytest.raises(ValueError, match="expand"):
        layers.build("mingru", D_MODEL, expand=0)
