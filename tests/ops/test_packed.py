"""Packed sequences (``cu_seqlens``): packed ≡ separate.

Every packed call is compared with its documents run one by one through the same operator's
reference (``eos``'s recurrent mode, ``eos_delta``'s recurrent mode, ``eos_rotating``'s recurrent
mode) and concatenated: outputs, per-document final states and the gradients of every input and
of every initial state, under random cotangents on both outputs, from the same leaf tensors.
Boundaries include documents of one token (first, inside, last), T is odd and the chunk sizes do
not divide T or the documents.
"""

import math

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm.ops import LogProduct, eos, eos_delta, eos_rotating, explain, native_scan
from lcsm.ops import chunk as chunk_module
from lcsm.ops import delta as delta_module
from lcsm.testing import assert_close, rel_rms

H, K, D = 2, 3, 4
T = 23
BOUNDS = {
    "ones": [0, 1, 6, 7, 15, 22, 23],  # one-token documents at the start, inside and at the end
    "random": None,  # drawn below
    "one-document": [0, 23],
}


def _bounds(kind, seed=0):
    if BOUNDS[kind] is not None:
        return BOUNDS[kind]
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=g)[:5] + 1
    return [0, *sorted(cuts.tolist()), T]


def _rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def make_inputs(decay="row", dd=True, e="dd", s="dd", initial=True, n_docs=1, seed=0, complex_decay=False):
    """Random eos inputs for a packed row (B = 1). decay in none/scalar/row/col/full/outer/product."""
    g = torch.Generator().manual_seed(seed)

    def state(kind):
        x = {"dd": lambda: _rnd(g, 1, T, H, K), "vec": lambda: _rnd(g, H, K), "mat": lambda: _rnd(g, H, K, D)}[kind]()
        return x / math.sqrt(K)

    def log_decay(tail):
        x = logsigmoid(_rnd(g, *((1, T, H) if dd else (H,)), *tail) + 1.0)
        return torch.complex(x, _rnd(g, *x.shape)) if complex_decay else x

    log_o = None
    if decay == "outer":
        log_o = (log_decay((K, 1)), log_decay((1, D)))
    elif decay == "product":
        a = torch.nn.functional.softplus(_rnd(g, *((1, T, H) if dd else (H,)), 1, D) - 1.0)
        log_o = LogProduct(a, -torch.exp(_rnd(g, H, K, D) / 2))
    elif decay != "none":
        log_o = log_decay({"scalar": (1, 1), "row": (K, 1), "col": (1, D), "full": (K, D)}[decay])
    m0 = _rnd(g, n_docs, H, K, D) if initial else None
    if m0 is not None and complex_decay:
        m0 = torch.complex(m0, _rnd(g, *m0.shape))
    return {"i": _rnd(g, 1, T, H, D), "e": state(e), "s": state(s), "log_o": log_o, "initial_state": m0}


def _cast(x, dtype):
    if x is None:
        return None
    if isinstance(x, LogProduct):
        return LogProduct(_cast(x.a, dtype), _cast(x.b, dtype))
    if isinstance(x, tuple):
        return tuple(_cast(part, dtype) for part in x)
    target = {torch.float32: torch.complex64, torch.float64: torch.complex128}[dtype] if x.is_complex() else dtype
    return x.detach().to(target).requires_grad_(True)


def _leaves(x, name):
    if isinstance(x, LogProduct):
        yield from ((f"{name}.a", x.a), (f"{name}.b", x.b))
    elif isinstance(x, tuple):
        yield from ((f"{name}[{j}]", part) for j, part in enumerate(x))
    elif x is not None:
        yield name, x


def _cut(x, lo, hi):
    """The tokens [lo, hi) of a packed argument: data-dependent tensors ([1, T, ...]) are cut,
    data-independent ones shared; pairs and products part by part."""
    if x is None:
        return None
    if isinstance(x, LogProduct):
        return LogProduct(_cut(x.a, lo, hi), _cut(x.b, lo, hi))
    if isinstance(x, tuple):
        return tuple(_cut(part, lo, hi) for part in x)
    return x[:, lo:hi] if x.dim() >= 4 or (x.dim() == 3 and x.shape[:2] == (1, T)) else x


