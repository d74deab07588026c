"""Paper identities of the linear-attention family (lcsm/layers/_qkv.py and one file per mixer).

Each test writes the model the way its paper does (an explicit, quadratic, masked attention or an
explicit loop), computing q, k, v from the mixer's weights with ``F.linear``, and checks that the
EOS-based mixer computes the same thing: outputs, and the gradients of the input and of every
parameter.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.ops import eos
from lcsm.testing import assert_close, assert_matches_reference, decode, gradients

D_MODEL = 16


def build(name, **options):
    torch.manual_seed(0)
    return layers.build(name, D_MODEL, **options).double()


def inputs(B=2, T=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)


def heads(t, H):
    return t.unflatten(-1, (H, -1))


def proj(lin, x, H):
    return heads(F.linear(x, lin.weight, lin.bias), H)


def masked_attention(scores, v):
    """scores [B, H, T, S] (already weighted, unmasked), v [B, S, H, D] -> [B, T, H, D], causal."""
    T = scores.shape[-1]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, 0.0)
    return torch.einsum("bhts,bshd->bthd", scores, v), scores.sum(-1).transpose(1, 2).unsqueeze(-1)


def lags(T):
    t = torch.arange(T, dtype=torch.float64)
    return t[:, None] - t[None, :]  # [T, S]: t - s


# ----------------------------------------------------------------------------- linear attention


@pytest.mark.parametrize("normalize", [True, False])
def test_linear_attention_equals_explicit_causal_attention(normalize):
    """Katharopoulos et al. 2020, sec. 3.2-3.4: V'_t = phi(Q_t)^T sum_{s<=t} phi(K_s) V_s^T /
    phi(Q_t)^T sum_{s<=t} phi(K_s) — the masked phi(Q) phi(K)^T attention."""
    m = build("linear_attention", normalize=normalize)
    H = m.num_heads

    def phi(z):
        return F.elu(z) + 1

    def expected(x):
        q, k, v = phi(proj(m.q_proj, x, H)), phi(proj(m.k_proj, x, H)), proj(m.v_proj, x, H)
        num, den = masked_attention(torch.einsum("bthk,bshk->bhts", q, k), v)
        y = num / (den + 1e-6) if normalize else num
        return F.linear(y.flatten(-2), m.o_proj.weight, m.o_proj.bias)

    assert_matches_reference(m, inputs(), expected, context=f"linear_attention normalize={normalize}")


# ----------------------------------------------------------------------------- RetNet / GLA


def test_retnet_equals_gla_with_constant_decay():
    """LCSM Table 1: RetNet's oscillation lambda J is GLA's g_t 1^T with g_t = lambda. Give GLA
    RetNet's weights and a decay projection whose output is the constant logit(lambda_h^tau)
    (W_2 = 0, b = logit(lambda^tau)), so alpha_t = sigmoid(b)^(1/tau) = lambda_h exactly. Both
    layers then must agree end to end (norm, gate, output) although one hands the EOS op a fixed
    scalar decay [H, 1, 1] and the other a data-dependent row decay [B, T, H, K, 1] (two chunks at
    T = 80)."""
    retnet = build("retnet", xpos=False)
    gla = build("gla", expand_k=1.0, expand_v=2.0, norm=retnet.norm, norm_eps=retnet.norm_eps)
    H, K = retnet.num_heads, retnet.head_k
    assert (gla.num_heads, gla.head_k, gla.head_v) == (H, K, retnet.head_v)
    x = inputs(T=80)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj"):
            getattr(gla, name).weight.copy_(getattr(retnet, name).weight)
        gla.g_proj.bias.zero_()
        gla.gk_proj[1].weight.zero_()
        lam_tau = (retnet.log_gamma(x) * gla.tau).exp()  # lambda_h^tau
        gla.gk_proj[1].bias.copy_(torch.logit(lam_tau).repeat_interleave(K))
    assert_close({"out": gla(x)}, {"out": retnet(x)}, context="retnet vs gla(constant decay)")
    # Not vacuous: the decays must matter (a GLA decay of 1 gives another output).
    with torch.no_grad():
        gla.gk_proj[1].bias.fill_(50.0)
    with pytest.raises(AssertionError):
        assert_close({"out": gla(x)}, {"out": retnet(x)})


def short_conv(conv, p):
    """fla's ShortConvolution(activation="silu") written out: SiLU of sum_j w[c, j] p_{t-(W-1)+j}[c]
    (+ b[c]), zeros before the first token; p [B, T, C], conv an nn.Conv1d(C, C, W, groups=C)."""
    W, T = conv.weight.shape[-1], p.shape[1]
    y = sum(conv.weight[:, 0, j] * F.pad(p, (0, 0, W - 1 - j, 0))[:, :T] for j in range(W))
    return F.silu(y if conv.bias is None else y + conv.bias)


def gla_recurrence_float64(q, k, v, gk):
    """S_t = diag(exp(gk_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t K^-1/2, step by step in float64
    (fla's naive_recurrent_gla, which computes in float32)."""
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        S = gk[:, t].exp()[..., None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhkd,bhk->bhd", S, q[:, t] * q.shape[-1] ** -0.5))
    return torch.stack(out, 1)


@pytest.mark.parametrize("recurrence", ["float64 loop", "fla naive_recurrent_gla"])
@pytest.mark.parametrize(
    "options",
    [{}, {"use_short_conv": True}, {"use_short_conv": True, "conv_size": 2, "conv_bias": True}],
    ids=["no-conv", "conv", "conv2-bias"],
)
def test_gla_is_flas_layer(options, recurrence):
    """fla's GatedLinearAttention forward (fla/layers/gla.py, ``norm="rmsnorm"`` as fla's fused
    RMSNorm-swish gate) written out from the mixer's weights: q, k, v projections, each through a
    SiLU short convolution when ``use_short_conv``; gk = logsigmoid(gk_proj(x)) / 16; the GLA
    recurrence; rmsnorm per head * w * swish(g_proj(x)), with the output gate's bias (the paper's
    b_r, which fla drops); o_proj. Outputs and every gradient, odd T; fla's naive recurrence
    computes in float32, so it is held to float32's tolerance."""
    m = build("gla", norm="rmsnorm", **options)
    H = m.num_heads
    if recurrence != "float64 loop":
        naive = pytest.importorskip("fla.ops.gla.naive")

    def expected(x):
        q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
        if options.get("use_short_conv"):
            q, k, v = short_conv(m.q_conv1d, q), short_conv(m.k_conv1d, k), short_conv(m.v_conv1d, v)
        gk = F.logsigmoid(heads(m.gk_proj(x), H)) / 16
        q, k, v = heads(q, H), heads(k, H), heads(v, H)
        if recurrence == "float64 loop":
            o = gla_recurrence_float64(q, k, v, gk)
        else:
            o = naive.naive_recurrent_gla(q, k, v, gk)[0]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.norm_weight
        return m.o_proj((o * F.silu(proj(m.g_proj, x, H))).flatten(-2))

    x = inputs(T=21).requires_grad_()
    wrt = {"x": x, **dict(m.named_parameters())}
    dtype = torch.float64 if recurrence == "float64 loop" else torch.float32
    assert_close(gradients({"y": m(x)}, wrt), gradients({"y": expected(x)}, wrt), dtype=dtype, context=str(options))


def test_gla_conv_options_are_checked():
    with pytest.raises(ValueError, match="^use_short_conv:"):
        layers.build("gla", D_MODEL, use_short_conv=1)
    with pytest.raises(ValueError, match="^conv_size:"):
        layers.build("gla", D_MODEL, use_short_conv=True, conv_size=0)
    with pytest.raises(ValueError, match="^conv_size, conv_bias: set only with use_short_conv=True, got conv_size=2"):
        layers.build("gla", D_MODEL, conv_size=2)
    with pytest.raises(ValueError, match=r"^state: expected a GLAState from this mixer, got LinearAttentionState"):
        build("gla")(inputs(), state=layers.build("linear_attention", D_MODEL).init_state(2))
    conv = build("gla", use_short_conv=True)
    state = conv.init_state(2)
    state.conv_v = state.conv_v[:, :2]
    with pytest.raises(ValueError, match=r"^state.conv_v: expected \[2, 3, 16\], got \[2, 2, 16\]"):
        conv(inputs(), state=state)


def test_retnet_init_is_torchscales():
    """torchscale MultiScaleRetention.reset_parameters (torchscale/component/multiscale_retention.py):
    Xavier-uniform, gain 2^-2.5 on q/k/v/g and 2^-1 on the output projection (since ff7c1f2,
    2023-11-24). Xavier-uniform draws from U(-a, a), a = gain sqrt(6 / (fan_in + fan_out)): at
    d_model 256 the largest of 256^2 or more draws is within 1 % of a."""
    torch.manual_seed(0)
    m = layers.build("retnet", 256)
    for name, gain in (
        ("q_proj", 2**-2.5),
        ("k_proj", 2**-2.5),
        ("v_proj", 2**-2.5),
        ("g_proj", 2**-2.5),
        ("o_proj", 0.5),
    ):
        w = getattr(m, name).weight.detach()
        bound = gain * math.sqrt(6 / (w.shape[0] + w.shape[1]))
        assert 0.99 * bound < float(w.abs().max()) <= bound, name


def rotate_pairs(x, angle):
    """RetNet's xPos rotation on interleaved channel pairs (2j, 2j+1): x [B, T, H, K],
    angle [T, K/2] -> (a cos - b sin, b cos + a sin) per pair."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def test_retnet_xpos_equals_rotated_retention():
    """RetNet sec. 2.1 (parallel form): Retention(X) = (Q~ K~^T * D) V with Q~ = (X W_Q) * Theta,
    K~ = (X W_K) * conj(Theta), D_nm = gamma^(n-m) for n >= m; here the rotation is applied to
    real channel pairs and compared with the complex-decay EOS read-out (before GroupNorm)."""
    m = build("retnet")
    H, K = m.num_heads, m.head_k

    def expected(x):
        T = x.shape[1]
        q = proj(m.q_proj, x, H)
        k = proj(m.k_proj, x, H) * K**-0.5
        v = proj(m.v_proj, x, H)
        theta = 10000.0 ** -torch.linspace(0, 1, K // 2, dtype=torch.float64)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * theta
        qr, kr = rotate_pairs(q, angle), rotate_pairs(k, angle)
        gamma = 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float64))
        decay = gamma[:, None, None] ** lags(T).clamp_min(0)
        return masked_attention(torch.einsum("bthk,bshk->bhts", qr, kr) * decay, v)[0]

    assert_matches_reference(m, inputs(), expected, context="retnet xpos", forward=lambda x: m.eos_readout(x)[0])


# ----------------------------------------------------------------------------- cosFormer / LRPE


def test_cosformer_equals_original_decomposition():
    """cosFormer (sec. 3) as its authors' code computes it: q' = [q sin(pi i / 2M), q cos(pi i / 2M)],
    k' likewise with absolute positions, causal q'k'^T attention with a clamped denominator.
    With theta = pi / 2M the complex-decay EOS (LCSM eq. 14) must give the same layer output."""
    T = 20
    m = build("cosformer", theta=math.pi / (2 * T))
    H = m.num_heads

    def expected(x):
        q, k, v = F.relu(proj(m.q_proj, x, H)), F.relu(proj(m.k_proj, x, H)), proj(m.v_proj, x, H)
        idx = (math.pi / 2 * torch.arange(1, T + 1, dtype=torch.float64) / T)[None, :, None, None]
        q_ = torch.cat([q * idx.sin(), q * idx.cos()], -1)
        k_ = torch.cat([k * idx.sin(), k * idx.cos()], -1)
        num, den = masked_attention(torch.einsum("bthk,bshk->bhts", q_, k_), v)
        return F.linear((num / den.clamp_min(1e-6)).flatten(-2), m.o_proj.weight, m.o_proj.bias)

    assert_matches_reference(m, inputs(T=T), expected, context="cosformer")


def test_cosformer_per_head_theta_is_lcsm_eq14():
    """LCSM eq. 14 without the denominator: y_t = sum_s cos((t - s) theta_h) (q_t . k_s) v_s,
    with a different fixed theta per head."""
    thetas = (0.05, 0.2, 0.7, 1.3)
    m, x = build("cosformer", theta=thetas, normalize=False), inputs()
    H = m.num_heads

    def expected(x):
        q, k, v = F.relu(proj(m.q_proj, x, H)), F.relu(proj(m.k_proj, x, H)), proj(m.v_proj, x, H)
        cos = torch.cos(lags(x.shape[1])[None] * torch.tensor(thetas, dtype=torch.float64)[:, None, None])
        return masked_attention(torch.einsum("bthk,bshk->bhts", q, k) * cos, v)[0]

    assert m.eos_readout(x)[1].is_complex()
    assert_matches_reference(m, x, expected, context="cosformer per-head theta", forward=lambda x: m.eos_readout(x)[0])


def test_lrpe_equals_per_channel_cos_reweighting():
    """LCSM eq. 15: y_t = sum_s sum_j cos((t - s) theta_hj) q_tj k_sj v_s, with learned (here
    randomised) per-channel angles."""
    m = build("lrpe")
    with torch.no_grad():
        m.theta.copy_(torch.rand(m.theta.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2)
    H = m.num_heads

    def phi(z):
        return F.elu(z) + 1

    def expected(x):
        q, k, v = phi(proj(m.q_proj, x, H)), phi(proj(m.k_proj, x, H)), proj(m.v_proj, x, H)
        cos = torch.cos(lags(x.shape[1])[None, :, :, None] * m.theta[:, None, None, :])  # [H, T, S, K]
        return masked_attention(torch.einsum("bthk,bshk,htsk->bhts", q, k, cos), v)[0]

    assert_matches_reference(m, inputs(), expected, context="lrpe", forward=lambda x: m.eos_readout(x)[0])


@pytest.mark.parametrize(
    "name,options", [("retnet", {}), ("cosformer", {}), ("cosformer", {"normalize": False}), ("lrpe", {})]
)
def test_rotating_frame_equals_the_complex_system(name, options):
    """The complex-memory mixers run in the rotating frame (lcsm.ops.eos_rotating, real kernels):
    the same read-out and final memory as the complex system eos(*eos_inputs(x)) itself, from a
    carried non-zero state."""
    m = build(name, **options)
    _, state = m(inputs(seed=2), return_state=True)
    x = inputs(T=13)
    y, m_T = m.eos_readout(x, state)
    i, e, s, log_o = m.eos_inputs(x)
    if m.normalize:
        i = torch.cat([i, torch.ones_like(i[..., :1])], -1)
    y_ref, m_ref = eos(i, e, s, log_o, initial_state=state.memory, output_final_state=True, mode="recurrent")
    y_ref = y_ref.real
    if m.normalize:
        y_ref = y_ref[..., :-1] * m._denominator(y_ref[..., -1:])
    assert state.memory.is_complex() and state.memory.abs().amax() > 0
    assert_close({"y": y, "m_T": m_T}, {"y": y_ref, "m_T": m_ref}, context=f"{name} {options}")


# ----------------------------------------------------------------------------- DUR


def test_dur_outer_product_decay_equals_elementwise_recurrence():
    """LCSM Table 1 DUR/GFW: [kv]_t = (g_t gbar_t^T) o [kv]_{t-1} + k_t v_t^T, y_t = [kv]_t^T q_t,
    run as an explicit loop over t with the gates computed from the mixer's weights."""
    m = build("dur")
    H, K = m.num_heads, m.head_k

    def expected(x):
        q = proj(m.q_proj, x, H) * K**-0.5
        k, v = proj(m.k_proj, x, H), proj(m.v_proj, x, H)
        g = torch.sigmoid(proj(m.gk_proj, x, H)) ** (1 / 16)
        gbar = torch.sigmoid(proj(m.gv_proj, x, H)) ** (1 / 16)
        mem = torch.zeros(x.shape[0], H, K, m.head_v, dtype=torch.float64)
        ys = []
        for t in range(x.shape[1]):
            decay = g[:, t, :, :, None] * gbar[:, t, :, None, :]
            mem = decay * mem + k[:, t, :, :, None] * v[:, t, :, None, :]
            ys.append(torch.einsum("bhkd,bhk->bhd", mem, q[:, t]))
        return {"y": torch.stack(ys, 1), "memory": mem}

    def readout(x):
        y, memory = m.eos_readout(x)
        return {"y": y, "memory": memory}

    assert_matches_reference(m, inputs(T=12), expected, context="dur", forward=readout)


# ----------------------------------------------------------------------------- rows and options

TABLE1 = {
    # name: (expand, oscillation, shrink, oscillation data-dependent)
    "linear_attention": ("k_t", "J^(kd)", "q_t", False),
    "retnet": ("k_t", "lambda", "q_t", False),
    "cosformer": ("k_t", "exp(i theta) J^(kd)", "q_t", False),
    "lrpe": ("k_t", "exp(i Theta) 1^(d)T", "q_t", False),
    "gla": ("k_t", "g_t 1_d^T", "q_t", True),
    "dur": ("k_t", "g_t gbar_t^T", "q_t", True),
}


@pytest.mark.parametrize("name", sorted(TABLE1))
def test_describe_is_the_lcsm_table1_row(name):
    row = build(name).describe()
    expand, osc, shrink, osc_dd = TABLE1[name]
    assert (row.input, row.expand, row.shrink, row.psi) == ("v_t", expand, shrink, "elementwise")
    assert row.oscillation.startswith(osc), row.oscillation
    assert (row.input_dd, row.expand_dd, row.oscillation_dd, row.shrink_dd) == (True, True, osc_dd, True)


def test_aliases_build_the_same_layers():
    assert type(layers.build("tnl", D_MODEL)) is type(layers.build("retnet", D_MODEL))
    assert type(layers.build("gateloop", D_MODEL)) is type(layers.build("gla", D_MODEL))
    assert type(layers.build("gfw", D_MODEL)) is type(layers.build("dur", D_MODEL))


@pytest.mark.parametrize(
    "name, options, arg",
    [
        ("linear_attention", {"num_heads": 3}, "expand_k"),
        ("linear_attention", {"feature_map": "softmax"}, "feature_map"),
        ("linear_attention", {"normalize": 1}, "normalize"),
        ("retnet", {"num_heads": 0}, "num_heads"),
        ("retnet", {"expand_k": 0.25, "num_heads": 4}, "xpos"),
        ("cosformer", {"theta": (0.1, 0.2)}, "theta"),
        ("cosformer", {"theta": float("nan")}, "theta"),
        ("cosformer", {"num_heads": 5}, "num_heads"),
        ("gla", {"norm": "batchnorm"}, "norm"),
        ("dur", {"gate_logit_normalizer": 0}, "gate_logit_normalizer"),
    ],
)
def test_bad_options_name_the_argument(name, options, arg):
    with pytest.raises(ValueError, match=f"^{arg}:"):
        layers.build(name, D_MODEL, **options)


@pytest.mark.parametrize(
    "name,options",
    [
        ("linear_attention", {"normalize": False}),
        ("retnet", {"xpos": False}),
        ("cosformer", {"normalize": False}),
        ("cosformer", {"theta": (0.05, 0.2, 0.7, 1.3)}),
    ],
)
def test_non_default_options_decode_and_carry_state(name, options):
    """The contract tests (test_common) build every mixer with its defaults; these options change
    the memory (no normaliser column, a real decay instead of a rotation, one angle per head)."""
    m, x = build(name, **options), inputs(T=13)
    y, final = m(x, return_state=True)
    y_steps, state = decode(m, x)
    y1, s1 = m(x[:, :6], return_state=True)
    y2, s2 = m(x[:, 6:], state=s1, return_state=True)
    assert_close(
        {"steps": y_steps, "chunks": torch.cat([y1, y2], 1), "m_steps": state.memory, "m_chunks": s2.memory},
        {"steps": y, "chunks": y, "m_steps": final.memory, "m_chunks": final.memory},
        context=f"{name} {options}",
    )


def test_wrong_state_type_is_a_clear_error():
    with pytest.raises(ValueError, match="^state: expected a LinearAttentionState from this mixer, got RWKV4State"):
        build("retnet")(inputs(), state=layers.build("rwkv4", D_MODEL).init_state(2))


def test_no_weight_decay_tags():
    tagged = {n for n, p in build("gla").named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert tagged == {"gk_proj.1.bias", "g_proj.bias", "norm_weight"}
    assert getattr(build("lrpe").theta, "_no_weight_decay", False)


def test_lrpe_theta_init_is_one_rope_spectrum_over_heads():
    m = layers.build("lrpe", D_MODEL)  # a float32 parameter: its init is float32-rounded
    H, K = m.num_heads, m.head_k
    expected = 10000.0 ** (-2.0 * torch.arange(H * K, dtype=torch.float64) / (H * K))
    assert_close({"theta": m.theta.detach().flatten()}, {"theta": expected.float()})


@pytest.mark.parametrize("name", sorted(TABLE1))
def test_bfloat16_layer_keeps_float32_state(name):
    torch.manual_seed(0)
    m = layers.build(name, D_MODEL).to(torch.bfloat16)
    x = torch.randn(2, 8, D_MODEL, dtype=torch.bfloat16)
    y, state = m(x, return_state=True)
    y_next, state_next = m(x[:, :1], state=state, return_state=True)
    real = torch.float32
    expected = torch.complex64 if m.complex_memory else real
    assert y.dtype == y_next.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert state.memory.dtype == state_next.memory.dtype == m.init_state(2).memory.dtype == expected
