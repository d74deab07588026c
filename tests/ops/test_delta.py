"""``eos_delta`` (psi = x, the generalised delta rule) against its definition.

The reference is a plain autograd loop written out here, run in float64 on the same values, so
float32 results are judged against the exact answer. Every mode is compared on y, the final state
and the gradients of every input under random cotangents on both outputs.

Conditioning: keys are L2-normalised. With ||b|| = 1 and a = beta b, beta in (0, 1),
I - a b^T is symmetric with eigenvalues 1 and 1 - beta, a contraction (non-expansive), so long
products of oscillations stay bounded. For the general a != b case, a = beta * normalize(b + 0.3 r)
keeps a within a small angle of b: ||I - a b^T|| <= 1 + beta ||a_hat - b|| stays close to 1 and the
memory cannot grow geometrically. With raw Gaussian a, b the products of T rank-one updates blow up
and a comparison would measure that blow-up, not the correctness of the algorithm.
"""

import math

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm.ops import eos_delta
from lcsm.testing import assert_close

B, H, K, D = 2, 2, 5, 4  # K != D so a transposed memory cannot pass
NAMES = ("i", "e", "s", "a", "b", "log_o", "initial_state")


def make_inputs(T, *, gate="dd", initial=True, kind="general", seed=0, dims=(B, H, K, D)):
    """gate: none / dd ([B, T, H]) / head ([H]); kind: general (a != b != e), deltanet, m1."""
    B, H, K, D = dims
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    k = normalize(rnd(B, T, H, K), dim=-1)
    beta = torch.sigmoid(rnd(B, T, H, 1))
    if kind == "deltanet":
        a, b, e = beta * k, k, beta * k
    elif kind == "m1":
        a, b, e = k, k, k
    else:
        a = beta * normalize(k + 0.3 * rnd(B, T, H, K), dim=-1)
        b, e = k, rnd(B, T, H, K) / math.sqrt(K)
    out = {
        "i": rnd(B, T, H, D),
        "e": e,
        "s": normalize(rnd(B, T, H, K), dim=-1),
        "a": a,
        "b": b,
        "log_o": None,
        "initial_state": rnd(B, H, K, D) if initial else None,
    }
    if gate == "dd":
        out["log_o"] = logsigmoid(rnd(B, T, H) + 2.0)
    elif gate == "head":
        out["log_o"] = logsigmoid(rnd(H) + 2.0)
    return out


def reference(i, e, s, a, b, log_o, initial_state):
    """The definition, m_t = exp(log_o_t) (I - a_t b_t^T) m_{t-1} + e_t i_t^T, y_t = m_t^T s_t,
    as a plain autograd loop (unbind, not x[:, t], keeps the backward linear in T)."""
    B, T, H, D = i.shape
    K = e.shape[-1]
    m = initial_state if initial_state is not None else i.new_zeros(B, H, K, D)
    if log_o is None:
        gates = [None] * T
    elif log_o.dim() == 1:
        gates = [log_o.exp()] * T
    else:
        gates = log_o.exp().unbind(1)
    ys = []
    for i_t, e_t, s_t, a_t, b_t, o_t in zip(
        i.unbind(1), e.unbind(1), s.unbind(1), a.unbind(1), b.unbind(1), gates, strict=False
    ):
        f = torch.eye(K, dtype=m.dtype) - a_t.unsqueeze(-1) * b_t.unsqueeze(-2)  # [B, H, K, K]
        if o_t is not None:
            f = o_t[..., None, None] * f
        m = f @ m + e_t.unsqueeze(-1) * i_t.unsqueeze(-2)
        ys.append((s_t.unsqueeze(-1) * m).sum(-2))
    y = torch.stack(ys, 1) if ys else i.new_zeros(B, 0, H, D)
    return y, m


def run(inputs, mode, dtype, chunk_size=16, seed=1, autocast=False):
    """y, m_T and the gradient of every input under random cotangents on y and m_T (with autocast
    the forward runs under bfloat16 autocast, the backward outside it)."""
    leaves = {n: (x.detach().to(dtype).requires_grad_() if x is not None else None) for n, x in inputs.items()}
    args = [leaves[n] for n in NAMES[:6]]
    if mode == "reference":
        y, m = reference(*args, leaves["initial_state"])
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, m = eos_delta(
                *args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, chunk_size=chunk_size
            )
    gen = torch.Generator().manual_seed(seed)

    def cot(t):
        return torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype)

    names = [n for n in NAMES if leaves[n] is not None]
    grads = torch.autograd.grad((y, m), [leaves[n] for n in names], (cot(y), cot(m)))
    return {"y": y, "m_T": m, **{f"d{n}": gr for n, gr in zip(names, grads, strict=False)}}


