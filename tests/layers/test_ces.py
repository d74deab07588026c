"""CES (ETSMLP section 3.1): FFT kernel path vs the recurrence, the kernel's closed form, the
max-lambda constraint, the ablation options and the bidirectional two-sided convolution."""

import cmath
import math

import pytest
import torch

from lcsm import layers
from lcsm.layers import ces
from lcsm.layers.ces import CESState
from lcsm.ops import eos, explain, native_scan
from lcsm.testing import assert_close, assert_matches_reference, decode, gradients

D_MODEL = 16


def make(**options):
    torch.manual_seed(0)
    return layers.build("ces", D_MODEL, **options).double()


def inputs(B=2, T=12, seed=1, d=D_MODEL):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g, dtype=torch.float64)


def test_fft_kernel_path_equals_recurrence():
    m, x = make(), inputs(T=80)
    e, s, log_o = m.eos_parameters()
    i = x.unsqueeze(-1)
    y_fft, m_fft = eos(i, e, s, log_o, mode="fft", output_final_state=True)
    y_rec, m_rec = eos(i, e, s, log_o, mode="recurrent", output_final_state=True)
    assert_close({"y": y_fft, "m": m_fft}, {"y": y_rec, "m": m_rec})
    # The mixer's own forward takes the FFT path at this length; decoding takes the recurrence.
    assert explain(i, e, s, log_o).mode == "fft"
    assert_close({"forward": m(x)}, {"forward": decode(m, x)[0]})

    def recurrent(x):
        y, _ = eos(x.unsqueeze(-1), *m.eos_parameters(), mode="recurrent", real_output=True)
        return y[..., 0] + m.omega * x

    assert_matches_reference(m, x, recurrent, context="ces: fft forward vs the recurrence")


def set_parameters(m, lam, alpha, beta):
    """Write lambda, alpha and beta (complex numbers, one per channel) into the stored
    parameterisation lambda' = log log lambda, alpha = e^{a0} + i e^{a1}, e^beta."""
    lam, alpha, beta = (torch.tensor(v, dtype=torch.complex128) for v in (lam, alpha, beta))
    with torch.no_grad():
        m.log_delta.copy_(torch.view_as_real(lam.log().log()))
        m.alpha.copy_(torch.stack([alpha.real.log(), alpha.imag.log()], -1))
        m.beta.copy_(torch.view_as_real(beta.log()))


def test_kernel_equals_closed_form():
    """k_j = Re(beta (1 - lambda^alpha) (lambda^alpha)^j) (eq. 9-10), with lambda^alpha, its powers
    and the product evaluated directly in complex arithmetic, against ``kernel`` and against the
    impulse response of the EOS mapping (the eos FFT path)."""
    m = make()
    C, L = D_MODEL, 40
    g = torch.Generator().manual_seed(3)
    radius = 0.5 + 0.45 * torch.rand(C, generator=g, dtype=torch.float64)
    phase = torch.rand(C, generator=g, dtype=torch.float64)  # principal branch
    lam = [cmath.rect(r, p) for r, p in zip(radius.tolist(), phase.tolist(), strict=False)]
    alpha = [complex(0.3 + 0.1 * c, 0.05 * (c % 5 + 1)) for c in range(C)]
    beta = [complex(1.0 + 0.1 * c, -0.2 + 0.05 * c) for c in range(C)]
    set_parameters(m, lam, alpha, beta)
    expected = torch.empty(C, L, dtype=torch.float64)
    for c in range(C):
        z = lam[c] ** alpha[c]  # Python's complex power
        assert abs(z) < m.max_lambda  # the constraint stays inactive
        for j in range(L):
            expected[c, j] = (beta[c] * (1 - z) * z**j).real
    impulse = torch.zeros(1, L, C, 1, dtype=torch.float64)
    impulse[:, 0] = 1.0
    e, s, log_o = m.eos_parameters()
    response, _ = eos(impulse, e, s, log_o, mode="fft")
    assert_close(
        {"kernel": m.kernel(L), "eos_fft_impulse": response.real[0, :, :, 0].T},
        {"kernel": expected, "eos_fft_impulse": expected},
    )


@pytest.mark.parametrize("field", ["complex", "real"])
def test_max_lambda_constraint_after_huge_lambda(field):
    m = make(field=field)
    with torch.no_grad():
        if field == "complex":
            # log lambda = 1 + 0.1i: |lambda| = e > 1, and Re q = Re(alpha log lambda) > 0 at init.
            m.log_delta[0] = torch.view_as_real(torch.tensor(1 + 0.1j, dtype=torch.complex128).log())
        else:
            # log lambda = -1e-9: lambda^alpha within 1e-9 of 1, above max_lambda.
            m.log_delta[0] = math.log(1e-9)
    q = m.log_decay()
    modulus = q.exp().abs()
    assert modulus.max() <= m.max_lambda * (1 + 1e-12)
    assert abs(modulus[0].item() - m.max_lambda) < 1e-12
    if field == "complex":
        # Only the modulus is rescaled (eq. 12): the phase of lambda^alpha, Im q, is untouched.
        unconstrained = (1 + 0.1j) * torch.view_as_complex(m.alpha.exp())[0]
        assert abs(q[0].imag.item() - unconstrained.imag.item()) < 1e-12
    # The kernel of the clamped channel stays inside its envelope |e^beta (1 - e^q)| max_lambda^j.
    L = 2000
    k = m.kernel(L)[0]
    envelope = (m.scale()[0] * -torch.expm1(q[0])).abs() * m.max_lambda ** torch.arange(L, dtype=torch.float64)
    assert torch.isfinite(k).all() and (k.abs() <= envelope * (1 + 1e-9)).all()
    y = m(inputs(T=5))
    assert torch.isfinite(y).all()


