"""HGRN2 against its formula written out token by token (float64, with gradients) and against
fla-core's naive GLA recurrence with the key tied to the forget gate (fla's HGRN2Attention on the
same weights: q = swish(q_proj x), g = log f, k = 1 - f, RMSNorm, o_proj)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers.hgrn2 import HGRN2
from lcsm.testing import assert_close, rel_rms

D_MODEL = 16


def make(lower_bound, seed=0):
    torch.manual_seed(seed)
    mixer = layers.build("hgrn2", D_MODEL, num_heads=2, lower_bound=lower_bound).double()
    with torch.no_grad():
        mixer.norm_weight.add_(0.1 * torch.randn_like(mixer.norm_weight))
    return mixer


def formula(p, x, H, gamma, eps=1e-5):
    B, T, C = x.shape
    K = C // H
    f = gamma + (1 - gamma) * torch.sigmoid(x @ p["f_proj.weight"].T)
    q = F.silu(x @ p["q_proj.weight"].T) / math.sqrt(K)
    v = x @ p["i_proj.weight"].T
    f, q, v = (t.view(B, T, H, K) for t in (f, q, v))
    S = x.new_zeros(B, H, K, K)
    ys = []
    for t in range(T):
        S = f[:, t, :, :, None] * S + (1 - f[:, t, :, :, None]) * v[:, t, :, None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q[:, t], S))
    y = torch.stack(ys, 1).reshape(B, T, C)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * p["norm_weight"]
    return y @ p["o_proj.weight"].T, S


@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_matches_formula_with_gradients(gamma):
    mixer = make(gamma)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, requires_grad=True)
    out, state = mixer(x, return_state=True)
    params = {n: t.detach().clone().requires_grad_() for n, t in mixer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    ref, S = formula(params, x_ref, mixer.num_heads, gamma)
    assert_close({"y": out, "state": state.memory}, {"y": ref, "state": S}, context=f"hgrn2 gamma={gamma}")
    dy = torch.randn_like(out)
    names = ["x", *params]
    grads = torch.autograd.grad(out, [x, *mixer.parameters()], dy)
    grads_ref = torch.autograd.grad(ref, [x_ref, *params.values()], dy)
    assert_close(dict(zip(names, grads, strict=True)), dict(zip(names, grads_ref, strict=True)), context="hgrn2 grads")


@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_matches_fla_naive_gla(gamma):
    """fla's naive GLA computes in float32 and scales q by K^-1/2 itself."""
    naive = pytest.importorskip("fla.ops.gla.naive")
    mixer = make(gamma, seed=1)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    H, K = mixer.num_heads, mixer.head_k
    with torch.no_grad():
        out = mixer(x)
        log_f, k = mixer.log_forget(x)
        q = F.silu(mixer.q_proj(x))
        v = mixer.i_proj(x)
        o, _ = naive.naive_recurrent_gla(*(t.view(2, 13, H, K) for t in (q, k, v, log_f)))
        y = o.double().reshape(2, 13, D_MODEL)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * mixer.norm_weight
        ref = mixer.o_proj(y)
    err = rel_rms(out, ref)
    assert err < 1e-5, err


def test_layer_options_set_the_bound():
    assert HGRN2.layer_options({}, 3, 4) == {"lower_bound": 0.75}
    assert HGRN2.layer_options({"lower_bound": 0.1}, 3, 4) == {"lower_bound": 0.1}
