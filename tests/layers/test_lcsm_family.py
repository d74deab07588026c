"""The LCSM ablation family ``lcsm`` (LCSM sections 2.4-2.5, Tables 2-3): every model code builds
with the right EOS shapes and table row, decoding equals the full forward on a representative
subset, each oscillation code computes the official formula, ALiBi decays lie in (0, 1], code 11
equals the official doubled [cos, sin] realisation, and linear attention is code 1-10-1-0."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers import lcsm as lcsm_module
from lcsm.layers.lcsm import (
    A_MEANING,
    DEFAULT_CODE,
    O_MEANING,
    LCSMFamily,
    LCSMState,
    alibi_decay_logits,
    alibi_slopes,
    rotary_theta,
)
from lcsm.ops import LogProduct, eos, explain
from lcsm.ops.decay import log_sigmoid_product_reference
from lcsm.testing import assert_close, assert_matches_reference, decode, gradients

D, K = 8, 4  # tiny: the family is large and CPUs are shared
ALL_CODES = [f"{e}-{o}-{s}-{a}" for e, o, s, a in itertools.product(range(2), range(12), range(2), range(8))]
DD_O = {1, 2, 3, 6, 7, 8, 9}


def make(name="lcsm", seed=0, d=D, **options):
    torch.manual_seed(seed)
    options.setdefault("expand", K)
    return layers.build(name, d, **options).double()


def inputs(B=2, T=9, d=D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64)


def expected_log_o_shape(o, B, T, k, d):
    """log_o's shape per o code; code 1 is a separable pair (log_row, log_col)."""
    return {
        0: (1, k, d),
        1: ((B, T, 1, k, 1), (B, T, 1, 1, d)),
        2: (B, T, 1, 1, d),
        3: (B, T, 1, k, 1),
        4: (1, k, 1),
        5: (1, 1, d),
        6: (B, T, 1, k, d),
        7: (B, T, 1, k, d),
        8: (B, T, 1, k, d),
        9: (B, T, 1, k, d),
        10: None,
        11: (1, k, 1),
    }[o]


def test_default_code_is_the_papers_best():
    assert LCSMFamily(16).code == DEFAULT_CODE == "1-9-1-0"


def test_every_linear_code_builds_with_its_shapes_and_row():
    assert len(ALL_CODES) == 2 * 12 * 2 * 8 == 384
    x = inputs(B=1, T=3)
    for code in ALL_CODES:
        e, o, s, a = (int(c) for c in code.split("-"))
        m = layers.build(f"lcsm:{code}", D, expand=K).double()
        assert m.code == code
        i_, e_, s_, log_o = m.eos_inputs(x)
        assert i_.shape == (1, 3, 1, D)
        assert e_.shape == ((1, 3, 1, K) if e else (1, K, D)), code
        assert s_.shape == ((1, 3, 1, K) if s else (1, K, D)), code
        want = expected_log_o_shape(o, 1, 3, K, D)
        parts = log_o if isinstance(log_o, tuple) else (log_o,)
        if want is None:
            assert log_o is None, code
        else:
            assert tuple(tuple(p.shape) for p in parts) == (want if o == 1 else (want,)), code
            assert all(p.is_complex() == (o == 11) for p in parts), code
        assert hasattr(m, "e_proj") == bool(e) and hasattr(m, "e") == (not e), code
        assert hasattr(m, "s_proj") == bool(s) and hasattr(m, "s") == (not s), code
        row = m.describe()
        assert row.name == f"LCSM {code}"
        assert (row.expand_dd, row.oscillation_dd, row.shrink_dd, row.input_dd) == (bool(e), o in DD_O, bool(s), True)
        assert O_MEANING[o] in row.oscillation
        phi = f"phi(x) = {A_MEANING[a]}"
        assert (phi in row.expand, phi in row.shrink) == (a != 0, a != 0), code