def check(inputs, mode, dtype, chunk_size=16, context=""):
    expected = run(inputs, "reference", torch.float64)
    actual = run(inputs, mode, dtype, chunk_size=chunk_size)
    assert_close(actual, expected, dtype=dtype, context=f"{mode} {dtype} C={chunk_size} {context}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 257])
@pytest.mark.parametrize("gate", ["none", "dd", "head"])
def test_matches_reference(dtype, mode, T, gate):
    """chunk (WY form) and the custom-backward recurrence equal the autograd loop: y, m_T, every
    gradient. C = 16 does not divide 63, 65, 257; the recurrent backward recomputes from
    checkpoints every 16 steps. The initial state alternates with T to cover both cases."""
    initial = T % 2 == 1
    check(make_inputs(T, gate=gate, initial=initial), mode, dtype, context=f"T={T} gate={gate} m0={initial}")


@pytest.mark.parametrize("T", [1, 2, 65])
def test_auto_matches_reference(T):
    """auto: recurrent for T <= 1, chunk otherwise; both must give the definition."""
    check(make_inputs(T, gate="dd", initial=True), "auto", torch.float64, context=f"T={T}")


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64, 65, 100])
def test_chunk_sizes(mode, chunk_size):
    check(make_inputs(65, gate="dd", initial=False), mode, torch.float64, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate", ["dd", "head"])
@pytest.mark.parametrize("kind", ["general", "deltanet"])
def test_strong_gates_keep_the_gate_gradient(dtype, gate, kind):
    """Every step's log gate in [-30, -20]: the gate's gradient is O(gate), and the chunk maps'
    weights over no step (e^{c_{t-1} - c_{t-1}}, the chunk's last e^{c_C - c_C}, ...) took part in
    it through differences whose O(1) terms cancelled after rounding (relative error 0.9 at -20 a
    step in float32, 1e13 at -50). C = 5 does not divide 23."""
    x = make_inputs(23, gate=gate, kind=kind)
    x["log_o"] = -20.0 - 10.0 * torch.rand(x["log_o"].shape, generator=torch.Generator().manual_seed(2))
    check(x, "chunk", dtype, chunk_size=5, context=f"strong {gate} {kind}")


@pytest.mark.parametrize("kind", ["deltanet", "m1"])
@pytest.mark.parametrize("initial", [False, True])
def test_special_parameterisations(kind, initial):
    """The Table 7 rows the mixers use, where a, e (and b) are the same vector up to beta (here as
    separate tensors, so the general path; the shared-tensor fast path is tested below)."""
    check(
        make_inputs(129, gate="none", initial=initial, kind=kind), "chunk", torch.float32, chunk_size=32, context=kind
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate", ["none", "dd", "head"])
def test_shared_a_and_e(dtype, gate):
    """DeltaNet passes one tensor as both a and e (beta k); chunk mode then takes its fast path
    (C x C products computed once, scaled by the gate). The gradient of that tensor sums both uses."""
    x = make_inputs(65, gate=gate, kind="deltanet")

    def go(mode, dt):
        leaves = {n: (t.detach().to(dt).requires_grad_() if t is not None else None) for n, t in x.items() if n != "e"}
        args = (leaves["i"], leaves["a"], leaves["s"], leaves["a"], leaves["b"], leaves["log_o"])
        if mode == "reference":
            y, m = reference(*args, leaves["initial_state"])
        else:
            y, m = eos_delta(
                *args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, chunk_size=16
            )
        gen = torch.Generator().manual_seed(1)
        cots = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype) for t in (y, m)]
        names = [n for n, t in leaves.items() if t is not None]
        grads = torch.autograd.grad((y, m), [leaves[n] for n in names], cots)
        return {"y": y, "m_T": m, **{f"d{n}": gr for n, gr in zip(names, grads, strict=False)}}

    assert_close(go("chunk", dtype), go("reference", torch.float64), dtype=dtype, context=f"shared a=e {gate}")


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "auto"])
def test_carried_state_equals_one_pass(mode):
    x = make_inputs(70, gate="dd", initial=True)
    args = [x[n] for n in NAMES[:6]]
    y, m = eos_delta(*args, mode=mode, initial_state=x["initial_state"], output_final_state=True, chunk_size=16)

    def cut(t, sl):
        return t[:, sl]

    y1, m1 = eos_delta(
        *[cut(t, slice(0, 29)) for t in args],
        mode=mode,
        initial_state=x["initial_state"],
        output_final_state=True,
        chunk_size=16,
    )
    y2, m2 = eos_delta(
        *[cut(t, slice(29, None)) for t in args], mode=mode, initial_state=m1, output_final_state=True, chunk_size=16
    )
    assert_close({"y": torch.cat([y1, y2], 1), "m_T": m2}, {"y": y, "m_T": m}, context=mode)


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "auto"])
@pytest.mark.parametrize("initial", [False, True])
def test_empty_sequence(mode, initial):
    x = make_inputs(0, gate="dd", initial=initial)
    y, m = eos_delta(*[x[n] for n in NAMES[:6]], mode=mode, initial_state=x["initial_state"], output_final_state=True)
    assert y.shape == (B, 0, H, D)
    expected = x["initial_state"] if initial else torch.zeros(B, H, K, D, dtype=torch.float64)
    assert_close({"m_T": m}, {"m_T": expected})


