"""Gated DeltaNet and KDA (lcsm/layers/_gated_delta.py): the recurrence against a written-out loop
and fla-core 0.6.0's naive references, the gates against fla's gate references, on the layer's own
q, k, v, g, beta (docs/zoo/gated_deltanet_kda.md records the errors)."""

import pytest
import torch
import torch.nn.functional as F

from lcsm.layers import build
from lcsm.testing import assert_close

NAMES = ("gated_deltanet", "kda")


def _layer(name, negative_eigenvalues=False, seed=0):
    torch.manual_seed(seed)
    return build(name, 16, negative_eigenvalues=negative_eigenvalues).double()


def _inputs(layer, B=2, T=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, layer.d_model, generator=g, dtype=torch.float64)
    m0 = 0.3 * torch.randn(B, layer.num_heads, layer.head_k, layer.head_v, generator=g, dtype=torch.float64)
    return x, m0


def _loop(q, k, v, g, beta, m0):
    """S_t = (I - beta k k^T) Diag(alpha) S_{t-1} + beta k v^T, o_t = S_t^T q_t K^-1/2, written out."""
    K = q.shape[-1]
    alpha = torch.exp(g if g.dim() == 4 else g.unsqueeze(-1).expand_as(k))
    S, out = m0.clone(), []
    eye = torch.eye(K, dtype=q.dtype)
    for t in range(q.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        A = (eye - bt * kt[..., :, None] * kt[..., None, :]) * alpha[:, t, :, None, :]
        S = A @ S + bt * kt[..., :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkd->bhd", q[:, t] * K**-0.5, S))
    return torch.stack(out, 1), S


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_recurrence_is_the_gated_delta_rule(name, neg):
    layer = _layer(name, neg)
    x, m0 = _inputs(layer)
    q, k, v, g, beta, _ = layer.recurrence_inputs(x)
    assert g.shape == ((*q.shape[:3],) if name == "gated_deltanet" else q.shape)
    top = float(beta.detach().max())
    assert top <= (2 if neg else 1) and (not neg or top > 1)
    o, m = layer.recurrence(q, k, v, g, beta, m0, True)
    o_ref, m_ref = _loop(q, k, v, g, beta, m0)
    assert_close({"o": o, "m": m}, {"o": o_ref, "m": m_ref}, context=name)


@pytest.mark.parametrize("neg", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_recurrence_matches_fla_naive(name, neg):
    """fla's naive references compute in float32: agreement to float32 rounding (~1e-7)."""
    pytest.importorskip("fla")
    if name == "gated_deltanet":
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive
    else:
        from fla.ops.kda.naive import naive_recurrent_kda as naive
    layer = _layer(name, neg)
    x, m0 = _inputs(layer, T=29)
    with torch.no_grad():
        q, k, v, g, beta, _ = layer.recurrence_inputs(x)
        o, m = layer.recurrence(q, k, v, g, beta, m0, True)
        o_ref, m_ref = naive(q, k, v, beta=beta, g=g, initial_state=m0, output_final_state=True)
        errors = assert_close({"o": o, "m": m}, {"o": o_ref.double(), "m": m_ref.double()}, torch.float32, name)
        # The layer's output is its read-out of that recurrence.
        errors["y"] = assert_close(
            {"y": layer(x)},
            {"y": layer.readout(x, layer.recurrence(q, k, v, g, beta)[0])},
            context=name,
        )["y"]
    print(name, "negative_eigenvalues" if neg else "", errors)


@pytest.mark.parametrize("name", NAMES)
def test_gate_matches_fla(name):
    """log alpha = -exp(A_log) softplus(W x + dt_bias), fla's naive_gdn_gate / naive_kda_gate."""
    pytest.importorskip("fla")
    layer = _layer(name)
    x, _ = _inputs(layer)
    with torch.no_grad():
        if name == "gated_deltanet":
            from fla.ops.gated_delta_rule.gate import naive_gdn_gate

            ref = naive_gdn_gate(layer.a_proj(x), layer.A_log, layer.dt_bias, output_dtype=torch.float64)
        else:
            from fla.ops.kda.gate import naive_kda_gate

            f = layer.f_proj(x).unflatten(-1, (layer.num_heads, layer.head_k))
            ref = naive_kda_gate(f, layer.A_log, layer.dt_bias, output_dtype=torch.float64)
        # fla's gates compute in float32.
        assert_close({"g": layer.log_alpha(x)}, {"g": ref}, torch.float32, name)


@pytest.mark.parametrize("name", NAMES)
def test_pieces_follow_fla_layer(name):
    """The formulas of fla's layer around the recurrence, written out: SiLU(causal conv), L2 norm
    with eps inside the root, beta = sigmoid, gated RMSNorm (SiLU for GDN, sigmoid for KDA)."""
    layer = _layer(name)
    x, _ = _inputs(layer)
    B, T, _ = x.shape
    H, K, D = layer.num_heads, layer.head_k, layer.head_v
    with torch.no_grad():
        q, k, v, g, beta, _ = layer.recurrence_inputs(x)

        def conv(c, z):
            z = F.pad(z.transpose(1, 2), (c.kernel_size[0] - 1, 0))
            return F.silu(F.conv1d(z, c.weight, c.bias, groups=c.in_channels)).transpose(1, 2)

        def l2(z):
            return z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6)

        want_q = l2(conv(layer.q_conv1d, layer.q_proj(x)).reshape(B, T, H, K))
        want_k = l2(conv(layer.k_conv1d, layer.k_proj(x)).reshape(B, T, H, K))
        want_v = conv(layer.v_conv1d, layer.v_proj(x)).reshape(B, T, H, D)
        assert_close(
            {"q": q, "k": k, "v": v, "beta": beta},
            {"q": want_q, "k": want_k, "v": want_v, "beta": torch.sigmoid(layer.b_proj(x))},
        )
        o = torch.randn(B, T, H, D, dtype=torch.float64)
        gate = layer.g_proj(x).reshape(B, T, H, D)
        act = F.silu(gate) if name == "gated_deltanet" else torch.sigmoid(gate)
        normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.o_norm
        assert_close({"y": layer.readout(x, o)}, {"y": layer.o_proj((normed * act).flatten(-2))})


@pytest.mark.parametrize("name", NAMES)
def test_inits_follow_fla(name):
    layer = build(name, 64)
    A = layer.A_log.exp()
    low = 0 if name == "gated_deltanet" else 1
    assert float(A.min()) >= low and float(A.max()) <= 16
    dt = F.softplus(layer.dt_bias)
    assert float(dt.min()) >= 1e-4 - 1e-9 and float(dt.max()) <= 0.1 + 1e-6
    assert layer.dt_bias.shape == (
        (layer.num_heads,) if name == "gated_deltanet" else (layer.num_heads * layer.head_k,)
    )
    assert layer.A_log.dtype == torch.float32 and layer.bfloat16().A_log.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_negative_eigenvalues_decode_equals_forward(name):
    """The contract tests run the default options; with beta in [0, 2] decoding still equals forward."""
    layer = _layer(name, negative_eigenvalues=True)
    x, _ = _inputs(layer, T=9)
    with torch.no_grad():
        y, final = layer(x, return_state=True)
        state, steps = layer.init_state(x.shape[0]), []
        for t in range(x.shape[1]):
            out, state = layer.step(x[:, t], state)
            steps.append(out)
    assert_close(
        {"y": torch.stack(steps, 1), **{f"state.{k}": v for k, v in state.tensors().items()}},
        {"y": y, **{f"state.{k}": v for k, v in final.tensors().items()}},
        context=name,
    )


def test_options_are_checked():
    with pytest.raises(ValueError, match="negative_eigenvalues"):
        build("gated_deltanet", 16, negative_eigenvalues=1)
    with pytest.raises(ValueError, match="expand_v"):
        build("kda", 16, expand_v=0.3)
