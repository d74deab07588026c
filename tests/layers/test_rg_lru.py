"""Griffin's recurrent block (RG-LRU) against a per-step loop written from the paper's section 2.4
and the official recurrentgemma torch block: linear x / y branches, width-4 temporal conv,
block-diagonal sigmoid gates, a_t = a^(8 r_t) with log a = -softplus(Lambda), input normalised by
sqrt(1 - a_t^2) except at the sequence's first token, tanh-GeLU gate, output projection."""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import assert_close, gradients


def make(d_model=16, seed=0, **options):
    torch.manual_seed(seed)
    mixer = layers.build("rg_lru", d_model, **options).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mixer


def block_gate(u, w, b):
    G, bw, _ = w.shape
    return torch.sigmoid(torch.cat([u[:, g * bw : (g + 1) * bw] @ w[g] + b[g] for g in range(G)], -1))


def reference(m, x):
    B, T, _ = x.shape
    W = m.conv_width
    xb = x @ m.linear_x.weight.t() + m.linear_x.bias
    h = x.new_zeros(B, m.lru_width)
    ys = []
    for t in range(T):
        u = m.conv1d.bias + sum(m.conv1d.weight[:, 0, W - 1 - k] * xb[:, t - k] for k in range(W) if t - k >= 0)
        r = block_gate(u, m.gate_a_w, m.gate_a_b)
        i = block_gate(u, m.gate_x_w, m.gate_x_b)
        a = torch.sigmoid(-m.a_param) ** (8 * r)  # exp(-softplus(L)) = sigmoid(-L)
        norm = torch.ones_like(a) if t == 0 else torch.sqrt(1 - a**2)
        h = a * h + norm * i * u
        gate = F.gelu(x[:, t] @ m.linear_y.weight.t() + m.linear_y.bias, approximate="tanh")
        ys.append((h * gate) @ m.linear_out.weight.t() + m.linear_out.bias)
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("options", [{}, {"num_heads": 2, "lru_width": 24}])
def test_forward_equals_per_step_rg_lru(options):
    # T = 80 crosses the EOS op's default chunk boundary (64).
    m = make(**options)
    x = torch.randn(2, 80, 16, dtype=torch.float64, requires_grad=True)
    wrt = {"x": x, **dict(m.named_parameters())}
    y, state = m(x, return_state=True)
    y_ref, h_ref = reference(m, x)
    errors = assert_close(
        gradients({"y": y, "h": state.memory[:, 0, 0]}, wrt), gradients({"y": y_ref, "h": h_ref}, wrt)
    )
    print("rg_lru vs per-step loop", options, errors)
    assert state.position.tolist() == [80, 80]


def test_only_the_first_token_of_a_sequence_is_unnormalised():
    # Continuing from a state normalises the next token; init_state (position 0) starts afresh.
    m = make()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    _, s = m(x[:, :3], return_state=True)
    fresh = m(x[:, 3:], state=m.init_state(1))
    assert_close({"y": fresh}, {"y": m(x[:, 3:])})
    carried = m(x[:, 3:], state=s)
    assert not torch.allclose(carried, m(x[:, 3:], state=type(s)(s.conv, s.memory, torch.zeros_like(s.position))))


def test_inits_follow_official():
    m = layers.build("rg_lru", 64)
    a = torch.sigmoid(-m.a_param.double())
    assert bool(((a**2 >= 0.81) & (a**2 <= 0.999**2 + 1e-6)).all())
    assert abs(m.linear_x.weight.std().item() - 64**-0.5) < 0.02
    assert abs(m.conv1d.weight.std().item() - (0.01 / 4) ** 0.5) < 0.02
    assert m.gate_x_w.shape == (4, 16, 16)


def test_sqrt_gradient_is_bounded():
    # a_t -> 1 (Lambda very negative): d sqrt(1 - a^2) would be unbounded; the official bound is 1000.
    m = make()
    with torch.no_grad():
        m.a_param.fill_(-30.0)
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    m(x).sum().backward()
    assert torch.isfinite(m.a_param.grad).all()


@pytest.mark.parametrize(
    "options, match",
    [
        ({"num_heads": 3}, r"^num_heads: expected a divisor of lru_width = 16, got 3"),
        ({"lru_width": 0}, r"^lru_width: expected an integer >= 1 or None, got 0"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        layers.build("rg_lru", 16, **options)
