"""Lightning Attention against its formula written out token by token (MiniMax-01's layer: SiLU
on the fused q/k/v projection, exp(-slope) per head, RMSNorm, sigmoid output gate), in float64
with gradients, and its recurrence against fla-core's naive simple-GLA recurrence (a per-head
scalar decay) on the same q, k, v and decays."""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers.lightning import alibi_slopes
from lcsm.testing import assert_close, rel_rms

D_MODEL = 16


def make(seed=0, layer_id=1, n_layers=3, num_heads=4):
    torch.manual_seed(seed)
    mixer = layers.build("lightning", D_MODEL, num_heads=num_heads, layer_id=layer_id, n_layers=n_layers).double()
    with torch.no_grad():
        mixer.norm_weight.add_(0.1 * torch.randn_like(mixer.norm_weight))
    return mixer


def formula(p, x, H, layer_id, n_layers, eps=1e-6):
    B, T, C = x.shape
    D = C // H
    qkv = F.silu(x @ p["qkv_proj.weight"].T).view(B, T, H, 3 * D)
    q, k, v = qkv[..., :D], qkv[..., D : 2 * D], qkv[..., 2 * D :]
    slope = torch.tensor(alibi_slopes(H), dtype=x.dtype) * (1 - layer_id / (n_layers - 1) + 1e-5)
    lam = torch.exp(-slope)[None, :, None, None]
    S = x.new_zeros(B, H, D, D)
    ys = []
    for t in range(T):
        S = lam * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q[:, t], S))
    y = torch.stack(ys, 1).reshape(B, T, C)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * p["norm_weight"]
    return (torch.sigmoid(x @ p["output_gate.weight"].T) * y) @ p["o_proj.weight"].T, S


def test_alibi_slopes():
    assert alibi_slopes(4) == [2**-2, 2**-4, 2**-6, 2**-8]
    # not a power of two: the 4 slopes of 4 heads, then every other one of 8 heads
    assert alibi_slopes(6) == [*alibi_slopes(4), 2**-1, 2**-3]
    assert math.isclose(alibi_slopes(1)[0], 2**-8)


def test_matches_formula_with_gradients():
    mixer = make()
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64, requires_grad=True)
    out, state = mixer(x, return_state=True)
    params = {n: t.detach().clone().requires_grad_() for n, t in mixer.named_parameters()}
    x_ref = x.detach().clone().requires_grad_()
    ref, S = formula(params, x_ref, mixer.num_heads, 1, 3)
    assert_close({"y": out, "state": state.memory}, {"y": ref, "state": S}, context="lightning formula")
    dy = torch.randn_like(out)
    names = ["x", *params]
    grads = torch.autograd.grad(out, [x, *mixer.parameters()], dy)
    grads_ref = torch.autograd.grad(ref, [x_ref, *params.values()], dy)
    assert_close(dict(zip(names, grads, strict=True)), dict(zip(names, grads_ref, strict=True)), context="grads")


def test_single_layer_and_last_layer_decays():
    assert make(layer_id=0, n_layers=1).slopes == tuple(a * (1 + 1e-5) for a in alibi_slopes(4))
    assert make(layer_id=2, n_layers=3).slopes == tuple(a * 1e-5 for a in alibi_slopes(4))


def test_recurrence_matches_fla_naive_simple_gla():
    """fla's naive computes in float32; scale 1 (MiniMax has no query scale)."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    mixer = make(seed=1)
    x = torch.randn(2, 13, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        v, k, q, log_decay = mixer.eos_inputs(x)
        y, memory = mixer.eos_readout(x)
        g = log_decay.view(1, 1, -1).expand(2, 13, -1)
        o, S = naive.naive_recurrent_simple_gla(q, k, v, g, scale=1.0, output_final_state=True)
    assert rel_rms(y, o.double()) < 1e-5
    assert rel_rms(memory, S.double()) < 1e-5
