"""mLSTM against the official stabilised recurrence written out step by step (Beck et al. 2024;
the formula of NX-AI/mlstm_kernels ``recurrent/native_step.py`` and xlstm
``blocks/mlstm/backends.py`` ``recurrent_step_stabilized_simple``):

    m_t = max(log sigmoid(f~_t) + m_{t-1}, i~_t)
    C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) (k_t / sqrt(d)) v_t^T, n_t likewise
    h_t = C_t^T q_t / (max(|n_t^T q_t|, exp(-m_t)) + eps)

around the original xLSTM mLSTM layer, in float64: outputs, final state (C, n, m, conv window) and
every gradient, with gates spread so that the max-stabiliser, the exp(-m_t) floor and the eps term
all act."""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers.mlstm import EPS, NORM_EPS
from lcsm.testing import assert_close, assert_matches_reference

D_MODEL = 8


def make(seed=0, gate_scale=25.0, **options):
    torch.manual_seed(seed)
    mixer = layers.build("mlstm", D_MODEL, **options).double()
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
        # Input-gate pre-activations over about +-20 (m_t large: exp(-m_t) below eps; negative:
        # the floor binds), forget gates from nearly closed to nearly open.
        mixer.igate.weight.normal_(0.0, gate_scale / math.sqrt(mixer.igate.in_features))
        mixer.fgate.weight.normal_(0.0, gate_scale / math.sqrt(mixer.fgate.in_features))
    return mixer


def stepwise_cell(q, k, v, i, f, state=None):
    """The official recurrent step, token by token. q, k, v [B, T, H, d]; i, f [B, T, H] (pre-
    activations). state (C [B, H, d, d], n [B, H, d], m [B, H]) or None (zeros, m_0 = 0)."""
    B, T, H, d = q.shape
    if state is None:
        C, n, m = q.new_zeros(B, H, d, d), q.new_zeros(B, H, d), q.new_zeros(B, H)
    else:
        C, n, m = state
    hs = []
    for t in range(T):
        log_f = F.logsigmoid(f[:, t])
        m_new = torch.maximum(log_f + m, i[:, t])
        fa, ia = torch.exp(log_f + m - m_new), torch.exp(i[:, t] - m_new)
        ks = k[:, t] / math.sqrt(d)
        C = fa[..., None, None] * C + ia[..., None, None] * ks[..., :, None] * v[:, t, :, None, :]
        n = fa[..., None] * n + ia[..., None] * ks
        num = torch.einsum("bhk,bhkd->bhd", q[:, t], C)
        qn = torch.einsum("bhk,bhk->bh", q[:, t], n)
        hs.append(num / (torch.maximum(qn.abs(), torch.exp(-m_new)) + EPS)[..., None])
        m = m_new
    return torch.stack(hs, 1), (C, n, m)


def layer_reference(mixer, x, cell=stepwise_cell, conv_history=None, cell_state=None):
    """The original layer around ``cell``, written out: up-projection, causal conv + SiLU,
    block-diagonal q/k/v, gates from [q, k, v], cell, per-head LayerNorm (weight 1 + w), skip,
    SiLU(z) gate, down-projection. Returns (out, cell's extra return, last conv inputs)."""
    B, T, _ = x.shape
    H, d, inner, W = mixer.heads, mixer.head_dim, mixer.inner, mixer.d_conv
    x_m, z = (x @ mixer.up_proj.weight.T).split(inner, dim=-1)
    hist = x.new_zeros(B, W - 1, inner) if conv_history is None else conv_history
    full = torch.cat([hist, x_m], 1)
    w = mixer.conv1d.weight[:, 0]  # [inner, W]
    conv = torch.stack([(full[:, t : t + W] * w.T).sum(1) for t in range(T)], 1) + mixer.conv1d.bias
    c = F.silu(conv)

    def blockdiag(u, blocks):
        nb, bs, _ = blocks.shape
        return torch.cat([u[..., j * bs : (j + 1) * bs] @ blocks[j].T for j in range(nb)], -1)

    q, k, v = blockdiag(c, mixer.q_blocks), blockdiag(c, mixer.k_blocks), blockdiag(x_m, mixer.v_blocks)
    qkv = torch.cat([q, k, v], -1)
    i = qkv @ mixer.igate.weight.T + mixer.igate.bias
    f = qkv @ mixer.fgate.weight.T + mixer.fgate.bias

    def split(t):
        return t.view(B, T, H, d)

    h, extra = cell(split(q), split(k), split(v), i, f, cell_state)
    mu = h.mean(-1, keepdim=True)
    var = h.var(-1, unbiased=False, keepdim=True)
    h = ((h - mu) / torch.sqrt(var + NORM_EPS)).reshape(B, T, inner) * (1 + mixer.norm_weight)
    out = ((h + mixer.skip * c) * F.silu(z)) @ mixer.down_proj.weight.T
    return out, extra, full[:, -(W - 1) :]


def test_gates_reach_every_regime():
    """The test's gate spread does exercise the stabiliser's regimes (else the comparison below
    would not check them)."""
    mixer = make()
    x = torch.randn(2, 40, D_MODEL, dtype=torch.float64)
    seen = {}

    def spy(q, k, v, i, f, state):
        seen["i"] = i
        return stepwise_cell(q, k, v, i, f, state)

    layer_reference(mixer, x, spy)
    i = seen["i"]
    assert i.max() > -math.log(EPS) and i.min() < -5


# Not T = 1: from an empty memory the forget gate's only effect on a first token is through the
# eps term (gradient ~1e-11), whose float64 rounding (~1e-19) is then 5e-9 of it, above the
# relative tolerance though exact in absolute terms.
@pytest.mark.parametrize("T", [2, 37, 70])
def test_matches_stepwise_recurrence(T):
    mixer = make()
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64)
    assert_matches_reference(mixer, x, lambda x: layer_reference(mixer, x)[0], f"mlstm T={T}")


def test_final_and_carried_state():
    mixer = make(seed=1, heads=2, expand=1, d_conv=3, qkv_blocksize=2)
    B, H, d = 3, mixer.heads, mixer.head_dim
    x = torch.randn(B, 25, D_MODEL, dtype=torch.float64)
    C0, n0 = torch.randn(B, H, d, d, dtype=torch.float64), torch.randn(B, H, d, dtype=torch.float64)
    m0 = 3 * torch.randn(B, H, dtype=torch.float64)
    hist = torch.randn(B, mixer.d_conv - 1, mixer.inner, dtype=torch.float64)
    state = mixer.init_state(B)
    state.conv, state.scale = hist, m0
    state.memory = torch.cat([C0, n0[..., None]], -1)
    y, out = mixer(x, state=state, return_state=True)
    y_ref, (C, n, m), conv_ref = layer_reference(mixer, x, conv_history=hist, cell_state=(C0, n0, m0))
    assert_close(
        {"y": y, "C": out.memory[..., :d], "n": out.memory[..., d], "m": out.scale, "conv": out.conv},
        {"y": y_ref, "C": C, "n": n, "m": m, "conv": conv_ref},
        context="mlstm carried state",
    )


def test_options_checked():
    with pytest.raises(ValueError, match="heads"):
        layers.build("mlstm", D_MODEL, heads=3)
    with pytest.raises(ValueError, match="qkv_blocksize"):
        layers.build("mlstm", D_MODEL, qkv_blocksize=5)