def separate(fn, args, bounds, **kwargs):
    """Each document alone through ``fn`` (from its own initial state); outputs concatenated over
    time, final states stacked."""
    ys, ms = [], []
    m0 = args.get("initial_state")
    for n in range(len(bounds) - 1):
        lo, hi = bounds[n], bounds[n + 1]
        doc = {k: _cut(v, lo, hi) for k, v in args.items() if k != "initial_state"}
        y, m = fn(**doc, initial_state=None if m0 is None else m0[n : n + 1], output_final_state=True, **kwargs)
        ys.append(y)
        ms.append(m)
    return torch.cat(ys, 1), torch.cat(ms, 0)


def outputs_and_grads(call, args, seed=1):
    """y, the final states and the gradient of every leaf of ``args`` under random cotangents."""
    y, m = call(args)
    g = torch.Generator().manual_seed(seed)

    def cot(t):
        x = _rnd(g, *t.shape)
        return (torch.complex(x, _rnd(g, *t.shape)) if t.is_complex() else x).to(t.dtype)

    names, xs = zip(*(item for k, v in args.items() for item in _leaves(v, k)), strict=True)
    grads = torch.autograd.grad((y, m), xs, (cot(y), cot(m)), allow_unused=True)
    out = {"y": y, "m_T": m}
    out.update({f"d{n}": gr for n, gr in zip(names, grads, strict=True)})
    return out


def check_packed(fn, inputs, bounds, dtype, context="", **kwargs):
    args = {k: _cast(v, dtype) for k, v in inputs.items()}
    cu = torch.tensor(bounds, dtype=torch.int64)
    reference = {**kwargs, "mode": "recurrent"}
    expected = outputs_and_grads(lambda a: separate(fn, a, bounds, **reference), args)
    got = outputs_and_grads(lambda a: fn(**a, output_final_state=True, cu_seqlens=cu, **kwargs), args)
    assert_close(got, expected, dtype, context=context)


# ----------------------------------------------------------------------------- eos


@pytest.mark.parametrize("bounds", ["ones", "random", "one-document"])
def test_recurrent_reference_is_separate(bounds):
    b = _bounds(bounds)
    inputs = make_inputs("row", n_docs=len(b) - 1)
    check_packed(eos, inputs, b, torch.float64, mode="recurrent")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "decay, dd",
    [
        ("none", False),
        ("scalar", True),
        ("scalar", False),
        ("row", True),
        ("row", False),
        ("col", True),
        ("full", True),
        ("outer", True),
        ("product", True),
    ],
)
@pytest.mark.parametrize("mode, chunk_size", [("chunk", 4), ("chunk", 5), ("parallel", 64)])
def test_every_decay(decay, dd, mode, chunk_size, dtype):
    b = _bounds("ones")
    inputs = make_inputs(decay, dd, n_docs=len(b) - 1, seed=3)
    check_packed(eos, inputs, b, dtype, f"{decay} dd={dd} {mode}", mode=mode, chunk_size=chunk_size)


