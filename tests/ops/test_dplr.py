"""``eos_dplr`` (the diagonal-plus-low-rank transition) against its definition.

The reference is a plain autograd loop written out here with explicit K x K transition matrices,
m_t = (diag(exp(log_alpha_t)) - a_t b_t^T) m_{t-1} + e_t i_t^T, y_t = m_t^T s_t (micro-steps: one
such factor each, the decay on the first), run in float64 on the same values, so float32 results
are judged against the exact answer. Every mode is compared on y, the final state and the
gradients of every input (the initial state's and the decay's included) under random cotangents.

Conditioning: b = k is L2-normalised and a = beta * normalize(k + 0.3 r) stays within a small
angle of it, so D - a b^T (D <= I) is close to non-expansive and long products stay bounded; with
raw Gaussian a, b the comparison would measure the blow-up of the product, not the algorithm.
"""

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm.ops import eos_delta, eos_dplr, explain_dplr
from lcsm.testing import assert_close, gradients, rel_rms

B, H, K, D = 2, 2, 5, 4  # K != D so a transposed memory cannot pass
NAMES = ("i", "e", "s", "a", "b", "log_alpha", "initial_state")
LAYOUTS = ("none", "head", "scalar", "head_row", "row")


def make_inputs(T, *, layout="row", n=None, beta=None, decay=2.0, initial=True, seed=0):
    """layout: the log_alpha shape (none, head [H], scalar [B, T, H], head_row [H, K], row
    [B, T, H, K]); n: micro-steps per token (None: no micro-step axis); beta: a fixed beta (a = beta
    b, e.g. 2 for a reflection) instead of a random one near b; decay: the logsigmoid offset
    (smaller is stronger)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    micro = (n,) if n is not None else ()
    k = normalize(rnd(B, T, H, *micro, K), dim=-1)
    if beta is None:
        a = torch.sigmoid(rnd(B, T, H, *micro, 1)) * normalize(k + 0.3 * rnd(*k.shape), dim=-1)
    else:
        a = beta * k
    log_alpha = {
        "none": None,
        "head": lambda: logsigmoid(rnd(H) + decay),
        "scalar": lambda: logsigmoid(rnd(B, T, H) + decay),
        "head_row": lambda: logsigmoid(rnd(H, K) + decay),
        "row": lambda: logsigmoid(rnd(B, T, H, K) + decay),
    }[layout]
    return {
        "i": rnd(B, T, H, *micro, D),
        "e": rnd(B, T, H, *micro, K) / K**0.5,
        "s": normalize(rnd(B, T, H, K), dim=-1),
        "a": a,
        "b": k,
        "log_alpha": log_alpha() if log_alpha is not None else None,
        "initial_state": rnd(B, H, K, D) if initial else None,
    }


def reference(i, e, s, a, b, log_alpha, initial_state):
    """The definition with explicit transition matrices (unbind keeps the backward linear in T)."""
    Bn, T = s.shape[:2]
    if a.dim() == 4:  # no micro-step axis: one micro-step per token
        i, e, a, b = (x.unsqueeze(3) for x in (i, e, a, b))
    n = a.shape[3]
    m = initial_state if initial_state is not None else i.new_zeros(Bn, H, K, i.shape[-1])
    if log_alpha is None:
        decays = [torch.ones(Bn, H, K, dtype=i.dtype)] * T
    elif log_alpha.dim() in (1, 2):  # [H] or [H, K]: the same every step
        decays = [log_alpha.exp().reshape(1, H, -1).expand(Bn, H, K)] * T
    else:  # [B, T, H] or [B, T, H, K]
        decays = [d.reshape(Bn, H, -1).expand(Bn, H, K) for d in log_alpha.exp().unbind(1)]
    ys = []
    for t, (i_t, e_t, s_t, a_t, b_t) in enumerate(zip(*(x.unbind(1) for x in (i, e, s, a, b)), strict=True)):
        for j in range(n):
            diag = decays[t] if j == 0 else torch.ones(Bn, H, K, dtype=i.dtype)
            f = torch.diag_embed(diag) - a_t[:, :, j, :, None] * b_t[:, :, j, None, :]  # [Bn, H, K, K]
            m = f @ m + e_t[:, :, j, :, None] * i_t[:, :, j, None, :]
        ys.append((s_t.unsqueeze(-1) * m).sum(-2))
    y = torch.stack(ys, 1) if ys else i.new_zeros(Bn, 0, H, i.shape[-1])
    return y, m


def run(inputs, mode, dtype=torch.float64, **kw):
    leaves = {n: (x.detach().to(dtype).requires_grad_() if x is not None else None) for n, x in inputs.items()}
    args = [leaves[n] for n in NAMES[:6]]
    if mode == "reference":
        y, m = reference(*args, leaves["initial_state"])
    else:
        y, m = eos_dplr(*args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, **kw)
    return gradients({"y": y, "m_T": m}, {n: x for n, x in leaves.items() if x is not None})


def check(inputs, mode, dtype=torch.float64, context="", **kw):
    expected = run(inputs, "reference")
    actual = run(inputs, mode, dtype, **kw)
    return assert_close(actual, expected, dtype=dtype, context=f"{mode} {dtype} {kw} {context}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["recurrent", "chunk", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("T", [1, 23])
def test_matches_reference(dtype, mode, layout, T):
    """Every form, every log_alpha layout: y, m_T and all gradients (C = 8 does not divide 23)."""
    check(make_inputs(T, layout=layout), mode, dtype, context=layout, chunk_size=8)


@pytest.mark.parametrize("T", [23, 37])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 16, 64])
@pytest.mark.parametrize("layout", ["scalar", "row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_sizes(T, chunk_size, layout, dtype):
    """C = 1 and 2 also make the backward recompute several spans (16 chunks each)."""
    check(make_inputs(T, layout=layout, seed=T), "chunk", dtype, chunk_size=chunk_size)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("layout", ["none", "scalar", "row"])
@pytest.mark.parametrize("chunk_size", [1, 5])
def test_micro_steps(n, mode, layout, chunk_size):
    """Products of n factors per token (DeltaProduct) against the written-out loop; C = 5 puts
    chunk borders inside tokens, C = 1 makes the backward recompute several spans."""
    check(make_inputs(17, layout=layout, n=n), mode, chunk_size=chunk_size)


@pytest.mark.parametrize("n", [2, 3])
def test_micro_steps_are_interleaved_tokens(n):
    """n micro-steps per token equal T n single steps with the decay on each token's first, read
    every n-th."""
    x = make_inputs(11, layout="row", n=n)
    T = 11
    flat = {k: x[k].transpose(2, 3).reshape(B, T * n, H, -1) for k in ("i", "e", "a", "b")}
    log_alpha = torch.zeros(B, T, n, H, K, dtype=torch.float64)
    log_alpha[:, :, 0] = x["log_alpha"]
    s = torch.zeros(B, T, n, H, K, dtype=torch.float64)
    s[:, :, -1] = x["s"]
    y_flat, m_flat = eos_dplr(
        flat["i"],
        flat["e"],
        s.reshape(B, T * n, H, K),
        flat["a"],
        flat["b"],
        log_alpha.reshape(B, T * n, H, K),
        mode="recurrent",
        initial_state=x["initial_state"],
        output_final_state=True,
    )
    for mode in ("recurrent", "chunk"):
        y, m = eos_dplr(
            *(x[k] for k in NAMES[:6]), mode=mode, initial_state=x["initial_state"], output_final_state=True
        )
        assert_close({"y": y, "m_T": m}, {"y": y_flat[:, n - 1 :: n], "m_T": m_flat}, context=mode)


@pytest.mark.parametrize("layout", ["scalar", "row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decays_stay_finite(layout, dtype):
    """log alpha down to -30 per step (and -inf) in one chunk: no e^{+cumulative} factor overflows."""
    x = make_inputs(40, layout=layout)
    g = torch.Generator().manual_seed(5)
    x["log_alpha"] = -30 * torch.rand(x["log_alpha"].shape, generator=g, dtype=torch.float64)
    x["log_alpha"].view(-1)[::7] = float("-inf")
    # The reference differentiates exp(-inf) = 0 into NaN-free zeros; the gradient wrt a -inf log
    # is meaningless, so compare forward outputs and the other gradients.
    expected = run(x, "reference")
    for C in (16, 64):
        actual = run(x, "chunk", dtype, chunk_size=C)
        for name, value in actual.items():
            assert value is None or torch.isfinite(value).all(), f"{name} not finite, C={C}"
        keep = {k: v for k, v in expected.items() if k != "dlog_alpha"}
        assert_close({k: actual[k] for k in keep}, keep, dtype=dtype, context=f"C={C}")


@pytest.mark.parametrize("layout", ["none", "scalar", "row"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_beta_two(layout, mode):
    """beta = 2 (negative eigenvalues: I - 2 k k^T, a reflection) over 64 steps."""
    x = make_inputs(64, layout=layout, beta=2.0)
    check(x, mode, torch.float32, chunk_size=16)
    check(x, mode, torch.float64, chunk_size=16)


def test_half_precision_computes_in_float32():
    x = make_inputs(23, layout="row")
    args = [x[k].to(torch.bfloat16) if x[k] is not None else None for k in NAMES[:6]]
    y, m = eos_dplr(*args, mode="chunk", initial_state=x["initial_state"].bfloat16(), output_final_state=True)
    assert y.dtype == torch.bfloat16 and m.dtype == torch.float32
    y32, m32 = eos_dplr(
        *(a.float() for a in args),
        mode="recurrent",
        initial_state=x["initial_state"].bfloat16().float(),
        output_final_state=True,
    )
    assert rel_rms(y, y32) < 1e-2 and rel_rms(m, m32) < 1e-5


def test_autocast_leaves_the_operator_in_float32():
    x = make_inputs(23, layout="scalar")
    args = [x[k].float() for k in NAMES[:6]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = eos_dplr(*args, mode="chunk")
    y32, _ = eos_dplr(*args, mode="recurrent")
    assert y.dtype == torch.float32 and rel_rms(y, y32) < 1e-5


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("n", [None, 2])
def test_gradcheck(mode, n, monkeypatch):
    """Spans of one chunk: the recomputing backward chains three spans."""
    import lcsm.ops.dplr as dplr

    monkeypatch.setattr(dplr, "SPAN_CHUNKS", 1)
    x = make_inputs(5, layout="row", n=n)
    inputs = tuple(x[k].detach().clone().requires_grad_() for k in NAMES)

    def f(*args):
        return eos_dplr(*args[:6], mode=mode, initial_state=args[6], output_final_state=True, chunk_size=2)

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def test_packed_gradcheck(monkeypatch):
    import lcsm.ops.dplr as dplr

    monkeypatch.setattr(dplr, "SPAN_CHUNKS", 1)
    x = make_inputs(6, layout="scalar")
    inputs = [x[k][:1].detach().clone().requires_grad_() for k in NAMES[:6]]
    inputs.append(torch.randn(3, H, K, D, dtype=torch.float64, requires_grad=True))
    cu = torch.tensor([0, 3, 4, 6])

    def f(*args):
        return eos_dplr(
            *args[:6], mode="chunk", initial_state=args[6], output_final_state=True, chunk_size=2, cu_seqlens=cu
        )

    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


def test_no_final_state_unless_asked():
    x = make_inputs(3)
    assert eos_dplr(*(x[k] for k in NAMES[:6]))[1] is None


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "auto"])
def test_empty_sequence(mode):
    x = make_inputs(0)
    y, m = eos_dplr(*(x[k] for k in NAMES[:6]), mode=mode, initial_state=x["initial_state"], output_final_state=True)
    assert y.shape == (B, 0, H, D) and torch.equal(m, x["initial_state"])


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "auto"])
@pytest.mark.parametrize("layout", ["head", "scalar", "row"])
@pytest.mark.parametrize("n", [None, 2])
@pytest.mark.parametrize("span", [16, 2])
def test_packed_equals_each_document_alone(mode, layout, n, span, monkeypatch):
    """Values, final states and every gradient; span 2 makes the recomputing backward cross
    document starts and ends inside and between spans."""
    import lcsm.ops.dplr as dplr

    monkeypatch.setattr(dplr, "SPAN_CHUNKS", span)
    lengths = [7, 1, 12, 3]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(T, layout=layout, n=n)
    x1 = {k: (v[:1] if v is not None and v.dim() >= 3 and k != "initial_state" else v) for k, v in x.items()}
    m0 = torch.randn(len(lengths), H, K, D, dtype=torch.float64)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in x1.items() if k != "initial_state" and v is not None}
    leaves["initial_state"] = m0.clone().requires_grad_()
    args = [leaves.get(k) for k in NAMES[:6]]
    y, m = eos_dplr(
        *args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu, chunk_size=4
    )
    got = gradients({"y": y, "m_T": m}, leaves)
    ys, ms = [], []
    for n_doc in range(len(lengths)):
        lo, hi = cu[n_doc].item(), cu[n_doc + 1].item()
        timed = [a[:, lo:hi] if a is not None and a.dim() >= 3 else a for a in args]
        y_n, m_n = reference(*timed, leaves["initial_state"][n_doc : n_doc + 1])
        ys.append(y_n)
        ms.append(m_n)
    want = gradients({"y": torch.cat(ys, 1), "m_T": torch.cat(ms, 0)}, leaves)
    assert_close(got, want, context=f"{mode} {layout} n={n}")


def _args(**override):
    x = make_inputs(4)
    x.update(override)
    return x


def _call(x, **kw):
    return eos_dplr(*(x[k] for k in NAMES[:6]), initial_state=x["initial_state"], **kw)


@pytest.mark.parametrize(
    ("name", "shape", "pattern"),
    [
        ("s", (B, 4, H), r"s: expected \[B, T, H, K\]"),
        ("e", (B, 4, H, K + 1), r"e: expected \[B, T, H, K\]"),
        ("a", (B, 3, H, K), r"a: expected|e: expected"),
        ("b", (B, 4, H, 2, K), r"b: expected \[B, T, H, K\]"),
        ("i", (B, 4, H + 1, D), r"i: expected \[B, T, H, D\]"),
        ("log_alpha", (B, 4, H, K + 1), r"log_alpha: expected None"),
        ("log_alpha", (K,), r"log_alpha: expected None"),
        ("initial_state", (B, H, D, K), r"initial_state: expected \[B, H, K, D\]"),
    ],
)
def test_shape_errors(name, shape, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call(_args(**{name: torch.zeros(shape, dtype=torch.float64)}))


def test_micro_step_shape_errors():
    x = make_inputs(4, n=2)
    x["e"] = x["e"][:, :, :, :1]
    with pytest.raises(ValueError, match=r"e: expected \[B, T, H, n, K\]"):
        _call(x)
    x = make_inputs(4, n=2)
    x["i"] = x["i"][:, :, :, 0]
    with pytest.raises(ValueError, match=r"i: expected \[B, T, H, n, D\]"):
        _call(x)


def test_bad_options():
    x = _args()
    with pytest.raises(ValueError, match="mode: expected one of auto, recurrent, chunk"):
        _call(x, mode="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        _call(x, chunk_size=0)
    with pytest.raises(ValueError, match="initial_state: with cu_seqlens"):
        x1 = {k: (v[:1] if v is not None and v.dim() >= 3 else v) for k, v in x.items()}
        _call(x1, cu_seqlens=torch.tensor([0, 2, 4]))


@pytest.mark.parametrize("n", [None, 2])
def test_decoding_step_by_step_equals_one_pass(n):
    """The T = 1 path of auto (one recurrent step, no chunk machinery) carried token by token
    equals one chunk pass; so do two carried chunk passes."""
    x = make_inputs(13, layout="row", n=n)
    args = [x[k] for k in NAMES[:6]]
    y, m = eos_dplr(*args, mode="chunk", initial_state=x["initial_state"], output_final_state=True, chunk_size=4)
    state, ys = x["initial_state"], []
    for t in range(13):
        y_t, state = eos_dplr(*(a[:, t : t + 1] for a in args), initial_state=state, output_final_state=True)
        ys.append(y_t)
    assert_close({"y": torch.cat(ys, 1), "m_T": state}, {"y": y, "m_T": m}, context="steps")
    y1, m1 = eos_dplr(*(a[:, :6] for a in args), initial_state=x["initial_state"], output_final_state=True)
    y2, m2 = eos_dplr(*(a[:, 6:] for a in args), initial_state=m1, output_final_state=True)
    assert_close({"y": torch.cat([y1, y2], 1), "m_T": m2}, {"y": y, "m_T": m}, context="two passes")


def test_packed_chunk_runs_no_loop_over_documents(monkeypatch):
    """Packed chunk calls the chunk form once for the whole row."""
    import lcsm.ops.dplr as dplr

    calls = []
    real = dplr.dplr_chunk
    monkeypatch.setattr(dplr, "dplr_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = make_inputs(20, layout="row")
    args = [v[:1] for v in (x[k] for k in NAMES[:6])]
    eos_dplr(*args, mode="chunk", cu_seqlens=torch.tensor([0, 5, 6, 20]), chunk_size=4)
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["chunk", "auto"])
@pytest.mark.parametrize("layout", ["none", "row"])
@pytest.mark.parametrize("chunk_size", [2, 8])
def test_shared_a_and_e(mode, layout, chunk_size):
    """One tensor passed as a and e (DeltaNet's beta k) takes the shared-product path; its
    gradient is the sum of both roles (C = 2 recomputes two spans in backward)."""
    x = make_inputs(37, layout=layout)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    leaves["e"] = leaves["a"]
    args = [leaves.get(k) for k in ("i", "a", "s", "a", "b", "log_alpha")]
    y, m = eos_dplr(
        *args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, chunk_size=chunk_size
    )
    wrt = {k: v for k, v in leaves.items() if k != "e"}
    got = gradients({"y": y, "m_T": m}, wrt)
    want = gradients(dict(zip(("y", "m_T"), reference(*args, leaves["initial_state"]), strict=True)), wrt)
    assert_close(got, want, context=f"{mode} {layout} C={chunk_size}")


def test_explain_dplr():
    x = make_inputs(23, layout="row")
    args = [x[k] for k in NAMES[:6]]
    plan = explain_dplr(*args)
    assert plan.mode == "chunk" and plan.kernel == "wy" and "per-row decay" in plan.reason
    assert explain_dplr(*(a[:, :1] for a in args)).mode == "recurrent"
    assert explain_dplr(*args, mode="recurrent").kernel == "loop"
    assert "a is e" in explain_dplr(args[0], args[3], *args[2:]).reason
    packed = explain_dplr(*(a[:1] for a in args), cu_seqlens=torch.tensor([0, 5, 23]))
    assert "2 documents" in packed.reason
    with pytest.raises(ValueError, match="initial_state: with cu_seqlens"):
        explain_dplr(*(a[:1] for a in args), initial_state=x["initial_state"][:1], cu_seqlens=torch.tensor([0, 5, 23]))
    with pytest.raises(ValueError, match="mode: expected one of"):
        explain_dplr(*args, mode="fast")


@pytest.mark.parametrize("gate", [None, "step", "head"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eos_delta_is_the_scalar_gate_row(gate, dtype):
    """``eos_delta(i, e, s, a, b, log_o)`` ≡ ``eos_dplr(i, e, s, exp(log_o) a, b, log_o)``: the delta
    rule's own kernel is this family's scalar-gate member (values, final states, every gradient)."""
    g = torch.Generator().manual_seed(5)
    B, T, H, K, D = 2, 23, 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    k = normalize(rand(B, T, H, K), dim=-1)
    beta = torch.rand(B, T, H, 1, generator=g, dtype=dtype)
    i, s, m0 = rand(B, T, H, D), rand(B, T, H, K), rand(B, H, K, D)
    log_o = {None: None, "step": logsigmoid(rand(B, T, H)), "head": logsigmoid(rand(H))}[gate]
    wrt = {"i": i, "k": k, "beta": beta, "s": s, "m0": m0}
    if log_o is not None:
        wrt["log_o"] = log_o
    for t in wrt.values():
        t.requires_grad_()
    gamma = 1.0 if log_o is None else (log_o.exp()[..., None] if log_o.dim() == 3 else log_o.exp()[:, None])
    y, m = eos_delta(i, beta * k, s, beta * k, k, log_o, initial_state=m0, output_final_state=True, chunk_size=5)
    y2, m2 = eos_dplr(
        i, beta * k, s, gamma * beta * k, k, log_o, initial_state=m0, output_final_state=True, chunk_size=5
    )
    assert_close({"y": y2, "m": m2}, {"y": y, "m": m}, context=f"gate {gate}")
    assert_close(gradients({"y": y2, "m": m2}, wrt), gradients({"y": y, "m": m}, wrt), dtype=dtype)
