"""``eos_dplr`` (the diagonal-plus-low-rank transition) against its definition.

The reference is a plain autograd loop written out here with explicit K x K transition matrices,
m_t = (diag(exp(log_alpha_t)) - a_t b_t^T) m_{t-1} + e_t i_t^T, y_t = m_t^T s_t (micro-steps: one
such factor each, the decay on the first), run in float64 on the same values, so float32 results
are judged against the exact answer. Every mode is compared on y, the final state and the
gradients of every input (the initial state's and the decay's included) under random cotangents.
With ``gate_first`` the loop's first factor of a token is the product D(alpha_t) (I - a_t b_t^T).

The chunk form of one step per token with no decay or a scalar one (layouts none, head, scalar
without micro-steps) runs on eos_delta's kernel, the others on eos_dplr's own WY / UT form
(test_routing); every test below covers both unless it names its layouts.

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


def reference(i, e, s, a, b, log_alpha, initial_state, gate_first=False):
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
            low_rank = a_t[:, :, j, :, None] * b_t[:, :, j, None, :]  # [Bn, H, K, K]
            if gate_first:
                f = torch.diag_embed(diag) @ (torch.eye(K, dtype=i.dtype) - low_rank)
            else:
                f = torch.diag_embed(diag) - low_rank
            m = f @ m + e_t[:, :, j, :, None] * i_t[:, :, j, None, :]
        ys.append((s_t.unsqueeze(-1) * m).sum(-2))
    y = torch.stack(ys, 1) if ys else i.new_zeros(Bn, 0, H, i.shape[-1])
    return y, m


def run(inputs, mode, dtype=torch.float64, **kw):
    leaves = {n: (x.detach().to(dtype).requires_grad_() if x is not None else None) for n, x in inputs.items()}
    args = [leaves[n] for n in NAMES[:6]]
    if mode == "reference":
        y, m = reference(*args, leaves["initial_state"], gate_first=kw.get("gate_first", False))
    else:
        y, m = eos_dplr(*args, mode=mode, initial_state=leaves["initial_state"], output_final_state=True, **kw)
    return gradients({"y": y, "m_T": m}, {n: x for n, x in leaves.items() if x is not None})


def check(inputs, mode, dtype=torch.float64, context="", **kw):
    expected = run(inputs, "reference", gate_first=kw.get("gate_first", False))
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
@pytest.mark.parametrize("layout", ["none", "head", "scalar", "row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunk_sizes(T, chunk_size, layout, dtype):
    """eos_delta's kernel (none, head, scalar) and the WY / UT form (row); C = 1 and 2 also make
    each one's backward recompute several spans (16 and 8 chunks each)."""
    check(make_inputs(T, layout=layout, seed=T), "chunk", dtype, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [None, 2])
def test_gate_first(dtype, mode, layout, n):
    """gate_first: each token's first factor is D(alpha_t) (I - a_t b_t^T), against the loop's
    literal product (y, m_T, every gradient: the decay's reaches it through both roles). C = 5
    divides neither 23 steps nor 46 micro-steps."""
    check(make_inputs(23, layout=layout, n=n), mode, dtype, context=layout, chunk_size=5, gate_first=True)


