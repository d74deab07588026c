"""GDN-2 against fla-core 0.6.0's layer (``fla/layers/gdn2.py``) written out here on the same weights
in float64, and its recurrence against fla's ``naive_recurrent_gdn2`` fed the layer's own
intermediate tensors (fla's layer itself runs only its Triton kernels, on a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.layers import build
from lcsm.testing import rel_rms


def _recurrence_written_out(q, k, v, g, b, w):
    """S_t = (I - k_t (b_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T, o_t = S_t^T q_t K^-1/2."""
    B, T, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    eye = torch.eye(K, dtype=q.dtype)
    ys = []
    for t in range(T):
        kt = k[:, t]
        erase = eye - kt[..., :, None] * (b[:, t] * kt)[..., None, :]
        S = erase @ (g[:, t].exp()[..., None] * S) + kt[..., :, None] * (w[:, t] * v[:, t])[..., None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q[:, t] * K**-0.5, S))
    return torch.stack(ys, 1), S


def _layer_by_hand(layer, x, recurrence):
    """fla's GatedDeltaNet2.forward (fla-core 0.6.0) step by step, with ``recurrence`` in place of its
    kernels: q, k, v through conv + SiLU, g, b, w, the grouped-value-head broadcast, the L2 norm of
    q and k (use_qk_l2norm_in_kernel), the recurrence, the sigmoid-gated RMSNorm and o_proj."""

    def conv(c, t):
        y = F.conv1d(F.pad(t.transpose(1, 2), (c.weight.shape[-1] - 1, 0)), c.weight, c.bias, groups=t.shape[-1])
        return F.silu(y.transpose(1, 2))

    H, HV, K, D = layer.num_heads, layer.num_v_heads, layer.head_k, layer.head_v
    q = conv(layer.q_conv1d, layer.q_proj(x)).unflatten(-1, (H, K))
    k = conv(layer.k_conv1d, layer.k_proj(x)).unflatten(-1, (H, K))
    v = conv(layer.v_conv1d, layer.v_proj(x)).unflatten(-1, (HV, D))
    g = F.softplus(layer.f_proj(x) + layer.dt_bias).unflatten(-1, (H, K))
    g = -layer.A_log.exp()[:, None] * g
    b = layer.b_proj(x).sigmoid().unflatten(-1, (H, K))
    w = layer.w_proj(x).sigmoid().unflatten(-1, (HV, D))
    q, k, g, b = (t.repeat_interleave(HV // H, dim=2) for t in (q, k, g, b))
    if layer.negative_eigenvalues:
        b = b * 2
    q, k = (t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    o, S = recurrence(q, k, v, g, b, w)
    o = F.rms_norm(o.to(x.dtype), (D,), layer.o_norm, eps=1e-5)
    o = o * layer.g_proj(x).unflatten(-1, (HV, D)).sigmoid()
    return layer.o_proj(o.flatten(-2)), S


CASES = {
    "default": {},
    "grouped_values_neg_eig": {"num_v_heads": 4, "expand_v": 2.0, "negative_eigenvalues": True, "conv_bias": True},
}


def _setup(options):
    torch.manual_seed(0)
    layer = build("gdn2", 16, num_heads=2, **options).double()
    with torch.no_grad():  # the RMSNorm weight off its init of ones, so that it enters the check
        layer.o_norm.uniform_(0.5, 1.5)
    return layer, torch.randn(2, 13, 16, dtype=torch.float64)


@pytest.mark.parametrize("case", CASES)
def test_gdn2_matches_fla_layer_written_out(case):
    layer, x = _setup(CASES[case])
    y, state = layer(x, return_state=True)
    y_ref, S_ref = _layer_by_hand(layer, x, _recurrence_written_out)
    assert rel_rms(y, y_ref) < 1e-12 and rel_rms(state.memory, S_ref) < 1e-12


@pytest.mark.parametrize("case", CASES)
def test_gdn2_recurrence_matches_fla_naive(case):
    naive = pytest.importorskip("fla.ops.gdn2.naive")
    layer, x = _setup(CASES[case])
    B, T, _ = x.shape
    row = x.reshape(1, B * T, -1)
    docs = torch.arange(B + 1) * T
    q, k, v, g, b, w, _ = layer.recurrence_inputs(row, docs)
    o, m = layer.recurrence(q, k, v, g, b, w, docs)
    split = [t.reshape(B, T, *t.shape[2:]) for t in (q, k, v, g, b, w)]
    o_ref, m_ref = naive.naive_recurrent_gdn2(*split, output_final_state=True)
    err_o, err_m = rel_rms(o.reshape(B, T, *o.shape[2:]), o_ref.double()), rel_rms(m, m_ref.double())

    def fla_recurrence(*args):
        return naive.naive_recurrent_gdn2(*args, output_final_state=True)

    err_y = rel_rms(layer(x), _layer_by_hand(layer, x, fla_recurrence)[0])
    print(f"gdn2 [{case}] vs fla naive_recurrent_gdn2: o {err_o:.2e}, state {err_m:.2e}, layer output {err_y:.2e}")
    # fla's naive reference computes in float32 whatever the input dtype.
    assert max(err_o, err_m, err_y) < 1e-5
