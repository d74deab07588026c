"""Based's linear attention against its kernel written out as causal attention (weights
1 + s + s^2 / 2 on s = q.k / sqrt(F), normalised), in float64 with gradients, and against
fla-core's naive_parallel_based on the same projections (float64; its denominator eps is 1e-6)."""

import pytest
import torch

from lcsm import layers
from lcsm.layers.based import taylor_features
from lcsm.testing import assert_close, rel_rms

D_MODEL = 16


def make(seed=0, eps=1e-12):
    torch.manual_seed(seed)
    return layers.build("based", D_MODEL, num_heads=2, feature_dim=4, eps=eps).double()


def heads(t, H):
    return t.unflatten(-1, (H, -1)).transpose(1, 2)  # [B, H, T, X]


def formula(p, x, H, eps):
    q, k, v = (heads(x @ p[f"{n}_proj.weight"].T, H) for n in "qkv")
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    a = (1 + s + s**2 / 2).tril()
    y = (a @ v) / (a.sum(-1, keepdim=True) + eps)
    return y.transpose(1, 2).flatten(-2) @ p["o_proj.weight"].T


def test_feature_map_inner_product():
    a, b = torch.randn(2, 5, 3, dtype=torch.float64).unbind(0)
    s = (a * b).sum(-1) / 3**0.5
    assert_close({"k": (taylor_features(a) * taylor_features(b)).sum(-1)}, {"k": 1 + s + s**2 / 2})


def test_matches_formula_with_gradients():
    mixer = make()
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, requires_grad=True)
    out = mixer(x)
    params = {n: t.detach().clone().requires_grad_() for n, t in mixer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    ref = formula(params, x_ref, mixer.num_heads, 1e-12)
    assert_close({"y": out}, {"y": ref}, context="based formula")
    dy = torch.randn_like(out)
    names = ["x", *params]
    grads = torch.autograd.grad(out, [x, *mixer.parameters()], dy)
    grads_ref = torch.autograd.grad(ref, [x_ref, *params.values()], dy)
    assert_close(dict(zip(names, grads, strict=True)), dict(zip(names, grads_ref, strict=True)), context="grads")


def test_matches_fla_naive_parallel_based():
    naive = pytest.importorskip("fla.ops.based.naive")
    mixer = make(seed=1, eps=1e-6)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    H = mixer.num_heads
    with torch.no_grad():
        y, _ = mixer.eos_readout(x)
        o = naive.naive_parallel_based(heads(mixer.q_proj(x), H), heads(mixer.k_proj(x), H), heads(mixer.v_proj(x), H))
    assert rel_rms(y, o.transpose(1, 2)) < 1e-12
