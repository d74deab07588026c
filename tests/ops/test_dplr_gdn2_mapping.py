"""GDN-2's recurrence (fla-core 0.6.0 fla/ops/gdn2/naive.py) as an eos_dplr configuration:

    S_t = (I - k (b * k)^T) D(alpha) S_{t-1} + k (w * v)^T
        = (D(alpha) - k (alpha * b * k)^T) S_{t-1} + k (w * v)^T

i.e. log_alpha = g [B, T, H, K], a = k, b = alpha * b * k, e = k, i = w * v, s = q K^-1/2."""

import pytest
import torch

from lcsm.ops import eos_dplr
from lcsm.testing import rel_rms


def _inputs():
    torch.manual_seed(0)
    B, T, H, K, V = 2, 9, 2, 4, 3
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, dtype=torch.float64)
    b, w = torch.rand(B, T, H, K, dtype=torch.float64), torch.rand(B, T, H, V, dtype=torch.float64)
    return q, k, v, g, b, w


def _as_dplr(q, k, v, g, b, w):
    return eos_dplr(w * v, k, q * q.shape[-1] ** -0.5, k, g.exp() * b * k, g, output_final_state=True)


def test_gdn2_written_out():
    q, k, v, g, b, w = _inputs()
    S = torch.zeros(2, 2, 4, 3, dtype=torch.float64)
    ys = []
    for t in range(q.shape[1]):
        kt = k[:, t]
        trans = torch.eye(4, dtype=torch.float64) - kt[..., :, None] * (b[:, t] * kt)[..., None, :]
        S = trans @ (g[:, t].exp()[..., None] * S) + kt[..., :, None] * (w[:, t] * v[:, t])[..., None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q[:, t] * 0.5, S))
    y, m = _as_dplr(q, k, v, g, b, w)
    assert rel_rms(y, torch.stack(ys, 1)) < 1e-12 and rel_rms(m, S) < 1e-12


def test_gdn2_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.gdn2.naive")
    q, k, v, g, b, w = _inputs()
    y_ref, m_ref = naive.naive_recurrent_gdn2(q, k, v, g, b, w, output_final_state=True)
    y, m = _as_dplr(q, k, v, g, b, w)
    err = max(rel_rms(y, y_ref.double()), rel_rms(m, m_ref.double()))
    print(f"gdn2 recurrence vs fla naive_recurrent_gdn2: rel RMS {err:.2e}")
    # fla's naive reference computes in float32.
    assert err < 1e-5
