"""RWKV-6 time mixing against its formula written out (RWKV_Tmix_x060: ddlerp, LoRA decay,
per-step WKV with the bonus, GroupNorm with eps 1e-5 * divisor^2, SiLU gate), in float64, and its
recurrence against fla-core's naive RWKV-6 reference on the same r, k, v, w, u."""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import assert_close, rel_rms

D_MODEL = 16


def make(seed=0):
    torch.manual_seed(seed)
    mixer = layers.build("rwkv6", D_MODEL, num_heads=2, mix_rank=4, decay_rank=8, layer_id=1, n_layers=3).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def formula(p, x, H):
    """The layer written out token by token, on a dict of float64 parameters."""
    B, T, C = x.shape
    K = C // H
    xx = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1) - x
    lora = torch.tanh((x + xx * p["maa_x"]) @ p["maa_w1"]).view(B, T, 5, -1)
    m = [lora[:, :, j] @ p["maa_w2"][j] for j in range(5)]
    xw, xk, xv, xr, xg = (x + xx * (p[f"maa_{c}"] + m[j]) for j, c in enumerate("wkvrg"))
    r, k, v = xr @ p["receptance.weight"].T, xk @ p["key.weight"].T, xv @ p["value.weight"].T
    g = F.silu(xg @ p["gate.weight"].T)
    w = torch.exp(-torch.exp(p["time_decay"] + torch.tanh(xw @ p["decay_w1"]) @ p["decay_w2"]))
    r, k, v, w = (t.view(B, T, H, K) for t in (r, k, v, w))
    u = p["time_faaaa"].view(H, K)
    S = x.new_zeros(B, H, K, K)
    ys = []
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", r[:, t], S + u[..., None] * kv))
        S = w[:, t, :, :, None] * S + kv
    y = torch.stack(ys, 1).reshape(B * T, C)
    y = F.group_norm(y, H, p["ln_weight"], p["ln_bias"], eps=1e-5 * 8.0**2).view(B, T, C)
    return (y * g) @ p["output.weight"].T, S


def test_matches_formula_with_gradients():
    mixer = make()
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, requires_grad=True)
    out, state = mixer(x, return_state=True)
    params = {n: t.detach().clone().requires_grad_() for n, t in mixer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    ref, S = formula(params, x_ref, mixer.num_heads)
    assert_close({"y": out, "state": state.memory}, {"y": ref, "state": S}, context="rwkv6 formula")
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *mixer.parameters()], dy)
    grads_ref = torch.autograd.grad(ref, [x_ref, *params.values()], dy)
    names = ["x", *params]
    assert_close(
        dict(zip(names, grads, strict=True)),
        dict(zip(names, grads_ref, strict=True)),
        context="rwkv6 formula gradients",
    )


def test_recurrence_matches_fla_naive():
    """The layer's r, k, v, w, u through fla-core's naive RWKV-6 recurrence (which computes in
    float32: compared at float32 accuracy) give the layer's y before the norm."""
    naive = pytest.importorskip("fla.ops.rwkv6.recurrent_naive")
    mixer = make(seed=1)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    H, K = mixer.num_heads, mixer.head_size
    with torch.no_grad():
        r, k, v, g, log_w = mixer._mix(x, None, None)
        mixer_out = mixer(x)

    def heads_first(t):
        return t.view(2, 13, H, K).transpose(1, 2)

    o, _ = naive.naive_recurrent_rwkv6(
        *(heads_first(t) for t in (r, k, v, log_w)),
        mixer.time_faaaa.detach().view(H, K),
        scale=1.0,
    )
    y = o.transpose(1, 2).double().reshape(2 * 13, D_MODEL)
    y = F.group_norm(y, H, mixer.ln_weight.detach(), mixer.ln_bias.detach(), eps=mixer.norm_eps).view(2, 13, D_MODEL)
    with torch.no_grad():
        ref = mixer.output(y * g)
    err = rel_rms(mixer_out, ref)
    assert err < 1e-5, err