@pytest.mark.parametrize("n", [None, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_routing(layout, n, monkeypatch):
    """The chunk form runs on eos_delta's kernel exactly where it serves the structure (one step per
    token and no or a scalar decay), packed rows included, and explain_dplr names the kernel."""
    import lcsm.ops.dplr as dplr

    calls = []
    for name in ("_delta_chunk", "_delta_chunk_packed", "dplr_chunk"):
        real = getattr(dplr, name)
        monkeypatch.setattr(dplr, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = make_inputs(9, layout=layout, n=n)
    args = [v[:1] if v is not None and v.dim() >= 3 else v for v in (x[k] for k in NAMES[:6])]
    routed = n is None and layout in ("none", "head", "scalar")
    for cu in (None, torch.tensor([0, 4, 9])):
        calls.clear()
        eos_dplr(*args, mode="chunk", chunk_size=4, cu_seqlens=cu)
        assert calls == [("_delta_chunk" if cu is None else "_delta_chunk_packed") if routed else "dplr_chunk"]
        plan = explain_dplr(*args, mode="chunk", chunk_size=4, cu_seqlens=cu)
        assert plan.kernel == ("delta" if routed else "wy"), plan


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [None, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_traced_chunk_form(layout, n, dtype, monkeypatch):
    """The chunk forms' branch for torch.compile (``torch.compiler.is_compiling()``: the chunk
    length kept when T is shorter, one all-padding chunk more, the carry across chunks a doubling
    scan) run eagerly, against the definition: shorter than a chunk, not a multiple of it, and 9
    chunks (4 doubling levels). The loops it replaces are made to fail, so the traced branch is
    the one measured (tests/ops/test_compile.py compiles it)."""
    import lcsm.ops.delta as delta
    import lcsm.ops.dplr as dplr

    def eager_loop(*args, **kwargs):
        raise AssertionError("the eager loop over chunks ran in the traced branch")

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(delta, "_carry", eager_loop)
    monkeypatch.setattr(dplr, "_spans", eager_loop)
    for T in (3, 23, 70):
        check(make_inputs(T, layout=layout, n=n), "chunk", dtype, context=f"traced T={T}", chunk_size=8)


def test_traced_chunk_form_refuses_recompute(monkeypatch):
    """Traced, the recomputing backward (autograd inside a backward) cannot run: asking for it is an
    error, not a silent switch to autograd through the chunk form."""
    from lcsm.ops.dplr import _canonicalize, dplr_chunk

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = make_inputs(9, layout="row")
    canonical = _canonicalize(*(x[k] for k in NAMES))[:7]
    with pytest.raises(ValueError, match="recompute: .*torch.compile.*got True"):
        dplr_chunk(*canonical, 4, recompute=True)


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


@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("layout", ["scalar", "row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decays_stay_finite(layout, dtype, gate_first):
    """log alpha down to -30 per step (and -inf) in one chunk: no e^{+cumulative} factor overflows;
    with gate_first the low-rank factor e^-30 a is a product, nothing divides by the decay."""
    x = make_inputs(40, layout=layout)
    g = torch.Generator().manual_seed(5)
    x["log_alpha"] = -30 * torch.rand(x["log_alpha"].shape, generator=g, dtype=torch.float64)
    x["log_alpha"].view(-1)[::7] = float("-inf")
    # The reference differentiates exp(-inf) = 0 into NaN-free zeros; the gradient wrt a -inf log
    # is meaningless, so compare forward outputs and the other gradients.
    expected = run(x, "reference", gate_first=gate_first)
    for C in (16, 64):
        actual = run(x, "chunk", dtype, chunk_size=C, gate_first=gate_first)
        for name, value in actual.items():
            assert value is None or torch.isfinite(value).all(), f"{name} not finite, C={C}"
        keep = {k: v for k, v in expected.items() if k != "dlog_alpha"}
        assert_close({k: actual[k] for k in keep}, keep, dtype=dtype, context=f"C={C}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["head", "scalar", "head_row", "row"])
@pytest.mark.parametrize("n", [None, 2, 3])
@pytest.mark.parametrize("gate_first", [False, True])
def test_strong_decays_keep_the_decay_gradient(dtype, layout, n, gate_first):
    """Every step's log alpha in [-30, -20]: the decay's gradient is O(alpha), and the chunk maps'
    weights over no decay (e^{c_{t-1} - c_{t-1}}, a token's micro-steps after its first, the
    chunk's last e^{c_C - c_C}) took part in it through differences whose O(1) terms cancelled
    after rounding (relative error 17 at -20 a step in float32). C = 5 divides neither 23 nor 46."""
    x = make_inputs(23, layout=layout, n=n)
    x["log_alpha"] = -20.0 - 10.0 * torch.rand(x["log_alpha"].shape, generator=torch.Generator().manual_seed(2))
    check(x, "chunk", dtype, chunk_size=5, gate_first=gate_first)


@pytest.mark.parametrize("layout", ["none", "scalar", "row"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_beta_two(layout, mode):
    """beta = 2 (negative eigenvalues: I - 2 k k^T, a reflection) over 64 steps."""
    x = make_inputs(64, layout=layout, beta=2.0)
    check(x, mode, torch.float32, chunk_size=16)
    check(x, mode, torch.float64, chunk_size=16)


@pytest.mark.parametrize("layout", ["scalar", "row"])
def test_half_precision_computes_in_float32(layout):
    x = make_inputs(23, layout=layout)
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
@pytest.mark.parametrize("gate_first", [False, True])
def test_packed_equals_each_document_alone(mode, layout, n, span, gate_first, monkeypatch):
    """Values, final states and every gradient; span 2 makes the recomputing backward cross
    document starts and ends inside and between spans (eos_dplr's own form; eos_delta's kernel
    keeps the documents apart inside its chunks)."""
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
        *args,
        mode=mode,
        initial_state=leaves["initial_state"],
        output_final_state=True,
        cu_seqlens=cu,
        chunk_size=4,
        gate_first=gate_first,
    )
    got = gradients({"y": y, "m_T": m}, leaves)
    ys, ms = [], []
    for n_doc in range(len(lengths)):
        lo, hi = cu[n_doc].item(), cu[n_doc + 1].item()
        timed = [a[:, lo:hi] if a is not None and a.dim() >= 3 else a for a in args]
        y_n, m_n = reference(*timed, leaves["initial_state"][n_doc : n_doc + 1], gate_first=gate_first)
        ys.append(y_n)
        ms.append(m_n)
    want = gradients({"y": torch.cat(ys, 1), "m_T": torch.cat(ms, 0)}, leaves)
    assert_close(got, want, context=f"{mode} {layout} n={n}")


@pytest.mark.parametrize("layout", ["none", "head", "scalar"])
@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_routed_packed(layout, gate_first, shared, chunk_size, dtype):
    """The structures eos_delta's kernel serves, packed: documents of odd lengths (C = 5 divides
    none of them, C = 4 puts a one-token document inside a chunk), a and e as one tensor or not;
    y, final states and every gradient (each document's initial state's included) against the loop
    on each document alone, in float64."""
    lengths = [7, 1, 12, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(sum(lengths), layout=layout, seed=3)
    x = {k: (v[:1] if v is not None and v.dim() >= 3 and k != "initial_state" else v) for k, v in x.items()}
    x["initial_state"] = torch.randn(len(lengths), H, K, D, dtype=torch.float64)

    def outputs(dtype, packed):
        leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in x.items() if v is not None}
        if shared:
            leaves["e"] = leaves["a"]
        args = [leaves.get(k) for k in NAMES[:6]]
        m0 = leaves["initial_state"]
        if packed:
            y, m = eos_dplr(
                *args,
                mode="chunk",
                initial_state=m0,
                output_final_state=True,
                cu_seqlens=cu,
                chunk_size=chunk_size,
                gate_first=gate_first,
            )
        else:
            ys, ms = [], []
            for n_doc in range(len(lengths)):
                lo, hi = cu[n_doc].item(), cu[n_doc + 1].item()
                timed = [v[:, lo:hi] if v is not None and v.dim() >= 3 else v for v in args]
                y_n, m_n = reference(*timed, m0[n_doc : n_doc + 1], gate_first=gate_first)
                ys.append(y_n)
                ms.append(m_n)
            y, m = torch.cat(ys, 1), torch.cat(ms, 0)
        return gradients({"y": y, "m_T": m}, {k: v for k, v in leaves.items() if not (shared and k == "e")})

    assert_close(outputs(dtype, True), outputs(torch.float64, False), dtype=dtype, context=f"{layout} C={chunk_size}")


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


@pytest.mark.parametrize("name", ["i", "e", "s", "a", "b", "log_alpha", "initial_state"])
def test_complex_is_a_type_error(name):
    # as eos_delta: the chunk form's triangular inverse has no conjugate transposes (its gradients
    # of complex inputs were wrong)
    x = _args()
    if x[name] is None:
        x[name] = torch.zeros(B, 4, H, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"{name}: eos_dplr supports real"):
        _call(_args(**{name: torch.complex(x[name], x[name])}))


def test_output_dtype_is_the_values():
    """y in i's dtype, the state in the compute dtype: a bfloat16 layer with float32 log gates (as
    fla's and lcsm's mixers compute them) gets bfloat16 y; float32 i with float64 operands is
    computed in float64 and returned in float32."""
    x = {k: (v.bfloat16() if k != "log_alpha" else v.float()) for k, v in _args().items()}
    y, m = _call(x, output_final_state=True)
    assert (y.dtype, m.dtype) == (torch.bfloat16, torch.float32)
    x = {k: (v.float() if k == "i" else v) for k, v in _args().items()}
    y, m = _call(x, output_final_state=True)
    assert (y.dtype, m.dtype) == (torch.float32, torch.float64)


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
    with pytest.raises(ValueError, match="mode: expected one of auto, recurrent, chunk, triton"):
        _call(x, mode="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        _call(x, chunk_size=0)
    with pytest.raises(ValueError, match="gate_first: expected True or False, got 1"):
        _call(x, gate_first=1)
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
@pytest.mark.parametrize("layout", ["none", "head", "scalar", "row"])
@pytest.mark.parametrize("chunk_size", [2, 8])
@pytest.mark.parametrize("gate_first", [False, True])
def test_shared_a_and_e(mode, layout, chunk_size, gate_first):
    """One tensor passed as a and e (DeltaNet's beta k) takes the shared-product path of either
    kernel (with a decay: a' = e, Gated DeltaNet's D(alpha) - beta k (alpha k)^T, or a' = alpha e
    under gate_first); its gradient is the sum of both roles (C = 2 recomputes two spans in the
    WY / UT form's backward)."""
    x = make_inputs(37, layout=layout)
    leaves = {k: v.clone().requires_grad_() for k, v in x.items() if v is not None}
    leaves["e"] = leaves["a"]
    args = [leaves.get(k) for k in ("i", "a", "s", "a", "b", "log_alpha")]
    y, m = eos_dplr(
        *args,
        mode=mode,
        initial_state=leaves["initial_state"],
        output_final_state=True,
        chunk_size=chunk_size,
        gate_first=gate_first,
    )
    wrt = {k: v for k, v in leaves.items() if k != "e"}
    got = gradients({"y": y, "m_T": m}, wrt)
    expected = reference(*args, leaves["initial_state"], gate_first=gate_first)
    want = gradients(dict(zip(("y", "m_T"), expected, strict=True)), wrt)
    assert_close(got, want, context=f"{mode} {layout} C={chunk_size}")


def test_explain_dplr():
    x = make_inputs(23, layout="row")
    args = [x[k] for k in NAMES[:6]]
    plan = explain_dplr(*args)
    assert plan.mode == "chunk" and plan.kernel == "wy" and "per-row decay" in plan.reason
    assert explain_dplr(*(a[:, :1] for a in args)).mode == "recurrent"
    assert explain_dplr(*args, mode="recurrent").kernel == "loop"
    assert "a is e" in explain_dplr(args[0], args[3], *args[2:]).reason
    scalar = explain_dplr(*args[:5], args[5][..., 0], gate_first=True)
    assert scalar.kernel == "delta" and "eos_delta's" in scalar.reason and "gate_first" in scalar.reason
    packed = explain_dplr(*(a[:1] for a in args), cu_seqlens=torch.tensor([0, 5, 23]))
    assert "2 documents" in packed.reason
    with pytest.raises(ValueError, match="initial_state: with cu_seqlens"):
        explain_dplr(*(a[:1] for a in args), initial_state=x["initial_state"][:1], cu_seqlens=torch.tensor([0, 5, 23]))
    with pytest.raises(ValueError, match="mode: expected one of"):
        explain_dplr(*args, mode="fast")


@pytest.mark.parametrize("gate", [None, "step", "head"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eos_delta_is_the_scalar_gate_row(gate, dtype):
    """``eos_delta(i, e, s, a, b, log_o)`` ≡ ``eos_dplr(i, e, s, exp(log_o) a, b, log_o)`` ≡
    ``eos_dplr(i, e, s, a, b, log_o, gate_first=True)`` (a and e one tensor there, DeltaNet's
    shared products), in either form of eos_dplr: the delta rule is this family's scalar-gate
    member (values, final states, every gradient)."""
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
    want = gradients({"y": y, "m": m}, wrt)
    assert_close(gradients({"y": y2, "m": m2}, wrt), want, dtype=dtype)
    for mode in ("chunk", "recurrent"):
        bk = beta * k
        y3, m3 = eos_dplr(
            i, bk, s, bk, k, log_o, mode=mode, initial_state=m0, output_final_state=True, chunk_size=5, gate_first=True
        )
        assert_close(gradients({"y": y3, "m": m3}, wrt), want, dtype=dtype, context=f"gate_first {mode} gate {gate}")