def test_ring_init_and_dt_init():
    m = layers.build("ces", 256, r_min=0.4, r_max=0.7, max_phase=math.pi)
    log_lambda = torch.view_as_complex(m.log_delta.double()).exp()
    r, theta = log_lambda.real.exp(), log_lambda.imag
    assert r.min() >= 0.4 - 1e-6 and r.max() <= 0.7 + 1e-6 and r.max() - r.min() > 0.2
    assert theta.min() >= 0 and theta.max() <= math.pi + 1e-6
    a = m.alpha.detach()
    assert torch.equal(a[:, 0], a[:, 1])
    assert a.min() >= math.log(1e-3) - 1e-6 and a.max() <= math.log(1e-1) + 1e-6
    fixed = layers.build("ces", 8, init="fixed", fixed_point=(0.5, 0.0))
    lam = torch.view_as_complex(fixed.log_delta.double()).exp().exp()
    assert torch.allclose(lam, torch.full_like(lam, 0.5), atol=1e-6)


def test_parameters_are_excluded_from_weight_decay():
    m = make()
    assert {n for n, p in m.named_parameters() if getattr(p, "_no_weight_decay", False)} == {
        "log_delta",
        "alpha",
        "beta",
        "omega",
    }


ABLATIONS = [
    ({"field": "real"}, {"log_delta": (16,), "alpha": (16,), "beta": (16,), "omega": (16,)}),
    ({"use_alpha": False}, {"log_delta": (16, 2), "beta": (16, 2), "omega": (16,)}),
    ({"use_beta": False}, {"log_delta": (16, 2), "alpha": (16, 2), "omega": (16,)}),
    ({"use_omega": False}, {"log_delta": (16, 2), "alpha": (16, 2), "beta": (16, 2)}),
    ({"init": "fixed"}, {"log_delta": (16, 2), "alpha": (16, 2), "beta": (16, 2), "omega": (16,)}),
    ({"field": "real", "init": "fixed", "use_beta": False}, {"log_delta": (16,), "alpha": (16,), "omega": (16,)}),
    ({"bidirectional": True}, {"log_delta": (32, 2), "alpha": (32, 2), "beta": (32, 2), "omega": (16,)}),
]


