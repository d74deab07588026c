"""LRU against the paper's appendix A listing (Orvieto et al. 2023, ``forward_LRU``) written out as
a per-step complex loop: Lambda = exp(-exp(nu_log) + i exp(theta_log)), B_norm = (B_re + i B_im)
exp(gamma_log), h_t = Lambda h_{t-1} + B_norm x_t, y_t = Re(C h_t) + D x_t; and the ring init."""

import math

import pytest
import torch

from lcsm import layers
from lcsm.testing import assert_close, gradients


def make(d_model=16, seed=0, **options):
    torch.manual_seed(seed)
    mixer = layers.build("lru", d_model, **options).double()
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            # nu_log and theta_log moved less: |lambda| stays inside the unit disc and near it.
            p.add_((0.05 if name in ("nu_log", "theta_log") else 0.3) * torch.randn_like(p))
    return mixer


def reference(m, x, h=None):
    lam = torch.exp(torch.complex(-torch.exp(m.nu_log), torch.exp(m.theta_log)))
    B_norm = torch.complex(m.B_re, m.B_im) * torch.exp(m.gamma_log)[:, None]
    C = torch.complex(m.C_re, m.C_im)
    h = x.new_zeros(x.shape[0], m.d_state, dtype=torch.complex128) if h is None else h
    ys = []
    for t in range(x.shape[1]):
        h = lam * h + x[:, t].to(h.dtype) @ B_norm.t()
        ys.append((h @ C.t()).real + m.D * x[:, t])
    return torch.stack(ys, 1), h


@pytest.mark.parametrize("d_state", [64, 8])
def test_forward_equals_appendix_listing(d_state):
    # T = 80 crosses the EOS op's default chunk boundary (64).
    m = make(d_state=d_state)
    x = torch.randn(2, 80, 16, dtype=torch.float64, requires_grad=True)
    wrt = {"x": x, **dict(m.named_parameters())}
    y, state = m(x, return_state=True)
    y_ref, h_ref = reference(m, x)
    errors = assert_close(
        gradients({"y": y, "h": state.memory[:, 0, 0]}, wrt), gradients({"y": y_ref, "h": h_ref}, wrt)
    )
    print("lru vs appendix A listing", d_state, errors)


def test_ring_init():
    torch.manual_seed(0)
    m = layers.build("lru", 16, d_state=4096, r_min=0.4, r_max=0.9, max_phase=math.pi)
    r = torch.exp(-torch.exp(m.nu_log.double()))
    assert bool(((r >= 0.4 - 1e-6) & (r <= 0.9 + 1e-6)).all())
    # Uniform on the ring in area: r^2 ~ U[r_min^2, r_max^2], mean (0.16 + 0.81) / 2.
    assert abs((r**2).mean().item() - 0.485) < 0.01
    theta = torch.exp(m.theta_log.double())
    assert bool(((theta >= 0) & (theta <= math.pi + 1e-6)).all()) and abs(theta.mean().item() - math.pi / 2) < 0.05
    assert_close({"gamma": torch.exp(m.gamma_log)}, {"gamma": torch.sqrt(1 - r**2)}, dtype=torch.float32)
    assert abs(m.B_re.std().item() - (2 * 16) ** -0.5) < 0.01 and abs(m.C_re.std().item() - 4096**-0.5) < 0.002


@pytest.mark.parametrize(
    "options, match",
    [
        ({"r_min": 0.95, "r_max": 0.9}, r"^r_min, r_max: expected r_min <= r_max, got 0.95 > 0.9"),
        ({"r_max": 1.0}, r"^r_max: expected a number in \(0, 1\), got 1.0"),
        ({"max_phase": 0.0}, r"^max_phase: expected a positive finite number, got 0.0"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        layers.build("lru", 16, **options)


def test_no_weight_decay_tags():
    # the eigenvalue parameters and the skip gain; the projections B and C are decayed
    tagged = {n for n, p in layers.build("lru", 8).named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert tagged == {"nu_log", "theta_log", "gamma_log", "D"}
