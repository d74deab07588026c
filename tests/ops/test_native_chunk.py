"""The chunk form in C (``lcsm.ops.native_scan.native_chunk``, source lcsm/ops/_native/chunk.h)
with no, a scalar, a row or a column decay against its twin, the PyTorch matmul kernel
(``ChunkMatmulFunction`` with the same kind), and the recurrence written out, in float64: the
output, the final state and the gradients of s, e, x, the log decay and the initial state under
random cotangents, in float64 and float32, at lengths the chunks do not divide, widths that are
not whole vectors, moderate and strong decays (a row or column decay's chunks then cut into
pieces, down to single steps) and decays of exactly 0 (log -inf, which the kernel raises to
LOG_ZERO itself), with and without an initial state and a final-state cotangent, on the caller's
[B, T, H, *] layout, a contiguous one and broadcast operands; eos's dispatch to it; its refusals."""

import pytest
import torch

from lcsm.ops import eos, explain
from lcsm.ops import native_scan as native
from lcsm.ops._inputs import LOG_ZERO, finite_log
from lcsm.ops.chunk_matmul import ChunkMatmulFunction
from lcsm.testing import assert_close, gradients


def recurrence(s, e, x, g, m0, kind):
    """m_t = o_t * m_{t-1} + e_t x_t^T, y_t = m_t^T s_t, step by step: s, e [B, H, T, K], x [B, H,
    T, D], g = log o [B, H, T, 1] (scalar), [B, H, T, K] (row), [B, H, T, D] (col) or None."""
    B, H, T, K = s.shape
    m = m0 if m0 is not None else s.new_zeros(B, H, K, x.shape[-1])
    ys = []
    for t in range(T):
        if g is not None:
            m = (g[:, :, t, None, :] if kind == "col" else g[:, :, t, :, None]).exp() * m
        m = m + e[:, :, t, :, None] * x[:, :, t, None, :]
        ys.append((s[:, :, t, :, None] * m).sum(-2))
    return torch.stack(ys, 2), m


def twin(s, e, x, g, m0, chunk, kind):
    return ChunkMatmulFunction.apply(s, e, x, None if g is None else finite_log(g), m0, kind, chunk)


