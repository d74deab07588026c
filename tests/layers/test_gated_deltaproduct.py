"""Gated DeltaProduct against fla's layer written out (fla/layers/gated_deltaproduct.py, with its
recurrence as a loop here) on the mixer's weights, and that loop against fla-core's
naive_recurrent_gated_delta_product on the same inputs."""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import rel_rms

torch.manual_seed(0)


def product_loop(q, k, v, g, beta, scale):
    """q [B, T, H, K]; k [B, T, n, H, K]; v [B, T, n, H, D]; g [B, T, H] or None; beta [B, T, n, H].
    Per token: decay, then n_h factors S <- S + beta k (v - S^T k)^T; y = S^T q scale."""
    B, T, n, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    ys = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t, :, None, None].exp()
        for j in range(n):
            kj, vj, bj = k[:, t, j], v[:, t, j], beta[:, t, j]
            err = vj - torch.einsum("bhkd,bhk->bhd", S, kj)
            S = S + bj[..., None, None] * kj[..., None] * err[:, :, None, :]
        ys.append(torch.einsum("bhkd,bhk->bhd", S, q[:, t]) * scale)
    return torch.stack(ys, 1)


def fla_layer(m, x):
    """fla's GatedDeltaProduct.forward, written out with the mixer's weights; returns the output
    and the recurrence's inputs."""
    B, T, _ = x.shape
    H, K, D, n = m.heads, m.head_k, m.head_v, m.n
    W = m.conv_size
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], -1)
    u = F.conv1d(F.pad(qkv.transpose(1, 2), (W - 1, 0)), m.conv1d.weight, groups=qkv.shape[-1])
    q, k, v = F.silu(u.transpose(1, 2)).split([H * K, n * H * K, n * H * D], -1)
    q = F.normalize(q.reshape(B, T, H, K), dim=-1, eps=1e-6)
    k = F.normalize(k.reshape(B, T, n, H, K), dim=-1, eps=1e-6)
    v = v.reshape(B, T, n, H, D)
    beta = torch.sigmoid(m.b_proj(x)).reshape(B, T, n, H) * (2 if m.negative_eigenvalues else 1)
    g = -m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias) if m.forget_gate else None
    o = product_loop(q, k, v, g, beta, K**-0.5)
    o = F.rms_norm(o, (D,), m.o_norm, eps=1e-5) * F.silu(m.g_proj(x).reshape(B, T, H, D))
    return m.o_proj(o.reshape(B, T, H * D)), (q, k, v, g, beta)


@pytest.mark.parametrize("negative_eigenvalues, forget_gate", [(True, True), (False, True), (True, False)])
def test_gated_deltaproduct_matches_fla_layer_written_out(negative_eigenvalues, forget_gate):
    m = layers.build(
        "gated_deltaproduct",
        32,
        heads=4,
        num_householder=3,
        negative_eigenvalues=negative_eigenvalues,
        forget_gate=forget_gate,
    ).double()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    err = rel_rms(m(x), fla_layer(m, x)[0])
    print(f"relative RMS error {err:.2e}")
    assert err < 1e-12, err


def test_gated_deltaproduct_loop_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    m = layers.build("gated_deltaproduct", 32, heads=4, num_householder=3)
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        _, (q, k, v, g, beta) = fla_layer(m.double(), x.double())
        ours = product_loop(q, k, v, g, beta, 8**-0.5)
        B, T, n, H, K = k.shape
        # fla's layout: the n_h factors of token t at rows t n .. t n + n - 1 (float32 inside).
        ref, _ = naive.naive_recurrent_gated_delta_product(
            q.float(),
            k.reshape(B, T * n, H, K).float(),
            v.reshape(B, T * n, H, -1).float(),
            g.float(),
            beta.reshape(B, T * n, H).float(),
            scale=K**-0.5,
            num_householder=n,
        )
    err = rel_rms(ref.double(), ours)
    print(f"relative RMS error {err:.2e}")
    assert err < 1e-5, err