def _assert_step_loop_equals_forward(m, x, context):
    y, final = m(x, return_state=True)
    y_steps, state = decode(m, x)
    assert_close(
        {"y": y_steps, "memory": state.memory}, {"y": y, "memory": final.memory}, dtype=torch.float64, context=context
    )
    return y


SUBSET = sorted(
    {f"{e}-{o}-{s}-{a}" for o in range(12) for (e, s, a) in ((1, 1, 4), (0, 1, 2), (1, 0, 6))}
    | {f"1-9-1-{a}" for a in range(8)}
    | {f"0-0-0-{a}" for a in range(8)}
)


@pytest.mark.parametrize("code", SUBSET)
def test_decoding_equals_forward_and_all_parameters_learn(code):
    m, x = make(code=code), inputs()
    y = _assert_step_loop_equals_forward(m, x, code)
    (y * torch.randn_like(y)).sum().backward()
    dead = [
        n
        for n, p in m.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all() or not (p.grad != 0).any()
    ]
    assert not dead, f"{code}: parameters without a finite non-zero gradient: {dead}"


@pytest.mark.parametrize("code", ["0-0-0-0", "0-4-0-1", "0-5-0-3", "0-10-0-7", "0-11-0-2"])
def test_time_invariant_codes_long_sequence(code):
    # fully data-independent codes take the FFT path under "auto" (any T > 1): the step loop is
    # held to it over a longer sequence than the contract tests use
    _assert_step_loop_equals_forward(make(code=code), inputs(B=1, T=70), code)


def test_ssm_decoding_equals_forward():
    _assert_step_loop_equals_forward(make("lcsm:ssm"), inputs(), "ssm")


@pytest.mark.parametrize(
    "spec", [f"lcsm:1-{o}-1-4" for o in range(12)] + ["lcsm:0-0-0-0", "lcsm:0-11-0-2", "lcsm:1-11-0-6", "lcsm:ssm"]
)
def test_packed_documents_equal_each_alone(spec):
    """``cu_seqlens`` for every oscillation code, data-independent e / s (the complex kernel for
    code 11), the fully time-invariant codes (the FFT path unpacked) and the SSM: outputs, final
    memories and the gradients of x and the initial memories equal each document run alone."""
    m = make(spec)
    cu = [0, 1, 5, 12, 13]
    N = len(cu) - 1
    x = inputs(B=1, T=cu[-1]).requires_grad_()
    with torch.no_grad():
        m0 = m(inputs(B=N, T=3, seed=2), return_state=True)[1].memory
    m0.requires_grad_()
    y, final = m(x, state=LCSMState(memory=m0), return_state=True, cu_seqlens=torch.tensor(cu))
    alone = [
        m(x[:, a:b], state=LCSMState(memory=m0[n : n + 1]), return_state=True)
        for n, (a, b) in enumerate(itertools.pairwise(cu))
    ]
    y_ref, memory_ref = torch.cat([y_n for y_n, _ in alone], 1), torch.cat([f.memory for _, f in alone])
    wrt = {"x": x, "m0": m0}
    assert_close(
        gradients({"y": y, "memory": final.memory}, wrt),
        gradients({"y": y_ref, "memory": memory_ref}, wrt),
        dtype=torch.float64,
        context=spec,
    )


def _official_decay(m, x):
    """o [B, T, K, D] written from the official code's formulas (sigmoid(.) ** (1/tau))."""
    o, tau, B, T = m.o_type, m.tau, x.shape[0], x.shape[1]
    sig = lambda z: torch.sigmoid(z) ** (1 / tau)  # noqa: E731
    if o == 0:
        full = sig(m.o_logit)
    elif o == 1:
        full = torch.einsum("btk,btd->btkd", sig(m.o_k_proj(x)), sig(m.o_d_proj(x)))
    elif o == 2:
        full = sig(m.o_proj(x))[:, :, None, :]
    elif o == 3:
        full = sig(m.o_proj(x))[:, :, :, None]
    elif o == 4:
        full = sig(m.o_logit)[:, None]
    elif o == 5:
        full = sig(m.o_logit)[None, :]
    elif o == 6:
        full = sig(torch.einsum("btk,kd->btkd", m.o_proj(x), m.o_factor))
    elif o == 7:
        full = sig(torch.einsum("btd,kd->btkd", m.o_proj(x), m.o_factor))
    elif o == 8:
        full = sig(torch.einsum("btd,k->btkd", m.o_proj(x), m.o_factor))
    else:
        full = sig(torch.einsum("btk,d->btkd", m.o_proj(x), m.o_factor))
    return full.expand(B, T, m.expand, m.d_model)