def run(form, leaves: dict, chunk: int, final_cotangent: bool, layout: str, kind: str):
    """(y, m_T) of ``form`` and the gradients of every leaf; s, e, x given head-major [B, H, T, *]
    as views of [B, T, H, *] tensors ("caller"), as contiguous [B, H, T, *] ("contiguous") or e
    broadcast over time and the batch ("broadcast"). The native kernel takes the logs as
    they are, -inf included; the recurrence and the twin raise them as eos does."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    s, e, x, g = (leaves.get(n) for n in ("s", "e", "x", "g"))
    if layout == "caller":
        s, e, x = (t.transpose(1, 2) for t in (s, e, x))
        g = None if g is None else g.transpose(1, 2)
    elif layout == "broadcast":
        e = e.expand(s.shape)
    if form is recurrence:
        y, m_T = recurrence(s, e, x, None if g is None else finite_log(g), leaves.get("m0"), kind)
    else:
        y, m_T = form(s, e, x, g, leaves.get("m0"), chunk, kind)
    outputs = {"y": y, "m_T": m_T} if final_cotangent else {"y": y}
    return gradients(outputs, leaves)


def make(B, T, H, K, D, layout, initial, decay=None, seed=0, kind="scalar"):
    """Inputs; decay: None, or the largest per-step log decay's size ("zeros": a few steps' logs at
    -inf, decays of exactly 0) of a decay of ``kind`` (its width 1, K or D)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda X: (B, T, H, X)) if layout == "caller" else (lambda X: (B, H, T, X))
    leaves = {"s": torch.randn(*shape(K), generator=gen, dtype=torch.float64)}
    broadcast = layout == "broadcast"
    leaves["e"] = torch.randn(*(shape(K) if not broadcast else (1, H, 1, K)), generator=gen, dtype=torch.float64)
    leaves["x"] = torch.randn(*shape(D), generator=gen, dtype=torch.float64)
    if decay is not None:
        X = {"scalar": 1, "row": K, "col": D}[kind]
        g = -torch.rand(*shape(X), generator=gen, dtype=torch.float64)
        g = g * (1.0 if decay == "zeros" else decay)
        if decay == "zeros":
            g.view(-1)[:: max(1, g.numel() // 3)] = -torch.inf
            if kind != "scalar":  # and a reset: every entry of one step
                (g[:, T // 2] if layout == "caller" else g[:, :, T // 2]).fill_(-torch.inf)
        leaves["g"] = g
    if initial:
        leaves["m0"] = torch.randn(B, H, K, D, generator=gen, dtype=torch.float64)
    return leaves


def skip_without_kernel():
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())


SHAPES = [
    (2, 37, 3, 5, 7, 8),
    (1, 130, 2, 64, 64, 64),
    (1, 200, 2, 16, 24, 48),
    (2, 1, 1, 3, 2, 4),
    (1, 70, 1, 33, 9, 16),
]


def check(B, T, H, K, D, chunk, layout, initial, final_cotangent, kind, decay, dtype):
    leaves = make(B, T, H, K, D, layout, initial, decay, seed=T + K, kind=kind)
    exact = run(recurrence, leaves, chunk, final_cotangent, layout, kind)
    context = (
        f"B{B} T{T} H{H} K{K} D{D} chunk {chunk} {layout} {kind} decay {decay} initial {initial} dM {final_cotangent}"
    )
    assert_close(run(twin, leaves, chunk, final_cotangent, layout, kind), exact, dtype=torch.float64, context=context)
    low = {k: v.to(dtype) for k, v in leaves.items()}
    got = run(native.native_chunk, low, chunk, final_cotangent, layout, kind)
    assert_close(got, exact, dtype=dtype, context=context)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,H,K,D,chunk", SHAPES)
@pytest.mark.parametrize("layout", ["caller", "contiguous", "broadcast"])
@pytest.mark.parametrize("initial,final_cotangent", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize("decay", [None, 0.05, 4.0, "zeros"])
def test_native_chunk_equals_its_twin_and_the_recurrence(
    B, T, H, K, D, chunk, layout, initial, final_cotangent, decay, dtype
):
    """No or a scalar decay: none, moderate (logs down to -0.05 a step), strong (-4 a step: a chunk
    of 64 spans e^-256, which the PyTorch form takes by sub-chunks) and some exactly 0."""
    skip_without_kernel()
    kind = "none" if decay is None else "scalar"
    check(B, T, H, K, D, chunk, layout, initial, final_cotangent, kind, decay, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,H,K,D,chunk", SHAPES)
@pytest.mark.parametrize("layout", ["caller", "contiguous", "broadcast"])
@pytest.mark.parametrize("initial,final_cotangent", [(True, True), (False, False)])
@pytest.mark.parametrize("decay", [0.05, 40.0, "zeros"])
@pytest.mark.parametrize("kind", ["row", "col"])
def test_native_chunk_with_a_row_or_column_decay(
    B, T, H, K, D, chunk, layout, initial, final_cotangent, kind, decay, dtype
):
    """A decay per row (GLA's) or per column: moderate (one piece a chunk), strong (-40 a step:
    pieces of one or two steps in float32, about ten in float64) and some exactly 0, one step's
    in every entry (a reset, where a piece ends)."""
    skip_without_kernel()
    check(B, T, H, K, D, chunk, layout, initial, final_cotangent, kind, decay, dtype)


@pytest.mark.parametrize("kind", ["none", "scalar", "row", "col"])
def test_every_split_of_the_work_among_threads_gives_the_same_bits(kind):
    """The kernel splits the (batch row, head) items among its threads and takes each thread's in
    groups of up to 8 items, chunk by chunk over a group (chunk.h's chunk_share): 3 x 11 items on
    1 to 5 threads, split unevenly, groups that cross batch rows and groups cut short. Each item's
    arithmetic is the same however the work is split: equal bits, and the recurrence's values."""
    skip_without_kernel()
    leaves = make(3, 29, 11, 5, 6, "caller", True, None if kind == "none" else 0.5, seed=5, kind=kind)
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            results[n] = run(native.native_chunk, leaves, 8, True, "caller", kind)
    finally:
        torch.set_num_threads(threads)
    for n, got in results.items():
        for name, value in got.items():
            assert torch.equal(value, results[1][name]), (n, name)
    exact = run(recurrence, leaves, 8, True, "caller", kind)
    assert_close(results[1], exact, dtype=torch.float64, context=kind)


@pytest.mark.parametrize("kind", ["scalar", "row", "col"])
def test_a_decay_of_exactly_zero_has_a_gradient_of_exactly_zero(kind):
    """A log of -inf (raised to LOG_ZERO by the kernel) gets the gradient finite_log's clamp gives
    it, exactly 0, not the decay gradient's reverse sum there (0 up to rounding)."""
    skip_without_kernel()
    leaves = make(1, 40, 2, 5, 6, "caller", True, "zeros", seed=1, kind=kind)
    got = run(native.native_chunk, leaves, 8, True, "caller", kind)["dg"]
    zero = leaves["g"] == -torch.inf
    assert zero.any() and (got[zero] == 0).all(), got[zero]
    assert (got[~zero] != 0).all()


def test_the_kernels_log_zero_is_eos():
    """chunk.h raises logs to its own copy of LOG_ZERO; both must agree (a decay of exactly 0 is
    taken as one whose exp is 0 in the type)."""
    skip_without_kernel()
    for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
        assert native._constant(f"chunk_log_zero_{suffix}") == LOG_ZERO[dtype]


@pytest.mark.parametrize("kind,decay", [("none", None), ("scalar", 0.5), ("row", 0.5), ("col", 0.5), ("row", 40.0)])
def test_native_chunk_gradcheck(kind, decay):
    skip_without_kernel()
    leaves = make(1, 11, 2, 3, 4, "caller", True, decay, seed=3, kind=kind)
    names = list(leaves)
    args = tuple(v.requires_grad_() for v in leaves.values())

    def fn(*tensors):
        t = dict(zip(names, tensors, strict=True))
        g = None if decay is None else t["g"].transpose(1, 2)
        s, e, x = (t[n].transpose(1, 2) for n in ("s", "e", "x"))
        return native.native_chunk(s, e, x, g, t["m0"], 4, kind)

    assert torch.autograd.gradcheck(fn, args)


def test_eos_takes_the_native_chunk_kernel(monkeypatch):
    """mode chunk (and auto) with no, a scalar, a row or a column decay on real CPU tensors run
    native_chunk, and explain says so; with a separable decay, or complex, they do not."""
    skip_without_kernel()
    calls = []
    kernel = native.native_chunk
    monkeypatch.setattr("lcsm.ops.chunk.native_chunk", lambda *a: calls.append(a[-1]) or kernel(*a))
    x = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    scalar = -torch.rand(1, 50, 2, 1, 1, dtype=torch.float64)
    row = -torch.rand(1, 50, 2, 8, 1, dtype=torch.float64)
    col = -torch.rand(1, 50, 2, 1, 8, dtype=torch.float64)
    for kind, g in (("none", None), ("scalar", scalar), ("row", row), ("col", col)):
        assert "in C (native_chunk" in explain(x, x, x, g, mode="chunk").reason
        y, _ = eos(x, x, x, g, mode="chunk", chunk_size=16)
        assert calls[-1] == kind
        want, _ = eos(x, x, x, g, mode="recurrent")
        assert_close({"y": y}, {"y": want}, dtype=torch.float64, context=kind)
    strong = explain(x, x, x, 8 * row, mode="chunk", chunk_size=64).reason
    assert "in C (native_chunk" in strong and "strong decays" not in strong, strong
    separable = explain(x, x, x, (row, col), mode="chunk").reason
    assert "not the native chunk kernel: decay 'outer'" in separable, separable
    eos(x, x, x, (row, col), mode="chunk")
    assert len(calls) == 4
    z = x.to(torch.complex128)
    assert "not the native chunk kernel: compute dtype torch.complex128" in explain(z, z, z, mode="chunk").reason


def test_native_chunk_refuses_what_it_cannot_take():
    skip_without_kernel()
    s, x = torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 5, 4)
    got = r"got \[\[1, 2, 5, 3\], \[1, 2, 4, 3\]"
    with pytest.raises(ValueError, match=r"native_chunk: expected s and e \[B, H, T, K\].*" + got):
        native.native_chunk(s, torch.zeros(1, 2, 4, 3), x, None, None, 4)
    with pytest.raises(ValueError, match=r"g \[B, H, T, 1\] \(kind 'scalar'\).*\[1, 2, 5, 3\], None\]"):
        native.native_chunk(s, s, x, s, None, 4)
    with pytest.raises(ValueError, match=r"g \[B, H, T, D\] \(kind 'col'\).*\[1, 2, 5, 3\], None\]"):
        native.native_chunk(s, s, x, s, None, 4, "col")
    with pytest.raises(ValueError, match=r"g None \(kind 'none'\)"):
        native.native_chunk(s, s, x, s, None, 4, "none")
    with pytest.raises(ValueError, match="kind expected one of none, scalar, row, col or None, got 'outer'"):
        native.native_chunk(s, s, x, s, None, 4, "outer")
    with pytest.raises(ValueError, match=r"m0 \[B, H, K, D\].*\[1, 2, 4, 3\]\]"):
        native.native_chunk(s, s, x, None, torch.zeros(1, 2, 4, 3), 4)
    with pytest.raises(ValueError, match="one dtype and chunk >= 1, got torch.float32, torch.float64"):
        native.native_chunk(s, s.double(), x, None, None, 4)
    with pytest.raises(ValueError, match="float32 or float64 CPU tensors, got torch.float16"):
        native.native_chunk(s.half(), s.half(), x.half(), None, None, 4)


@pytest.mark.parametrize("kind", ["none", "scalar", "row", "col"])
def test_compiled_graphs_call_the_kernel(monkeypatch, kind):
    """torch.compile(fullgraph=True, dynamic=True) of eos's chunk mode: the graph calls the kernel's
    two custom ops (forward and backward), at two lengths without retracing, with the eager call's
    outputs and gradients bit for bit; a decay of exactly 0 inside the sequence, an initial state
    and a cotangent on the final state."""
    skip_without_kernel()
    from torch._dynamo.testing import CompileCounterWithBackend

    calls = []
    run_kernel = native._run
    monkeypatch.setattr(native, "_run", lambda *args: calls.append(1) or run_kernel(*args))
    tail = {"none": None, "scalar": (1, 1), "row": (5, 1), "col": (1, 3)}[kind]

    def f(i, e, s, log_o, m0):
        return eos(i, e, s, log_o, mode="chunk", chunk_size=8, initial_state=m0, output_final_state=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T in (21, 34):
        g = torch.Generator().manual_seed(T)
        leaves = [torch.randn(2, T, 3, n, generator=g) for n in (3, 5, 5)]
        if tail is not None:
            log_o = -torch.rand(2, T, 3, *tail, generator=g)
            log_o[:, T // 2] = -torch.inf
            leaves.append(log_o)
        leaves.append(torch.randn(2, 3, 5, 3, generator=g))
        leaves = [t.requires_grad_() for t in leaves]
        results = []
        for fn in (f, compiled):
            calls.clear()
            args = leaves if tail is not None else [*leaves[:3], None, leaves[3]]
            y, m = fn(*args)
            grads = torch.autograd.grad((y * 1.3).sum() + (m * 0.7).sum(), leaves)
            assert len(calls) == 2, (kind, T, len(calls))  # forward and backward
            results.append([y, m, *grads])
        for eager, traced in zip(*results, strict=True):
            assert torch.equal(eager, traced), (kind, T)
    assert counter.frame_count == 1