@pytest.mark.parametrize("mode", ["chunk", "auto"])
@pytest.mark.parametrize("dims", [(0, H, K, D), (B, 0, K, D), (B, H, 0, D), (B, H, K, 0)])
def test_empty_dimensions(mode, dims):
    """An empty batch, head, key or value dimension gives the recurrence's (empty or zero) outputs;
    the chunk form's reshape of its output failed on an empty batch, head or width."""
    x = make_inputs(5, gate="dd", dims=dims)
    args = [x[n] for n in NAMES[:6]]
    y, m = eos_delta(*args, mode=mode, initial_state=x["initial_state"], output_final_state=True)
    y_ref, m_ref = eos_delta(*args, mode="recurrent", initial_state=x["initial_state"], output_final_state=True)
    assert torch.equal(y, y_ref) and torch.equal(m, m_ref)


def test_no_final_state_unless_asked():
    x = make_inputs(3)
    y, m = eos_delta(*[x[n] for n in NAMES[:6]], initial_state=x["initial_state"])
    assert m is None and y.shape == (B, 3, H, D)


def test_half_precision_computes_in_float32():
    x = make_inputs(20, gate="dd")
    half = {n: t.to(torch.bfloat16) for n, t in x.items()}
    y, m = eos_delta(
        *[half[n] for n in NAMES[:6]],
        initial_state=half["initial_state"],
        output_final_state=True,
        mode="chunk",
        chunk_size=8,
    )
    assert y.dtype == torch.bfloat16 and m.dtype == torch.float32
    y_ref, m_ref = reference(*[half[n].to(torch.float64) for n in NAMES])
    assert_close({"y": y}, {"y": y_ref}, dtype=torch.bfloat16)
    # the memory is returned in float32, so it is held to float32's tolerance (bfloat16's would
    # pass a memory rounded to bfloat16)
    assert_close({"m_T": m}, {"m_T": m_ref}, dtype=torch.float32)
    # carried into the next call, that float32 state leaves y bfloat16 (it made y float32)
    y_next, m_next = eos_delta(*[half[n] for n in NAMES[:6]], initial_state=m, output_final_state=True)
    assert y_next.dtype == torch.bfloat16 and m_next.dtype == torch.float32


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_autocast_leaves_the_operator_in_float32(mode):
    """Under torch.autocast the WY form's matmuls (and so the gradients) stay in float32."""
    x = make_inputs(45, gate="dd")
    expected = run(x, "reference", torch.float64)
    actual = run(x, mode, torch.float32, autocast=True)
    assert_close(actual, expected, dtype=torch.float32, context=mode)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_gradcheck(mode):
    """Finite differences on a tiny float64 problem: chunk (C = 2, partial last chunk) and the
    hand-written Type 2 backward (checkpoints every 2 steps, recomputation in between)."""
    x = make_inputs(5, gate="dd", initial=True, seed=3, dims=(1, 1, 3, 2))
    leaves = [x[n].clone().requires_grad_() for n in NAMES]

    def f(*args):
        return eos_delta(*args[:6], mode=mode, initial_state=args[6], output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(f, leaves)


# ----------------------------------------------------------------------------- errors


def _args(**override):
    x = make_inputs(4)
    x.update(override)
    return x


def _call(x, **kw):
    return eos_delta(*[x[n] for n in NAMES[:6]], initial_state=x["initial_state"], **kw)


@pytest.mark.parametrize(
    "name,shape,pattern",
    [
        ("i", (B, 4, H), r"i: expected \[B, T, H, D\]"),
        ("e", (B, 4, H, K, 1), r"e: expected \[B, T, H, K\]"),
        ("s", (B, 5, H, K), r"s: expected \[B, T, H, K\] = \[2, 4, 2, 5\].*got \[2, 5, 2, 5\]"),
        ("a", (B, 4, H + 1, K), r"a: expected \[B, T, H, K\] = \[2, 4, 2, 5\].*got \[2, 4, 3, 5\]"),
        ("b", (B, 4, H, K + 1), r"b: expected \[B, T, H, K\] = \[2, 4, 2, 5\].*got \[2, 4, 2, 6\]"),
        ("s", (B + 1, 4, H, K), r"s: expected \[B, T, H, K\] = \[2, 4, 2, 5\].*got \[3, 4, 2, 5\]"),
        ("log_o", (B, 4, H, 1), r"log_o: expected a scalar gate .* got 4-d tensor \[2, 4, 2, 1\]"),
        ("log_o", (B, 3, H), r"log_o: expected \[B, T, H\] = \[2, 4, 2\] or \[H\] = \[2\], got \[2, 3, 2\]"),
        ("log_o", (H + 1,), r"log_o: expected .* got \[3\]"),
        ("initial_state", (B, H, D, K), r"initial_state: expected \[B, H, K, D\] = \[2, 2, 5, 4\], got \[2, 2, 4, 5\]"),
    ],
)
def test_shape_errors(name, shape, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call(_args(**{name: torch.randn(*shape, dtype=torch.float64)}))


@pytest.mark.parametrize("name", ["i", "e", "s", "a", "b", "log_o", "initial_state"])
def test_integer_dtype_is_a_type_error(name):
    x = _args()
    with pytest.raises(TypeError, match=f"{name}: expected a real floating-point tensor, got dtype torch.int64"):
        _call(_args(**{name: x[name].to(torch.int64)}))


def test_complex_is_a_type_error():
    x = _args()
    with pytest.raises(TypeError, match="e: eos_delta supports real"):
        _call(_args(e=torch.complex(x["e"], x["e"])))


def test_mixed_devices():
    x = _args()
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        _call(_args(b=x["b"].to("meta")))


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, True])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(ValueError, match="chunk_size: expected an integer >= 1"):
        _call(_args(), chunk_size=chunk_size)


