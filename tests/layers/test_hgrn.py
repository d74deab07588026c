"""HGRN-1 against its explicit complex elementwise recurrence (Qin et al. 2023, section 3,
h_t = lambda_t e^{i theta} h_{t-1} + (1 - lambda_t) c_t), and the forget-gate lower bound."""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers.hgrn import HGRN
from lcsm.testing import assert_close, assert_matches_reference

D_MODEL = 8


def make(lower_bound=0.0, seed=0):
    torch.manual_seed(seed)
    mixer = layers.build("hgrn", D_MODEL, lower_bound=lower_bound).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
        mixer.theta.mul_(5.0)  # rotations large enough that a sign slip would show
    return mixer


def reference(mixer, x):
    """Step-by-step complex recurrence, output gate on [Re h, Im h], LayerNorm, projection."""
    B, T, d = x.shape
    gamma = mixer.lower_bound
    rot = torch.exp(1j * mixer.theta.to(torch.complex128))
    h = torch.zeros(B, d, dtype=torch.complex128)
    outs = []
    for t in range(T):
        xt = x[:, t]
        c = F.silu(mixer.input_proj(xt)).reshape(B, d, 2)  # real / imaginary interleaved
        c = c[..., 0] + 1j * c[..., 1]
        lam = gamma + (1 - gamma) * torch.sigmoid(mixer.lambda_proj(xt))
        h = lam * rot * h + (1 - lam) * c
        feature = torch.cat([h.real, h.imag], -1) * torch.sigmoid(mixer.gate(xt))
        feature = F.layer_norm(feature, (2 * d,), mixer.norm.weight, mixer.norm.bias, mixer.norm.eps)
        outs.append(mixer.out_proj(feature))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("lower_bound", [0.0, 0.6])
def test_forward_equals_complex_recurrence(lower_bound):
    # T = 70 crosses the EOS op's default chunk boundary (64).
    mixer = make(lower_bound)
    x = torch.randn(2, 70, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_matches_reference(mixer, x, lambda x: reference(mixer, x), f"hgrn, gamma={lower_bound}")


def test_lower_bound_is_respected():
    gamma = 0.7
    mixer = make(gamma)
    x = torch.randn(2, 16, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mixer.lambda_proj.bias.fill_(-60.0)  # forget gate mu_t -> 0
        log_lam, one_minus = mixer.log_forget(x)
    lam = log_lam.exp()
    assert (lam >= gamma * (1 - 1e-12)).all(), lam.min()
    assert (lam - gamma).abs().max() < 1e-6, "with mu_t -> 0, lambda_t must sit on the bound"
    assert_close({"1-lambda": one_minus}, {"1-lambda": 1 - lam}, context="expand state")
    # without a bound the same gate lets lambda_t collapse towards 0
    free = make(0.0)
    with torch.no_grad():
        free.lambda_proj.bias.fill_(-60.0)
        assert free.log_forget(x)[0].exp().max() < 1e-6


def test_alias_and_bad_options():
    assert isinstance(layers.build("lrn", D_MODEL), HGRN)
    for bad in (1.0, -0.1, "0.5"):
        with pytest.raises(ValueError, match="^lower_bound:"):
            layers.build("hgrn", D_MODEL, lower_bound=bad)


def test_complex_state_and_weight_decay_tags():
    mixer = layers.build("hgrn", D_MODEL)
    assert mixer.init_state(3).memory.dtype == torch.complex64
    assert mixer.double().init_state(3).memory.dtype == torch.complex128
    for p in (mixer.theta, mixer.norm.weight, mixer.lambda_proj.bias):
        assert getattr(p, "_no_weight_decay", False)
    assert not getattr(mixer.input_proj.weight, "_no_weight_decay", False)
