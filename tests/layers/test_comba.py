"""Comba against its definition written out here and against fla-core 0.6.0's
``naive_recurrent_comba`` (same weights, same inputs)."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.layers import build
from lcsm.testing import rel_rms


def _written_out(q, k, v, p, beta, g):
    """S_t = alpha_t (I - beta_t k_t p_t^T) S_{t-1} + beta_t k_t v_t^T, y_t = S_t^T q_t K^-1/2."""
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    eye = torch.eye(K, dtype=q.dtype)
    ys = []
    for t in range(T):
        kt, pt, bt, at = k[:, t], p[:, t], beta[:, t, :, None, None], g[:, t, :, None, None].exp()
        S = at * (eye - bt * kt[..., :, None] * pt[..., None, :]) @ S + bt * kt[..., :, None] * v[:, t, :, None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q[:, t] * K**-0.5, S))
    return torch.stack(ys, 1)


def _layer_by_hand(layer, x, recurrence):
    def conv(w, t):
        return F.silu(F.conv1d(F.pad(t.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=w.shape[0]).transpose(1, 2))

    H, K, D = layer.heads, layer.head_k, layer.head_v
    q = conv(layer.q_conv, layer.q_proj(x)).unflatten(-1, (H, K))
    k = conv(layer.k_conv, layer.k_proj(x)).unflatten(-1, (H, K))
    v = conv(layer.v_conv, layer.v_proj(x)).unflatten(-1, (H, D))
    p = k * layer.decay.sigmoid()[:, None]
    q = q - layer.D[:, None] * p
    q, k, p = (F.normalize(t, dim=-1, eps=1e-6) for t in (q, k, p))
    beta = layer.b_proj(x).sigmoid()
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    y = recurrence(q, k, v, p, beta, g).to(x.dtype)
    y = F.rms_norm(y, (D,), layer.o_norm, eps=1e-5) * layer.g_proj(x).unflatten(-1, (H, D)).sigmoid()
    return layer.o_proj(y.flatten(-2))


def _setup():
    torch.manual_seed(0)
    layer = build("comba", 16, heads=2, head_k=4).double()
    with torch.no_grad():  # move D and the inner decay off their init so both enter the check
        layer.D.uniform_(0.2, 1.5)
        layer.decay.uniform_(-2, 2)
    return layer, torch.randn(2, 13, 16, dtype=torch.float64)


def test_comba_matches_written_out_recurrence():
    layer, x = _setup()
    assert rel_rms(layer(x), _layer_by_hand(layer, x, _written_out)) < 1e-12


def test_comba_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.comba.naive")
    layer, x = _setup()

    def fla_recurrence(q, k, v, p, beta, g):
        return naive.naive_recurrent_comba(q, k, v, p, beta, g)[0]

    err = rel_rms(layer(x), _layer_by_hand(layer, x, fla_recurrence))
    print(f"comba vs fla naive_recurrent_comba: rel RMS {err:.2e}")
    # fla's naive reference computes in float32 whatever the input dtype.
    assert err < 1e-5