def test_output_final_state_is_a_bool():
    with pytest.raises(ValueError, match=r"^output_final_state: expected True or False, got 'no'"):
        _call(_args(), output_final_state="no")


def test_unknown_mode():
    with pytest.raises(ValueError, match="mode: expected one of auto, recurrent, chunk, triton, got 'fft'"):
        _call(_args(), mode="fft")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["chunk", "recurrent", "auto"])
@pytest.mark.parametrize("gate,where", [("dd", 0), ("dd", 30), ("dd", 64), ("dd", "all"), ("head", 0), ("head", "all")])
def test_a_gate_of_exactly_zero(gate, where, mode, dtype):
    """log_o = -inf (the gate is exactly 0, as log(sigmoid(x)) gives for x <= -104 in float32) at
    one step (first, inside a chunk, last), in one head of a per-head gate, or everywhere: no NaN
    from -inf - (-inf) in the chunk form's cumulative gates; y, m_T and every gradient the
    definition's (dlog_o 0 there)."""
    inputs = make_inputs(65, gate=gate, initial=True, seed=3)
    log_o = inputs["log_o"].clone()
    if where == "all":
        log_o.fill_(-math.inf)
    elif gate == "head":
        log_o[0] = -math.inf
    else:
        log_o[:, where] = -math.inf
    inputs["log_o"] = log_o
    check(inputs, mode, dtype, context=f"gate {gate} -inf at {where}")