@pytest.mark.parametrize("o", range(10))
def test_oscillation_codes_compute_the_official_formulas(o):
    m, x = make(code=f"1-{o}-1-0"), inputs(T=5)
    log_o = m.eos_inputs(x)[3]
    if isinstance(log_o, tuple):  # code 1: the separable pair, o = exp(log_row + log_col)
        log_o = log_o[0] + log_o[1]
    if log_o.dim() == 3:
        log_o = log_o.unsqueeze(0).unsqueeze(0)
    ours = log_o.squeeze(2).exp().expand(2, 5, K, D)
    assert_close({"o": ours}, {"o": _official_decay(m, x)}, context=f"o code {o}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("o", [6, 7, 8, 9])
def test_mixed_codes_fused_decay_equals_the_plain_expressions(o, dtype, monkeypatch):
    """Codes 6-9 form logsigmoid(a * b) / tau with the fused op; the whole layer (output, input
    and every parameter gradient) equals the same layer with the plain expressions."""
    m, x = make(code=f"1-{o}-1-0").to(dtype), inputs(T=11).to(dtype)

    def plain(x):
        with monkeypatch.context() as patch:
            patch.setattr(lcsm_module, "log_sigmoid_product", log_sigmoid_product_reference)
            return m(x)

    assert_matches_reference(m, x, plain, context=f"o code {o}, {dtype}")


@pytest.mark.parametrize("e,s", [(1, 1), (0, 1)])
def test_code_1_passes_a_separable_pair_to_the_matmul_kernel(e, s):
    """o code 1 (a_t (x) b_t) hands eos its two log factors: with vector e and s the plan is the
    chunk mode's matmul kernel (a K x D e falls back to the elementwise kernel), and the layer
    computes what the summed [B, T, 1, K, D] log_o gives in the recurrent reference."""
    m, x = make(code=f"{e}-1-{s}-0"), inputs(T=70)
    i, e_, s_, log_o = m.eos_inputs(x)
    assert isinstance(log_o, tuple)
    plan = explain(i, e_, s_, log_o)
    assert (plan.mode, plan.kernel) == ("chunk", "matmul" if e else "elementwise"), plan
    assert "decay=outer" in plan.reason
    y_ref, m_ref = eos(i, e_, s_, log_o[0] + log_o[1], mode="recurrent", output_final_state=True)
    y, state = m(x, return_state=True)
    assert_close(
        {"out": y, "memory": state.memory},
        {"out": m.out_proj(m.norm(y_ref.squeeze(2))), "memory": m_ref},
        context=f"code {e}-1-{s}-0",
    )


@pytest.mark.parametrize("a", range(8))
def test_activation_codes_apply_to_e_and_s(a):
    m, x = make(code=f"1-9-0-{a}"), inputs(T=4)
    _, e, s, _ = m.eos_inputs(x)
    fn = {
        0: lambda z: z,
        1: torch.relu,
        2: torch.sigmoid,
        3: lambda z: 1 + F.elu(z),
        4: F.silu,
        5: F.elu,
        6: lambda z: torch.relu(z).pow(2),
        7: lambda z: z * z,
    }[a]
    assert_close({"e": e.squeeze(2), "s": s.squeeze(0)}, {"e": fn(m.e_proj(x)), "s": fn(m.s)}, context=f"a={a}")


def test_ssm_parameterisation_is_mamba_like():
    m, x = make("lcsm:ssm"), inputs(T=5)
    i, e, s, log_o = m.eos_inputs(x)
    delta = F.softplus(m.delta_proj[1](m.delta_proj[0](x)))
    A = -torch.exp(m.A_log)  # [K, D]; its S4D-real init is checked in test_ssm_init_is_s4d_real
    assert isinstance(log_o, LogProduct)
    assert_close(
        {"i": i.squeeze(2), "e": e.squeeze(2), "s": s.squeeze(2), "o": (log_o.a * log_o.b).squeeze(2).exp()},
        {"i": delta * m.i_proj(x), "e": m.e_proj(x), "s": m.s_proj(x), "o": torch.exp(delta[:, :, None, :] * A)},
        context="ssm",
    )
    assert m.delta_proj[0].out_features == 16 and m.describe().oscillation_dd


def test_alibi_slopes_match_the_formula():
    for n in (1, 2, 4, 8, 16, 64, 1024):
        start = 2 ** (-8 / n)
        assert alibi_slopes(n) == pytest.approx([start ** (i + 1) for i in range(n)], rel=1e-12)
    assert alibi_slopes(8) == pytest.approx([2.0 ** -(i + 1) for i in range(8)], rel=1e-12)
    # Not a power of two: the slopes of 8, then every other slope of 16 (the ALiBi workaround).
    assert alibi_slopes(12) == pytest.approx(alibi_slopes(8) + alibi_slopes(16)[0::2][:4], rel=1e-12)


@pytest.mark.parametrize("d,k,tau", [(16, 64, 16.0), (8, 4, 1.0), (12, 3, 16.0), (8, 4, 1000.0)])
def test_data_independent_decays_are_alibi_and_in_unit_interval(d, k, tau):
    # float32 modules: the parameters are initialised in the default dtype, so exp(-slope) is
    # reproduced to float32 precision.
    x = inputs(B=1, T=2, d=d).float()
    for code in ALL_CODES:
        o = int(code.split("-")[1])
        if o not in (0, 4, 5):
            continue
        m = LCSMFamily(d, code=code, expand=k, tau=tau)
        decay = m.eos_inputs(x)[3].exp()
        assert decay.dim() == 3, code  # [1, K|1, D|1]: data-independent
        assert bool((decay > 0).all() and (decay <= 1).all()), f"{code}: decays outside (0, 1]"
        n = {0: k * d, 4: k, 5: d}[o]
        want = torch.exp(-torch.tensor(alibi_slopes(n), dtype=torch.float64))
        assert_close(
            {"decay": decay.reshape(-1)}, {"decay": want}, dtype=torch.float32, context=f"{code} d={d} K={k} tau={tau}"
        )
    assert torch.isfinite(alibi_decay_logits(1024, 1e4)).all()


def test_code_11_equals_the_official_doubled_realisation():
    # Official: e' = [e cos(t theta), e sin(t theta)], s' likewise (2K real rows), o = 1, t from 0.
    m, x = make(code="1-11-1-3"), inputs(T=12)

    def official(x):
        i, e, s, _ = m.eos_inputs(x)
        t = torch.arange(12, dtype=torch.float64)[:, None]
        ang = (t * rotary_theta(K, D, dtype=torch.float64))[None, :, None, :]  # [1, T, 1, K]
        e2 = torch.cat([e * ang.cos(), e * ang.sin()], -1)
        s2 = torch.cat([s * ang.cos(), s * ang.sin()], -1)
        return eos(i, e2, s2, None, mode="recurrent")[0]

    y_complex, _ = eos(*m.eos_inputs(x), mode="recurrent")
    assert_close({"y": y_complex.real}, {"y": official(x)}, context="code 11")
    assert_matches_reference(m, x, lambda x: m.out_proj(m.norm(official(x).squeeze(2))), context="code 11 layer")
    assert rotary_theta(3, 8).tolist() == pytest.approx([1.0, 10000**-0.25, 10000**-0.5])


def test_linear_attention_is_code_1_10_1_0():
    # LCSM Table 1: linear attention = (i, e, o, s) = (v_t, k_t, J, q_t):
    # y_t = sum_{j <= t} (q_t . k_j) v_j, the causally masked (Q K^T) V.
    m, x = make(code="1-10-1-0"), inputs(T=10)
    i, e, s, log_o = m.eos_inputs(x)
    assert log_o is None

    def attention(x):
        q, k, v = m.s_proj(x), m.e_proj(x), m.i_proj(x)
        mask = torch.ones(10, 10, dtype=torch.bool).tril()
        return ((q @ k.transpose(1, 2)) * mask) @ v

    y_eos, _ = eos(i, e, s, None)
    assert_close({"y": y_eos.squeeze(2)}, {"y": attention(x)}, context="linear attention")
    assert_matches_reference(m, x, lambda x: m.out_proj(m.norm(attention(x))), context="linear attention layer")


@pytest.mark.parametrize("a,feature_map", [(0, "identity"), (1, "relu"), (3, "1+elu")])
def test_linear_attention_mixer_equals_code_1_10_1_a(a, feature_map):
    # The same identity against the library's linear attention: one head, key width K, the
    # feature map = the activation code, no denominator (LCSM Table 1's row), no biases; the
    # projections copied (v <- i, k <- e, q <- s, o <- out). The wrappers differ only in LCSM's
    # LayerNorm before the output projection, so that is applied to the attention read-out.
    m, x = make(code=f"1-10-1-{a}"), inputs(T=10)
    attn = layers.build(
        "linear_attention",
        D,
        num_heads=1,
        expand_k=K / D,
        expand_v=1.0,
        feature_map=feature_map,
        normalize=False,
        bias=False,
    ).double()
    with torch.no_grad():
        for dst, src in (("v_proj", "i_proj"), ("k_proj", "e_proj"), ("q_proj", "s_proj"), ("o_proj", "out_proj")):
            getattr(attn, dst).weight.copy_(getattr(m, src).weight)
    y_attn, _ = attn.eos_readout(x)  # [B, T, 1, D]
    y_eos, _ = eos(*m.eos_inputs(x))
    assert_close({"y": y_eos}, {"y": y_attn}, context=f"1-10-1-{a} vs linear_attention({feature_map})")
    assert_close({"out": m(x)}, {"out": attn.o_proj(m.norm(y_attn.squeeze(2)))}, context="layer")


def test_shorthand_names():
    m = layers.build("lcsm:0-4-1-6", D, expand=K)
    assert (m.param, m.code, m.e_type, m.o_type, m.s_type, m.a_type) == ("linear", "0-4-1-6", 0, 4, 1, 6)
    ssm = layers.build("lcsm:ssm", D, expand=K)
    assert ssm.param == "ssm" and ssm.code is None and ssm.describe().name.startswith("LCSM ssm")
    assert layers.build("lcsm", D, code="1-11-1-0", expand=K).describe().memory == f"K x D = {K} x {D} (complex)"


@pytest.mark.parametrize("spec", ["foo", "1-9-1", "1_9_1_0", "linear", "ssm-1"])
def test_invalid_spec_lists_valid_forms(spec):
    with pytest.raises(ValueError, match=r"Valid forms: 'lcsm:<e>-<o>-<s>-<a>'.*'lcsm:ssm'"):
        layers.build(f"lcsm:{spec}", D)


@pytest.mark.parametrize(
    "code,match",
    [
        ("2-9-1-0", r"e \(expand type\) of '2-9-1-0' must be in 0-1, got 2.*data-dependent Linear"),
        ("1-12-1-0", r"o \(oscillation type\).*0-11, got 12.*10 = J \(all ones\)"),
        ("1-9-3-0", r"s \(shrink type\).*0-1, got 3"),
        ("1-9-1-8", r"a \(activation type\).*0-7, got 8.*7 = x\^2"),
        ("1-9-1", r"expected 'e-o-s-a'"),
        ("a-b-c-d", r"expected 'e-o-s-a'"),
        (1910, r"expected a model code string"),
    ],
)
def test_invalid_codes_are_clear_errors(code, match):
    with pytest.raises(ValueError, match=match):
        LCSMFamily(D, code=code, expand=K)
    if isinstance(code, str) and code.count("-") == 3 and code[0].isdigit():
        with pytest.raises(ValueError, match=match):  # the shorthand validates at build time too
            layers.build(f"lcsm:{code}", D)


@pytest.mark.parametrize(
    "options,match",
    [
        ({"param": "mamba"}, r"param: expected 'linear' or 'ssm'"),
        ({"param": "ssm", "code": "1-1-1-0"}, r"code: param='ssm'.*takes no 'e-o-s-a' code"),
        ({"tau": 0}, r"tau: expected a positive finite number"),
        ({"tau": float("nan")}, r"tau: expected a positive finite number"),
        ({"expand": 0}, r"expand: expected a positive integer"),
    ],
)
def test_invalid_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        layers.build("lcsm", D, **options)
    if options.get("param") == "ssm":
        with pytest.raises(ValueError, match=match):
            layers.build("lcsm:ssm", D, code="1-1-1-0")


@pytest.mark.parametrize(
    "name,tagged",
    [
        ("lcsm:0-0-0-0", {"o_logit", "norm.weight", "norm.bias"}),
        ("lcsm:1-4-1-0", {"o_logit", "norm.weight", "norm.bias"}),
        ("lcsm:1-9-1-0", {"o_factor", "norm.weight", "norm.bias"}),
        ("lcsm:1-3-1-0", {"norm.weight", "norm.bias"}),
        ("lcsm:ssm", {"A_log", "delta_proj.1.bias", "norm.weight", "norm.bias"}),
    ],
)
def test_no_weight_decay_tags(name, tagged):
    m = layers.build(name, D, expand=K)
    assert {n for n, p in m.named_parameters() if getattr(p, "_no_weight_decay", False)} == tagged
    assert not any(n.endswith("bias") and n not in tagged for n, _ in m.named_parameters())


def test_ssm_delta_starts_in_mambas_range():
    """Delta for a zero input is softplus(bias) ~ LogUniform[1e-3, 1e-1], as Mamba's dt_proj
    (mamba_simple.py); with the official bias-free projection it is softplus(0) = 0.69 and every
    memory row (A = -(1..K)) keeps less than half its content after one token."""
    m = layers.build("lcsm:ssm", 256, expand=K)
    delta = F.softplus(m.delta_proj(torch.zeros(1, 256))).detach().double()
    assert float(delta.min()) >= 1e-3 * (1 - 1e-6) and float(delta.max()) <= 1e-1 * (1 + 1e-6)
    # log-uniform: about half the channels below the geometric midpoint 1e-2
    assert 0.35 < float((delta < 1e-2).double().mean()) < 0.65
    # the slowest row's half-life ln 2 / Delta is then over 6 tokens everywhere
    assert float((math.log(2) / delta).min()) > 6
    official = layers.build("lcsm:ssm", D, expand=K, delta_bias=False)
    assert official.delta_proj[1].bias is None


def test_ssm_init_is_s4d_real():
    m = layers.build("lcsm:ssm", D, expand=K)
    A = -torch.arange(1, K + 1, dtype=torch.float64)[:, None].expand(K, D)
    assert_close({"A": -torch.exp(m.A_log.detach())}, {"A": A}, dtype=torch.float32, context="S4D-real A")
    assert math.isclose(float(m.A_log[1, 0].detach()), math.log(2), rel_tol=1e-6)