@pytest.mark.parametrize("options, shapes", ABLATIONS, ids=lambda o: str(o))
def test_ablation_builds_and_runs(options, shapes):
    m, x = make(**options), inputs()
    assert {n: tuple(p.shape) for n, p in m.named_parameters()} == shapes
    y = m(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    if not m.bidirectional:
        assert_close({"y": decode(m, x)[0]}, {"y": y}, context=str(options))


def test_real_field_kernel_closed_form():
    m = make(field="real", use_omega=False)
    L = 30
    lam = torch.exp(-m.log_delta.exp())  # lambda in (0, 1)
    z = lam ** m.alpha.exp()  # lambda^alpha
    j = torch.arange(L, dtype=torch.float64)
    expected = m.beta.exp().unsqueeze(-1) * (1 - z).unsqueeze(-1) * z.unsqueeze(-1) ** j
    assert_close({"kernel": m.kernel(L)}, {"kernel": expected.detach()})

    def direct(x):
        z = torch.exp(-m.log_delta.exp()) ** m.alpha.exp()
        k = m.beta.exp().unsqueeze(-1) * (1 - z).unsqueeze(-1) * z.unsqueeze(-1) ** j
        return torch.stack([sum(k[:, tau] * x[:, t - tau] for tau in range(t + 1)) for t in range(L)], 1)

    assert_matches_reference(m, inputs(T=L), direct, context="real field: the direct convolution")


def test_bidirectional_equals_two_sided_convolution():
    """Official two-sided kernel K = pad(k1, (0, L)) + pad(flip(k2), (L, 0)) on length 2L:
    y_t = sum_{s<=t} k1_{t-s} x_s + sum_{s>t} k2_{s-t-1} x_s + omega x_t."""
    m, x = make(bidirectional=True), inputs(T=10)
    L, d = x.shape[1], D_MODEL

    def two_sided(x):
        k = m.kernel(L)
        k1, k2 = k[:d], k[d:]
        rows = [sum((k1[:, t - s] if s <= t else k2[:, s - t - 1]) * x[:, s] for s in range(L)) for t in range(L)]
        return torch.stack(rows, 1) + m.omega * x

    assert_matches_reference(m, x, two_sided, context="bidirectional")
    # Non-causal: a change at the end moves the first output.
    x2 = x.clone()
    x2[:, -1] += 1.0
    assert (m(x2)[:, 0] - m(x)[:, 0]).abs().max() > 0


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lengths_zero_the_padded_inputs(bidirectional):
    """With ``lengths`` the valid positions are those of the sequence alone (the official CETS
    zeroes padded inputs before its FFT); without, the backward kernel reads the padding."""
    m, x = make(bidirectional=bidirectional), inputs(T=10)
    lengths = torch.tensor([10, 6])
    padded = x.clone()
    padded[1, 6:] = 3.0
    y = m(padded, lengths=lengths)
    assert_close({"y": y[1, :6]}, {"y": m(x[1:, :6])[0]}, context="padded sequence")
    assert_close({"y": y[0]}, {"y": m(x[:1])[0]}, context="full-length sequence")
    leaked = (m(padded)[1, :6] - m(x[1:, :6])[0]).abs().max()
    assert (leaked > 1e-3) == bidirectional
    with pytest.raises(ValueError, match=r"lengths: expected \[B\] = \[2\], got \[2, 1\]"):
        m(x, lengths=lengths[:, None])


def test_bidirectional_has_no_state():
    m = make(bidirectional=True)
    x = inputs()
    for call in (
        lambda: m.init_state(2),
        lambda: m(x, return_state=True),
        lambda: m.state_size(4),
        lambda: m.step(x[:, 0], None),
    ):
        with pytest.raises(ValueError, match="non-causal"):
            call()


def test_packed_documents_real_field_and_refusals():
    """cu_seqlens in the real field (the contract test covers the complex default) equals each
    document alone; the bidirectional mode and ``lengths`` refuse it."""
    m, x = make(field="real"), inputs(B=1, T=12)
    cu = torch.tensor([0, 5, 6, 12])
    state = m.init_state(3)
    state.memory.normal_(generator=torch.Generator().manual_seed(2))
    y, final = m(x, state=state, return_state=True, cu_seqlens=cu)
    for n in range(3):
        a, b = cu[n], cu[n + 1]
        y_n, f_n = m(x[:, a:b], state=type(state)(memory=state.memory[n : n + 1]), return_state=True)
        assert_close({"y": y[:, a:b], "m": final.memory[n : n + 1]}, {"y": y_n, "m": f_n.memory}, context=f"doc {n}")
    with pytest.raises(ValueError, match="^lengths: right-padded rows and cu_seqlens"):
        m(x, lengths=torch.tensor([12]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="^cu_seqlens: CES with bidirectional=True"):
        make(bidirectional=True)(x, cu_seqlens=cu)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"field": "quaternion"}, "field"),
        ({"init": "hippo"}, "init"),
        ({"r_min": 0.9, "r_max": 0.5}, "r_min"),
        ({"max_lambda": 1.5}, "max_lambda"),
        ({"init": "fixed", "fixed_point": (1.5, 0.0)}, "fixed_point"),
        ({"field": "real", "init": "fixed", "fixed_point": (0.5, 0.1)}, "fixed_point"),
        ({"use_beta": "no"}, "use_beta"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=f"^{match}:"):
        layers.build("ces", D_MODEL, **options)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 65, 150])
@pytest.mark.parametrize("initial", [False, True])
def test_native_recurrence_equals_the_fft_form(monkeypatch, dtype, T, initial):
    """The causal complex CES on the CPU runs the native diagonal recurrence (lcsm/ops/_native/
    diag.h): against eos's FFT form in float64 (the native kernel turned off by the test), outputs,
    final state and the gradients of the input, the initial state and every parameter, at lengths
    and a width (70 channels) that the kernel's blocks of 64 do not divide."""
    if native_scan.native_unavailable() is not None:
        pytest.skip(native_scan.native_unavailable())
    d, g = 70, torch.Generator().manual_seed(3)
    x = torch.randn(2, T, d, generator=g, dtype=torch.float64)
    m0 = torch.complex(*torch.randn(2, 2, d, 1, 1, generator=g, dtype=torch.float64)) if initial else None

    def run(native: bool, dt: torch.dtype):
        torch.manual_seed(0)
        mixer = layers.build("ces", d).to(dt)
        calls = []
        if native:
            forward = native_scan.diag_forward
            monkeypatch.setattr(native_scan, "diag_forward", lambda *a: calls.append(1) or forward(*a))
        else:
            monkeypatch.setattr(ces, "native_serves", lambda x: False)
        leaves = {"x": x.to(dt).requires_grad_()}
        if initial:
            leaves["m0"] = m0.to(dt.to_complex()).requires_grad_()
        state = CESState(memory=leaves["m0"]) if initial else None
        y, last = mixer(leaves["x"], state=state, return_state=True)
        monkeypatch.undo()
        assert len(calls) == native
        return gradients({"y": y, "m_T": last.memory}, {**leaves, **dict(mixer.named_parameters())})

    assert_close(run(True, dtype), run(False, torch.float64), dtype=dtype, context=f"native CES {dtype} T={T}")