@pytest.mark.parametrize("e, s", [("vec", "dd"), ("dd", "vec"), ("mat", "dd"), ("dd", "mat")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_data_independent_and_matrix_expand_shrink(e, s, dtype):
    b = _bounds("random", seed=1)
    inputs = make_inputs("row", True, e=e, s=s, n_docs=len(b) - 1, seed=4)
    check_packed(eos, inputs, b, dtype, f"e={e} s={s}", mode="chunk", chunk_size=4)


@pytest.mark.parametrize("decay", ["row", "full"])
def test_complex_decay(decay):
    b = _bounds("ones")
    inputs = make_inputs(decay, True, n_docs=len(b) - 1, seed=5, complex_decay=True)
    check_packed(eos, inputs, b, torch.float64, decay, mode="chunk", chunk_size=4)


@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_without_initial_states(mode):
    b = _bounds("random", seed=2)
    inputs = make_inputs("row", True, initial=False, seed=6)
    check_packed(eos, inputs, b, torch.float64, mode=mode, chunk_size=4)
    # The output alone, without the final states' closed form.
    args = {k: _cast(v, torch.float64) for k, v in inputs.items()}
    y, m = eos(**args, mode=mode, chunk_size=4, cu_seqlens=torch.tensor(b))
    assert m is None
    assert_close({"y": y}, {"y": separate(eos, args, b, mode="recurrent")[0]}, torch.float64)


def test_auto_takes_chunk_for_a_time_invariant_system():
    b = _bounds("ones")
    inputs = make_inputs("row", False, e="vec", s="vec", n_docs=len(b) - 1, seed=7)
    args = {k: _cast(v, torch.float64) for k, v in inputs.items()}
    plan = explain(args["i"], args["e"], args["s"], args["log_o"], cu_seqlens=torch.tensor(b))
    assert plan.mode == "chunk" and "cu_seqlens" in plan.reason and "not fft" in plan.reason
    check_packed(eos, inputs, b, torch.float64, mode="auto", chunk_size=4)


@pytest.mark.parametrize("decay", ["full", "product"])
def test_auto_takes_the_native_scan_for_a_time_invariant_full_decay(decay):
    """A time-invariant system with a full K x D decay (S4D's shapes called on packed documents):
    auto takes what a time-varying one takes, on the CPU the native scan where its kernel builds
    (the chunk form's elementwise kernel before: ~11x slower, bench/results/native_scan.md)."""
    b = _bounds("random", seed=3)
    inputs = make_inputs(decay, False, e="vec", s="vec", n_docs=len(b) - 1, seed=8)
    args = {k: _cast(v, torch.float64) for k, v in inputs.items()}
    plan = explain(args["i"], args["e"], args["s"], args["log_o"], cu_seqlens=torch.tensor(b))
    assert "not fft" in plan.reason
    assert plan.mode == ("native" if native_scan.library() is not None else "chunk"), plan
    check_packed(eos, inputs, b, torch.float64, mode="auto", chunk_size=4)


def test_chunk_runs_the_packed_row_in_one_kernel_call(monkeypatch):
    """One call of the chunk kernel over the whole packed row, its C form (native_chunk, where it
    builds) or its PyTorch twin."""
    calls = []
    for owner, name in ((chunk_module.ChunkMatmulFunction, "apply"), (chunk_module, "native_chunk")):
        original = getattr(owner, name)

        def counted(*args, original=original):
            calls.append(args[2].shape)
            return original(*args)

        monkeypatch.setattr(owner, name, counted)
    b = _bounds("ones")
    args = {k: _cast(v, torch.float64) for k, v in make_inputs("row", n_docs=len(b) - 1).items()}
    eos(**args, mode="chunk", chunk_size=4, output_final_state=True, cu_seqlens=torch.tensor(b))
    assert len(calls) == 1 and calls[0][2] == T


@pytest.mark.parametrize("decay", ["scalar", "row", "col", "outer"])
def test_document_starts_keep_the_factorised_chunk_path(decay, monkeypatch):
    """A document start (a decay of exactly 0) is masked in the chunk, not a reason to cut every
    chunk into sub-chunks: moderate decays stay on the factorised path, forward and backward."""
    from lcsm.ops import chunk_matmul

    def refused(*args, **kwargs):
        raise AssertionError("the sub-chunk scheme ran for a packed row of moderate decays")

    monkeypatch.setattr(chunk_matmul, "_intra_subchunked", refused)
    b = _bounds("ones")
    check_packed(eos, make_inputs(decay, n_docs=len(b) - 1, seed=8), b, torch.float64, mode="chunk", chunk_size=5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["row", "outer"])
def test_strong_decays_with_document_starts(decay, dtype):
    """Decays beyond the safe span between document starts: the sub-chunk scheme on the true logs."""
    b = _bounds("random", seed=3)
    inputs = make_inputs(decay, n_docs=len(b) - 1, seed=9)
    scale = {torch.float64: 100.0, torch.float32: 40.0}[dtype]
    log_o = inputs["log_o"]
    inputs["log_o"] = tuple(x * scale for x in log_o) if isinstance(log_o, tuple) else log_o * scale
    check_packed(eos, inputs, b, dtype, decay, mode="chunk", chunk_size=8)


@pytest.mark.parametrize("decay", ["scalar", "row", "col", "full"])
@pytest.mark.parametrize("mode, chunk_size", [("chunk", 4), ("chunk", 5), ("parallel", 64)])
def test_document_starts_cost_no_precision(decay, mode, chunk_size):
    """In float64 a packed call is as close to its documents run alone (here through the same
    mode, from zero states) as an unpacked call is to the recurrence, ~1e-16 relative RMS: the
    forms take a document's first token (log at LOG_ZERO = -1024) as a reset, where cumulative
    logs summed through it put its rounding, ~2e-13, into every later pair (~1e-13 off)."""
    b = [0, 3, 11, 12, 19, 23]  # every chunk of 4 or 5 holds a document start
    inputs = {k: _cast(v, torch.float64) for k, v in make_inputs(decay, n_docs=len(b) - 1, seed=11).items()}
    inputs["initial_state"] = None
    kwargs = {"mode": mode, "chunk_size": chunk_size}
    got = outputs_and_grads(lambda a: eos(**a, output_final_state=True, cu_seqlens=torch.tensor(b), **kwargs), inputs)
    expected = outputs_and_grads(lambda a: separate(eos, a, b, **kwargs), inputs)
    errors = {name: rel_rms(got[name], expected[name]) for name in expected if expected[name] is not None}
    assert max(errors.values()) < 1e-14, errors


@pytest.mark.parametrize("tail_cost", [0, 1])
@pytest.mark.parametrize("decay", ["none", "scalar", "row", "col", "outer"])
def test_documents_cut_into_pieces(decay, tail_cost, monkeypatch):
    """The states' closed forms cut documents into pieces (packed.py ``_Pieces``); tails made
    cheap take pieces of one token (every document past its first token in tails) or of two."""
    from lcsm.ops import packed

    monkeypatch.setattr(packed, "TAIL_COST", tail_cost)
    b = [0, 10, 11, 12, 13, 14, 15, 16, 23]
    inputs = make_inputs(decay, n_docs=len(b) - 1, seed=10)
    check_packed(eos, inputs, b, torch.float64, decay, mode="chunk", chunk_size=4)


def test_initial_states_in_any_layout_or_without_gradient():
    """The states' closed forms (packed.py ``_DocumentStates``) flatten the states for batched
    matmuls and update fresh ones in place: initial states with permuted strides give the same
    results, and constant ones get no gradient while the rest still do."""
    b = _bounds("random", seed=4)
    inputs = make_inputs("row", n_docs=len(b) - 1, seed=11)
    m0 = inputs["initial_state"]
    inputs["initial_state"] = m0.transpose(0, 2).contiguous().transpose(0, 2)
    check_packed(eos, inputs, b, torch.float64, "permuted initial states", mode="chunk", chunk_size=4)

    args = {k: _cast(v, torch.float64) for k, v in inputs.items() if k != "initial_state"}
    cu = torch.tensor(b)
    expected = outputs_and_grads(lambda a: separate(eos, {**a, "initial_state": m0}, b, mode="recurrent"), args)
    got = outputs_and_grads(
        lambda a: eos(**a, initial_state=m0, mode="chunk", chunk_size=4, output_final_state=True, cu_seqlens=cu), args
    )
    assert_close(got, expected, torch.float64, context="constant initial states")


def test_explain_says_how_documents_are_kept_apart():
    b = torch.tensor(_bounds("ones"))
    args = make_inputs("row", n_docs=6)
    for mode, words in (("chunk", "decay of exactly 0"), ("recurrent", "loop over documents")):
        plan = explain(args["i"], args["e"], args["s"], args["log_o"], mode=mode, cu_seqlens=b)
        assert "cu_seqlens, 6 documents" in plan.reason and words in plan.reason


def test_fft_is_refused():
    args = make_inputs("row", False, e="vec", s="vec", initial=False)
    with pytest.raises(ValueError, match=r"mode='fft' cannot serve cu_seqlens"):
        eos(args["i"], args["e"], args["s"], args["log_o"], mode="fft", cu_seqlens=torch.tensor([0, 5, T]))


@pytest.mark.parametrize(
    "cu, states, match",
    [
        ([1, 5, T], None, r"cu_seqlens: expected cu_seqlens\[0\] = 0, got 1"),
        ([0, 5, T - 1], None, rf"cu_seqlens: expected cu_seqlens\[-1\] = T = {T}, .* got {T - 1}"),
        (
            [0, 9, 5, T],
            None,
            r"cu_seqlens: expected strictly increasing .* cu_seqlens\[1\] = 9 and cu_seqlens\[2\] = 5",
        ),
        ([0, 5, 5, T], None, r"cu_seqlens: expected strictly increasing"),
        (
            [0.0, 5.0, float(T)],
            None,
            r"cu_seqlens: expected a torch.int64 or torch.int32 tensor, got dtype torch.float32",
        ),
        (torch.tensor([0, 5, T], dtype=torch.uint8), None, r"cu_seqlens: expected .* got dtype torch.uint8"),
        (torch.tensor([0, 5, T], device="meta"), None, r"cu_seqlens: expected a tensor holding values .* meta"),
        ([[0, 5, T]], None, r"cu_seqlens: expected a 1-d tensor \[N \+ 1\] .* got \[1, 3\]"),
        ([0], None, r"cu_seqlens: expected a 1-d tensor \[N \+ 1\] .* N >= 1, got \[1\]"),
        ([0, 5, T], (3, H, K, D), rf"initial_state: with cu_seqlens .* \[N, H, K, D\] = \[2, {H}, {K}, {D}\], got \[3"),
    ],
)
def test_errors(cu, states, match):
    args = make_inputs("row", initial=False)
    m0 = None if states is None else torch.zeros(states, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        eos(args["i"], args["e"], args["s"], args["log_o"], initial_state=m0, cu_seqlens=torch.as_tensor(cu))


def test_error_for_a_batch():
    args = make_inputs("row", initial=False)
    i = args["i"].expand(2, T, H, D)
    with pytest.raises(ValueError, match=r"cu_seqlens: .* expected batch B = 1 .* got B = 2"):
        eos(i, args["e"].expand(2, T, H, K), args["s"].expand(2, T, H, K), cu_seqlens=torch.tensor([0, T]))


def test_error_for_a_list():
    args = make_inputs("row", initial=False)
    with pytest.raises(ValueError, match=r"cu_seqlens: expected an integer torch.Tensor \[N \+ 1\], got list"):
        eos(args["i"], args["e"], args["s"], cu_seqlens=[0, T])


# ----------------------------------------------------------------------------- eos_delta, eos_rotating


def delta_inputs(n_docs, gate, seed=0, kind="general", initial=True):
    """Delta-rule inputs conditioned as in test_delta (unit keys, a close to b, beta in (0, 1)).
    kind: general (a != b != e), deltanet (a = e = beta k, b = k) or m1 (a = b = e = k); the shared
    tensors are made one object by ``check_delta``."""
    g = torch.Generator().manual_seed(seed)
    k = normalize(_rnd(g, 1, T, H, K), dim=-1)
    beta = torch.sigmoid(_rnd(g, 1, T, H, 1))
    log_o = {"none": None, "dd": logsigmoid(_rnd(g, 1, T, H) + 2.0), "head": logsigmoid(_rnd(g, H) + 2.0)}[gate]
    a, e = beta * normalize(k + 0.3 * _rnd(g, 1, T, H, K), dim=-1), _rnd(g, 1, T, H, K) / math.sqrt(K)
    if kind == "deltanet":
        a = e = beta * k
    elif kind == "m1":
        a = e = k
    return {
        "i": _rnd(g, 1, T, H, D),
        "e": e,
        "s": normalize(_rnd(g, 1, T, H, K), dim=-1),
        "a": a,
        "b": k,
        "log_o": log_o,
        "initial_state": _rnd(g, n_docs, H, K, D) if initial else None,
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate", ["none", "dd", "head"])
@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
def test_delta(gate, mode, dtype):
    b = _bounds("ones")
    check_packed(eos_delta, delta_inputs(len(b) - 1, gate), b, dtype, gate, mode=mode, chunk_size=4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_delta_strong_gates(dtype):
    """Log gates in [-30, -20] a step: the gate's gradient (O(gate)) of every document, its final
    state read at a document's end inside a chunk (``_delta_chunk_packed``) included."""
    b = DELTA_BOUNDS["long"]
    x = delta_inputs(len(b) - 1, "dd")
    x["log_o"] = -20.0 - 10.0 * torch.rand(x["log_o"].shape, generator=torch.Generator().manual_seed(2))
    check_packed(eos_delta, x, b, dtype, "strong", mode="chunk", chunk_size=4)


DELTA_BOUNDS = {
    "ones": [0, 1, 6, 7, 15, 22, 23],  # one-token documents at the start, inside and at the end
    "long": [0, 1, 12, 13, 23],  # documents of 11 and 10 tokens: several chunks each
    "aligned": [0, 4, 8, 9, 20, 23],  # starts and ends on chunk boundaries of C = 4, and off them
    "one-document": [0, 23],
}


def check_delta(inputs, bounds, dtype, context, shared, **kwargs):
    """``check_packed`` for eos_delta, with ``a`` and ``e`` one tensor object when ``shared`` (the
    DeltaNet fast path of the chunk form; the reference cuts them apart, which it does not mind)."""
    args = {k: _cast(v, dtype) for k, v in inputs.items()}
    if shared:
        args["a"] = args["e"]
    cu = torch.tensor(bounds, dtype=torch.int64)
    final = args["initial_state"] is not None

    def packed(a):
        y, m = eos_delta(**a, output_final_state=final, cu_seqlens=cu, **kwargs)
        return y, (m if final else y)

    def reference(a):
        y, m = separate(eos_delta, a, bounds, **{**kwargs, "mode": "recurrent"})
        return y, (m if final else y)

    assert_close(outputs_and_grads(packed, args), outputs_and_grads(reference, args), dtype, context=context)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["general", "deltanet", "m1"])
@pytest.mark.parametrize("gate", ["none", "dd", "head"])
@pytest.mark.parametrize(
    "bounds, chunk_size", [("ones", 4), ("ones", 64), ("long", 3), ("aligned", 4), ("one-document", 5)]
)
def test_delta_chunk_is_each_document_alone(bounds, chunk_size, gate, kind, dtype):
    """The chunk form over the packed row against each document through the recurrence: outputs,
    final states and every gradient (initial states included); T = 23 is odd and no chunk size
    divides it (64 is capped at T: one chunk holding every document)."""
    b = DELTA_BOUNDS[bounds]
    inputs = delta_inputs(len(b) - 1, gate, seed=11, kind=kind)
    check_delta(
        inputs,
        b,
        dtype,
        f"{bounds} C={chunk_size} {gate} {kind}",
        kind != "general",
        mode="chunk",
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("chunk_size", [2, 3, 5, 7])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_delta_chunk_random_boundaries(seed, chunk_size):
    b = _bounds("random", seed=seed)
    inputs = delta_inputs(len(b) - 1, "dd", seed=seed, kind="general")
    check_delta(inputs, b, torch.float64, f"{b} C={chunk_size}", False, mode="chunk", chunk_size=chunk_size)


@pytest.mark.parametrize("kind", ["general", "deltanet"])
def test_delta_chunk_without_states(kind):
    """No initial states and no final states asked for: y and its gradients alone."""
    b = DELTA_BOUNDS["long"]
    inputs = delta_inputs(len(b) - 1, "dd", seed=12, kind=kind, initial=False)
    check_delta(inputs, b, torch.float64, kind, kind != "general", mode="auto", chunk_size=4)


def test_delta_chunk_runs_the_packed_row_in_one_pass(monkeypatch):
    """One chunk computation for the whole row (the triangular inverse once, over ceil(T / C)
    chunks), never one per document, and no recurrent step."""
    calls = []
    original = delta_module._UnitLowerInverse.apply

    def counted(L):
        calls.append(L.shape)
        return original(L)

    def refused(*args):
        raise AssertionError("the recurrent form ran")

    monkeypatch.setattr(delta_module._UnitLowerInverse, "apply", counted)
    monkeypatch.setattr(delta_module._DeltaRecurrent, "apply", refused)
    b = DELTA_BOUNDS["ones"]
    args = {k: _cast(v, torch.float64) for k, v in delta_inputs(len(b) - 1, "dd").items()}
    eos_delta(**args, mode="auto", chunk_size=4, output_final_state=True, cu_seqlens=torch.tensor(b))
    assert len(calls) == 1 and calls[0][2] == math.ceil(T / 4)


def test_delta_errors():
    args = delta_inputs(2, "dd")
    with pytest.raises(ValueError, match=r"cu_seqlens: expected cu_seqlens\[-1\] = T"):
        eos_delta(**{**args, "initial_state": None}, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"initial_state: with cu_seqlens .* \[N, H, K, D\] = \[3, "):
        eos_delta(**args, cu_seqlens=torch.tensor([0, 5, 9, T]))


def rotating_inputs(n_docs, decay, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_o = {"none": None, "row": logsigmoid(_rnd(g, 1, T, H, K, 1) + 1.0), "scalar": logsigmoid(_rnd(g, H, 1, 1))}
    return {
        "i": _rnd(g, 1, T, H, D),
        "e": _rnd(g, 1, T, H, K) / math.sqrt(K),
        "s": _rnd(g, 1, T, H, K) / math.sqrt(K),
        "theta": _rnd(g, H, K),
        "log_o": log_o[decay],
        "initial_state": torch.complex(_rnd(g, n_docs, H, K, D), _rnd(g, n_docs, H, K, D)),
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["none", "row", "scalar"])
@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_rotating(decay, mode, dtype):
    b = _bounds("random", seed=3)
    check_packed(eos_rotating, rotating_inputs(len(b) - 1, decay), b, dtype, decay, mode=mode, chunk_size=4)


def test_rotating_state_error():
    args = rotating_inputs(2, "row")
    with pytest.raises(ValueError, match=r"initial_state: expected \[N, H, K, D\] = \[3, "):
        eos_rotating(**args, cu_seqlens=torch.tensor([0, 5, 9, T]))
