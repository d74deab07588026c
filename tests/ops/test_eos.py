"""Every mode of ``eos`` against the recurrent reference: outputs, final states and every gradient.

Fast modes run in the dtype under test; the reference runs in double precision on the same
values, so float32 results are judged against the exact answer, not against another float32 run.
"""

import functools
import importlib
import math

import pytest
import torch
from torch.nn.functional import logsigmoid

from lcsm.ops import LogProduct, eos, eos_step, explain
from lcsm.ops.native_scan import native_unavailable
from lcsm.testing import assert_close

B, H, K, D = 2, 2, 4, 3
NAMES = ("i", "e", "s", "log_o", "initial_state")


def make_inputs(
    T,
    *,
    e="dd",
    s="dd",
    decay="row",
    dd_decay=True,
    complex_decay=False,
    complex_es=False,
    initial=True,
    seed=0,
    strength=1.0,
):
    """Random EOS inputs. decay in none/scalar/row/col/full/outer, or a LogProduct(a, b):
    "product" (Mamba's shape: a step a [.., 1, D] >= 0 times b [.., K, D] < 0), "product-outer"
    (a [.., K, 1] times b [.., 1, D]: each operand spans one of K and D) or "product-row" (a and b
    both [.., K, 1]: no full decay); e, s in dd/vec/mat. "outer" is a separable pair (log_row,
    log_col). For a pair or a product dd_decay may be a pair (first part dd, second part dd);
    complex_decay makes a product's b complex."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def state(kind):
        x = {"dd": lambda: rnd(B, T, H, K), "vec": lambda: rnd(H, K), "mat": lambda: rnd(H, K, D)}[kind]()
        if complex_es:
            x = torch.complex(x, rnd(*x.shape))
        return x / math.sqrt(K)

    out = {"i": rnd(B, T, H, D), "e": state(e), "s": state(s), "log_o": None, "initial_state": None}

    def log_decay(tail, dd):
        lead = (B, T, H) if dd else (H,)
        log_o = strength * logsigmoid(rnd(*lead, *tail) + 1.0)
        if complex_decay:
            log_o = torch.complex(log_o, rnd(*lead, *tail))
        return log_o

    dd_first, dd_second = dd_decay if isinstance(dd_decay, tuple) else (dd_decay, dd_decay)
    if decay == "outer":
        out["log_o"] = (log_decay((K, 1), dd_first), log_decay((1, D), dd_second))
    elif decay.startswith("product"):
        tails = {"product": ((1, D), (K, D)), "product-outer": ((K, 1), (1, D)), "product-row": ((K, 1), (K, 1))}[decay]

        def lead(dd):
            return (B, T, H) if dd else (H,)

        a = strength * torch.nn.functional.softplus(rnd(*lead(dd_first), *tails[0]) - 1.0)
        b = -torch.exp(rnd(*lead(dd_second), *tails[1]) / 2)
        if complex_decay:
            b = torch.complex(b, rnd(*b.shape))
        out["log_o"] = LogProduct(a, b)
    elif decay != "none":
        tail = {"scalar": (1, 1), "row": (K, 1), "col": (1, D), "full": (K, D)}[decay]
        out["log_o"] = log_decay(tail, dd_decay)
    if initial:
        out["initial_state"] = rnd(B, H, K, D)
        if complex_decay or complex_es:
            out["initial_state"] = torch.complex(out["initial_state"], rnd(B, H, K, D))
    return out


def _leaf_items(leaves):
    """(name, tensor) of every input tensor; a separable pair's parts as log_o[0] and log_o[1], a
    product's operands as log_o.a and log_o.b."""
    for n in NAMES:
        x = leaves[n]
        if isinstance(x, LogProduct):
            yield from ((f"{n}.a", x.a), (f"{n}.b", x.b))
        elif isinstance(x, tuple):
            yield from ((f"{n}[{j}]", part) for j, part in enumerate(x))
        elif x is not None:
            yield n, x


def run(inputs, mode, dtype, chunk_size=16, grads=True, seed=1, real_output=False, take_real=False, autocast=False):
    """y, m_T and the gradients of every input under random cotangents on both outputs (y's real
    part taken inside eos with real_output, after it with take_real); with autocast the forward
    runs under bfloat16 autocast, the backward outside it."""

    def cast(x):
        if x is None:
            return None
        if isinstance(x, LogProduct):
            return LogProduct(cast(x.a), cast(x.b))
        if isinstance(x, tuple):
            return tuple(cast(part) for part in x)
        target = {torch.float32: torch.complex64, torch.float64: torch.complex128}[dtype] if x.is_complex() else dtype
        return x.detach().to(target).requires_grad_(grads)

    leaves = {k: cast(v) for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if mode == "loop":
            y, m = _loop(*(leaves[n] for n in NAMES))
        elif mode == "step":
            y, m = _step_loop(*(leaves[n] for n in NAMES))
        else:
            y, m = eos(
                leaves["i"],
                leaves["e"],
                leaves["s"],
                leaves["log_o"],
                mode=mode,
                initial_state=leaves["initial_state"],
                output_final_state=True,
                chunk_size=chunk_size,
                real_output=real_output,
            )
    if take_real:
        y = y.real
    out = {"y": y, "m_T": m}
    if grads:
        g = torch.Generator().manual_seed(seed)

        def cot(t):
            return (
                torch.complex(
                    torch.randn(t.shape, generator=g, dtype=torch.float64),
                    torch.randn(t.shape, generator=g, dtype=torch.float64),
                )
                if t.is_complex()
                else torch.randn(t.shape, generator=g, dtype=torch.float64)
            ).to(t.dtype)

        names, xs = zip(*_leaf_items(leaves), strict=False)
        dys = (cot(y), cot(m))
        got = torch.autograd.grad((y, m), xs, dys)
        out.update({f"d{n}": gr for n, gr in zip(names, got, strict=False)})
    return out


def _at(x, t):
    """Step t (an index or a slice) of an input in eos's layout: data-dependent tensors
    ([B, T, H, ...], 4 or 5 dims) are indexed in time, data-independent ones ([H, ...]) are the
    same at every step."""
    if isinstance(x, LogProduct):
        return LogProduct(_at(x.a, t), _at(x.b, t))
    if isinstance(x, tuple):
        return tuple(_at(part, t) for part in x)
    return x[:, t] if x is not None and x.dim() >= 4 else x


def _zero_memory(i, e, s, log_o):
    """m_0 = 0 [B, H, K, D] in the dtype the inputs promote to."""
    decays = (log_o.a, log_o.b) if isinstance(log_o, LogProduct) else log_o
    parts = (i, e, s, *(decays if isinstance(decays, tuple) else (decays,) if decays is not None else ()))
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in parts))
    K_ = e.shape[1] if e.dim() == 3 else e.shape[-1]
    return torch.zeros(i.shape[0], i.shape[2], K_, i.shape[3], dtype=dtype)


def _loop(i, e, s, log_o, m0):
    """LCSM eq. 2-3 written out in eos's public layout, sharing no code with lcsm.ops (neither its
    input handling nor its reference): the recurrent mode, which every other mode is held to, is
    held to this. A [H, K, D] e or s acts elementwise on the memory; a K-vector as an outer
    product (e) or a contraction over K (s); a separable pair decays by exp(row + col), a product
    by exp(a * b)."""
    m = m0 if m0 is not None else _zero_memory(i, e, s, log_o)
    ys = []
    for t in range(i.shape[1]):
        i_t, e_t, s_t = i[:, t, :, None, :], _at(e, t), _at(s, t)
        if log_o is not None:
            g = _at(log_o, t)
            if isinstance(g, LogProduct):
                g = g.a * g.b
            m = (g[0] + g[1] if isinstance(g, tuple) else g).exp() * m
        m = m + (e_t if e.dim() == 3 else e_t[..., None]) * i_t
        ys.append(((s_t if s.dim() == 3 else s_t[..., None]) * m).sum(-2))
    return torch.stack(ys, 1), m


def _step_loop(i, e, s, log_o, m0):
    """``eos_step`` token by token from m0 (zeros when None)."""
    state, ys = (m0 if m0 is not None else _zero_memory(i, e, s, log_o)), []
    for t in range(i.shape[1]):
        y_t, state = eos_step(*(_at(x, slice(t, t + 1)) for x in (i, e, s, log_o)), state)
        ys.append(y_t)
    return torch.cat(ys, 1), state


def check(inputs, mode, dtype, chunk_size=16, grads=True, context=""):
    expected = run(inputs, "recurrent", torch.float64, grads=grads)
    actual = run(inputs, mode, dtype, chunk_size=chunk_size, grads=grads)
    assert_close(actual, expected, dtype=dtype, context=f"{mode} {dtype} {context}")


DECAYS = [
    ("none", True),
    ("scalar", True),
    ("row", True),
    ("col", True),
    ("full", True),
    ("scalar", False),
    ("row", False),
    ("col", False),
    ("full", False),
    ("outer", True),
    ("outer", False),
    ("outer", (True, False)),
    ("outer", (False, True)),
    ("product", (True, False)),
    ("product", True),
    ("product", False),
    ("product", (False, True)),
    ("product-outer", True),
    ("product-row", (True, False)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["parallel", "chunk"])
@pytest.mark.parametrize("decay,dd", DECAYS)
def test_every_decay_shape(decay, dd, mode, dtype):
    check(make_inputs(65, decay=decay, dd_decay=dd), mode, dtype, chunk_size=16, context=f"{decay} dd={dd}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay,dd", DECAYS)
def test_chunk_from_zero_memory(decay, dd, dtype):
    """initial_state=None, as in training: the kernels' zero-memory branches, gradients included."""
    check(
        make_inputs(65, decay=decay, dd_decay=dd, initial=False),
        "chunk",
        dtype,
        chunk_size=16,
        context=f"no m0 {decay} dd={dd}",
    )


ES = [("dd", "dd"), ("vec", "mat"), ("mat", "vec"), ("mat", "mat")]


# float32 is read the same way for every e and s, so one pair of them covers it
LOOP_CASES = [(e, s, torch.float64, initial) for e, s in ES for initial in (True, False)] + [
    ("dd", "dd", torch.float32, True)
]


@pytest.mark.parametrize("e,s,dtype,initial", LOOP_CASES)
@pytest.mark.parametrize("decay,dd", DECAYS)
def test_recurrent_mode_against_the_written_out_loop(decay, dd, e, s, dtype, initial):
    """The reference itself, with eos's input handling (layouts, broadcasting of data-independent
    inputs, the separable pair, dtypes, the zero initial state), against ``_loop``."""
    inputs = make_inputs(9, e=e, s=s, decay=decay, dd_decay=dd, initial=initial, seed=3)
    assert_close(
        run(inputs, "recurrent", dtype),
        run(inputs, "loop", torch.float64),
        dtype=dtype,
        context=f"recurrent {dtype} {decay} dd={dd} e={e} s={s} initial={initial}",
    )


COMPLEX_LOOP_CASES = [("none", True, False, True)] + [
    (decay, dd, complex_decay, complex_es)
    for decay, dd in [("row", True), ("full", False), ("outer", (True, False)), ("product", (True, False))]
    for complex_decay, complex_es in [(True, False), (False, True), (True, True)]
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay,dd,complex_decay,complex_es", COMPLEX_LOOP_CASES)
def test_complex_recurrent_mode_against_the_written_out_loop(decay, dd, complex_decay, complex_es, dtype):
    inputs = make_inputs(
        9, e="vec", s="dd", decay=decay, dd_decay=dd, complex_decay=complex_decay, complex_es=complex_es, seed=5
    )
    assert_close(
        run(inputs, "recurrent", dtype),
        run(inputs, "loop", torch.float64),
        dtype=dtype,
        context=f"complex recurrent {dtype} {decay} dd={dd} decay={complex_decay} es={complex_es}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("decay,dd", DECAYS + [("row", "complex")])
def test_step_mode(decay, dd, initial, dtype):
    """``eos_step`` token by token (decoding; RWKV also trains through it): outputs, final state and
    every gradient against the reference, data-dependent and time-shared decays, K-vector and
    K x D e and s, complex rotations."""
    rotation = dd == "complex"
    inputs = make_inputs(
        20,
        e="dd" if dd is True else "vec",
        s="dd" if dd is True else "mat",
        decay=decay,
        dd_decay=True if rotation else dd,
        complex_decay=rotation,
        initial=initial,
        seed=17,
    )
    check(inputs, "step", dtype, context=f"{decay} dd={dd} initial={initial}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 2, 63, 64, 65, 257])
@pytest.mark.parametrize("chunk_size", [7, 64])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "full", "outer", "product"])
def test_lengths_and_chunk_sizes(T, chunk_size, decay, dtype):
    inputs = make_inputs(T, decay=decay, seed=T)
    check(inputs, "chunk", dtype, chunk_size=chunk_size, context=f"T={T} C={chunk_size} {decay}")
    if T <= 65:
        check(inputs, "parallel", dtype, context=f"T={T} {decay}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("e", ["dd", "vec", "mat"])
@pytest.mark.parametrize("s", ["dd", "vec", "mat"])
@pytest.mark.parametrize("decay", ["none", "row", "full", "outer", "product"])
def test_data_independent_expand_and_shrink(e, s, decay, dtype):
    inputs = make_inputs(33, e=e, s=s, decay=decay, seed=7)
    for mode in ("chunk", "parallel"):
        check(inputs, mode, dtype, chunk_size=8, context=f"e={e} s={s} {decay}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "decay,dd",
    [
        ("scalar", True),
        ("row", True),
        ("col", True),
        ("full", True),
        ("row", False),
        ("full", False),
        ("outer", True),
        ("outer", (False, True)),
        ("product", (True, False)),
        ("product-outer", True),
    ],
)
@pytest.mark.parametrize("complex_es", [False, True])
def test_complex(decay, dd, complex_es, dtype):
    inputs = make_inputs(41, decay=decay, dd_decay=dd, complex_decay=True, complex_es=complex_es, seed=11)
    for mode in ("chunk", "parallel"):
        check(inputs, mode, dtype, chunk_size=9, context=f"complex {decay} dd={dd} es={complex_es}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("e,s", [("dd", "dd"), ("vec", "mat")])
def test_complex_without_decay(e, s, dtype):
    """Complex e and s with no oscillation (o = 1): the chunk kernel's generic backward without a
    decay gradient, and the parallel map."""
    inputs = make_inputs(41, e=e, s=s, decay="none", complex_es=True, seed=11)
    for mode in ("chunk", "parallel"):
        check(inputs, mode, dtype, chunk_size=9, context=f"complex, no decay, e={e} s={s}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("e,s", [("vec", "vec"), ("mat", "vec"), ("vec", "mat"), ("mat", "mat")])
@pytest.mark.parametrize("decay", ["none", "scalar", "row", "col", "full", "outer", "product"])
@pytest.mark.parametrize("T", [1, 64, 257])
def test_fft(e, s, decay, T, dtype):
    inputs = make_inputs(T, e=e, s=s, decay=decay, dd_decay=False, seed=T + 5)
    check(inputs, "fft", dtype, context=f"e={e} s={s} {decay} T={T}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["none", "scalar", "row", "full", "outer"])
def test_fft_complex(decay, dtype):
    """Complex systems by FFT (the diagonal SSMs, DSS, S5, CES and TNN take this path under
    "auto"): complex e and s, a complex oscillation where there is one, at T = 100."""
    inputs = make_inputs(
        100, e="vec", s="mat", decay=decay, dd_decay=False, complex_decay=decay != "none", complex_es=True, seed=2
    )
    check(inputs, "fft", dtype, context=f"{decay} {dtype}")


def test_fft_complex_long_float32():
    """float32 FFT of a long complex diagonal system (S4D's and DSS's shape) with fast rotations
    (about 3 rad a step): the FFT's rounding grows with T, so its accuracy is checked where the
    models run it, T = 4096, outputs, final state and every gradient."""
    inputs = make_inputs(
        4096, e="vec", s="vec", decay="row", dd_decay=False, complex_decay=True, complex_es=True, seed=2
    )
    log_o = inputs["log_o"]
    inputs["log_o"] = torch.complex(
        log_o.real, 3.0 * torch.randn(log_o.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    )
    check(inputs, "fft", torch.float32, context="long")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["recurrent", "parallel", "chunk", "fft"])
@pytest.mark.parametrize("initial", [False, True])
def test_real_output_is_the_real_part(initial, mode, dtype):
    """real_output=True against Re(y) of the reference, the way the diagonal SSMs and CES use it
    (complex e, s and decay, real input): real y, the same complex memory, every gradient."""
    inputs = make_inputs(
        37, e="vec", s="vec", decay="row", dd_decay=False, complex_decay=True, complex_es=True, initial=initial, seed=21
    )
    expected = run(inputs, "recurrent", torch.float64, take_real=True)
    actual = run(inputs, mode, dtype, real_output=True)
    assert actual["y"].dtype == dtype and actual["m_T"].is_complex()
    assert_close(actual, expected, dtype=dtype, context=f"real_output {mode} {dtype} initial={initial}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "full", "outer", "product"])
def test_strong_decays_long_sequence(decay, dtype):
    """log_o down to -30 per step over T = 4096 (each factor of a separable one): no overflow from
    cumulative products, outputs, final state and every gradient as the recurrence's."""
    inputs = make_inputs(4096, decay=decay, seed=13)
    inputs["log_o"] = _uniform_decays(inputs["log_o"], -30.0, seed=5)
    check(inputs, "chunk", dtype, chunk_size=64, context=f"strong {decay}")


def _uniform_decays(log_o, low, seed):
    """log_o (or each part of a pair; a product as a in [0, 1] times b in [low, 0]) redrawn
    uniformly in [low, 0]."""
    g = torch.Generator().manual_seed(seed)

    def draw(x, bound=low):
        return bound * torch.rand(x.shape, generator=g, dtype=torch.float64)

    if isinstance(log_o, LogProduct):
        return LogProduct(draw(log_o.a, 1.0), draw(log_o.b))
    return tuple(draw(x) for x in log_o) if isinstance(log_o, tuple) else draw(log_o)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decays_fft(dtype):
    inputs = make_inputs(4096, e="vec", s="vec", decay="row", dd_decay=False, seed=4, initial=True)
    inputs["log_o"] = -30.0 * torch.rand(
        inputs["log_o"].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    check(inputs, "fft", dtype, context="strong fft")


@pytest.mark.parametrize("decay", ["none", "row", "col", "full", "outer", "product"])
@pytest.mark.parametrize("es", [("dd", "dd"), ("vec", "mat")])
def test_carried_state(decay, es):
    """Two chunked calls with the first's final state passed in equal one call over the whole."""
    inputs = make_inputs(20, e=es[0], s=es[1], decay=decay, seed=17)
    y, m = eos(
        inputs["i"],
        inputs["e"],
        inputs["s"],
        inputs["log_o"],
        mode="chunk",
        chunk_size=8,
        initial_state=inputs["initial_state"],
        output_final_state=True,
    )

    def part(t0, t1):
        return (_at(inputs[n], slice(t0, t1)) for n in ("i", "e", "s", "log_o"))

    first, m1 = eos(
        *part(0, 9), mode="chunk", chunk_size=4, initial_state=inputs["initial_state"], output_final_state=True
    )
    second, m2 = eos(*part(9, 20), mode="chunk", chunk_size=4, initial_state=m1, output_final_state=True)
    assert_close({"y": torch.cat([first, second], 1), "m_T": m2}, {"y": y, "m_T": m}, context="carried")


# gradcheck's fast mode compares u^T J v for random u, v per input and output instead of every
# Jacobian entry (the full Jacobians took 7-30 s a decay: one column per input number). With tight
# float64 tolerances it fails on a decay gradient made 0.1% off in either kernel's backward; with
# the defaults (atol 1e-5, rtol 1e-3) fast mode passed a row decay's gradient 1% off, which the
# full check caught.
FAST_GRADCHECK = dict(fast_mode=True, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize(
    "decay,dd", [(d, True) for d in ("none", "scalar", "row", "col", "full", "outer")] + [("product", (True, False))]
)
def test_gradcheck_chunk(decay, dd):
    inputs = make_inputs(7, decay=decay, dd_decay=dd, seed=19)
    leaves = [x.clone().requires_grad_() for _, x in _leaf_items(inputs)]
    n_decay = len(leaves) - 4
    pack = LogProduct if isinstance(inputs["log_o"], LogProduct) else lambda *parts: parts

    def f(i, e, s, *rest):
        log_o = None if n_decay == 0 else (rest[0] if n_decay == 1 else pack(*rest[:2]))
        return eos(i, e, s, log_o, mode="chunk", chunk_size=3, initial_state=rest[-1], output_final_state=True)

    assert torch.autograd.gradcheck(f, leaves, **FAST_GRADCHECK)


@pytest.mark.parametrize("decay", ["none", "row", "full"])
def test_gradcheck_fft(decay):
    inputs = make_inputs(9, e="vec", s="mat", decay=decay, dd_decay=False, seed=23)
    leaves = [v.clone().requires_grad_() for v in inputs.values() if v is not None]
    has_decay = inputs["log_o"] is not None

    def f(i, e, s, *rest):
        log_o, m0 = (rest[0], rest[1]) if has_decay else (None, rest[0])
        return eos(i, e, s, log_o, mode="fft", initial_state=m0, output_final_state=True)

    assert torch.autograd.gradcheck(f, leaves, **FAST_GRADCHECK)


@pytest.mark.parametrize("decay", ["row", "outer", "full", "outer, K x D e", "product"])
def test_custom_backward_stores_no_per_step_memory(decay):
    """The chunk Functions save O(T (K + D) + (T / C) K D) numbers, not O(T K D); the elementwise
    kernel keeps a separable decay as its two factors (a K x D e sends it there) and a product
    (Mamba's Delta_t [T, 1, D] times A [K, D]) as its operands."""
    T, C, K_, D_ = 512, 64, 16, 16
    i = torch.randn(1, T, 1, D_, requires_grad=True)
    e = torch.randn(1, T, 1, K_, requires_grad=True) if decay != "outer, K x D e" else torch.randn(1, K_, D_)
    s = torch.randn(1, T, 1, K_, requires_grad=True)

    def gate(*tail):
        return logsigmoid(torch.randn(1, T, 1, *tail)).requires_grad_()

    log_o = {
        "row": lambda: gate(K_, 1),
        "full": lambda: gate(K_, D_),
        "outer": lambda: (gate(K_, 1), gate(1, D_)),
        "product": lambda: LogProduct(
            torch.rand(1, T, 1, 1, D_, requires_grad=True), -torch.rand(1, K_, D_, requires_grad=True)
        ),
    }[decay.split(",")[0]]()
    assert explain(i, e, s, log_o, mode="chunk").kernel == ("matmul" if decay in ("row", "outer") else "elementwise")
    y, _ = eos(i, e, s, log_o, mode="chunk", chunk_size=C)
    node = y.grad_fn
    while node is not None and not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    saved = sum(t.numel() for t in node.saved_tensors if t is not None)
    bound = 4 * T * (K_ + D_) + (T // C + 2) * K_ * D_ + (T * K_ * D_ if decay == "full" else 0)
    assert saved <= bound, f"saved {saved} numbers, bound {bound}"
    assert saved < T * K_ * D_ + T * (K_ + D_) * 4


def test_a_chunk_longer_than_the_sequence_runs_as_the_sequence(monkeypatch):
    """C > T would only pad the sequence (the C x C intra-chunk map grows with C): C = T runs, seen
    in the PyTorch form's chunking (the native kernel, which takes the same C, patched off)."""
    import lcsm.ops.chunk_matmul as chunk_mod

    monkeypatch.setattr(importlib.import_module("lcsm.ops.chunk"), "native_chunk_unsupported", lambda p: "off")
    sizes = []
    chunked = chunk_mod._chunked
    monkeypatch.setattr(chunk_mod, "_chunked", lambda x, C, *rest: sizes.append(C) or chunked(x, C, *rest))
    inputs = make_inputs(5, decay="row")
    got = run(inputs, "chunk", torch.float64, chunk_size=4096)
    assert sizes and set(sizes) == {5}
    assert "C=5 " in explain(*(inputs[n] for n in ("i", "e", "s", "log_o")), chunk_size=4096).reason
    assert_close(got, run(inputs, "recurrent", torch.float64))


def test_empty_sequence_returns_initial_state():
    inputs = make_inputs(0, decay="row")
    y, m = eos(
        inputs["i"],
        inputs["e"],
        inputs["s"],
        inputs["log_o"],
        initial_state=inputs["initial_state"],
        output_final_state=True,
    )
    assert y.shape == (B, 0, H, D)
    assert torch.equal(m, inputs["initial_state"])


@pytest.mark.parametrize("mode", ["auto", "chunk", "fft", "parallel", "recurrent"])
@pytest.mark.parametrize("empty", ["B", "H", "D"])
def test_empty_batch_head_or_width(mode, empty):
    """B, H or D = 0 gives the empty output in every mode (the chunk kernel's block sizing divided
    by zero, the FFT raised inside MKL); K = 0 gives zeros, the read-out of an empty memory."""
    b, h, d = (0 if empty == "B" else 2), (0 if empty == "H" else 2), (0 if empty == "D" else 4)
    i, m0 = torch.randn(b, 5, h, d), torch.randn(b, h, 3, d)
    e, s, log_o = torch.rand(h, 3), torch.rand(h, 3), -torch.rand(h, 3, 1)
    y, m = eos(i, e, s, log_o, mode=mode, initial_state=m0, output_final_state=True, chunk_size=2)
    assert y.shape == (b, 5, h, d) and m.shape == (b, h, 3, d)
    y, _ = eos(torch.randn(2, 5, 2, 4), torch.rand(2, 0), torch.rand(2, 0), mode="chunk" if mode == "fft" else mode)
    assert torch.equal(y, torch.zeros(2, 5, 2, 4))


def test_empty_keys_with_a_full_decay():
    """K = 0 with a full K x D decay: auto's plan (the native scan) sized its kept memories by K
    and divided by zero, in eos and explain alike."""
    i, e, log_o = torch.randn(1, 5, 1, 4), torch.randn(1, 5, 1, 0), -torch.rand(1, 5, 1, 0, 4)
    assert explain(i, e, e, log_o).mode == "native"
    assert torch.equal(eos(i, e, e, log_o)[0], torch.zeros(1, 5, 1, 4))


@pytest.mark.parametrize("mode", ["recurrent", "parallel", "chunk"])
def test_a_complex_initial_state_keeps_y_complex(mode):
    """y takes the inputs' precision, not the state's, but a complex state's kind: real inputs
    with a complex memory give a complex y (its imaginary part was dropped)."""
    inputs = make_inputs(6, decay="row", initial=False)
    m0 = torch.complex(*(torch.randn(B, H, K, D, dtype=torch.float64) for _ in range(2)))
    y, m = eos(
        inputs["i"], inputs["e"], inputs["s"], inputs["log_o"], mode=mode, initial_state=m0, output_final_state=True
    )
    y_ref, _ = eos(
        *(inputs[n].to(torch.complex128) for n in ("i", "e", "s")), inputs["log_o"], mode="recurrent", initial_state=m0
    )
    assert y.dtype == torch.complex128 and m.dtype == torch.complex128
    assert_close({"y": y}, {"y": y_ref})


def test_half_precision_computes_in_float32():
    inputs = make_inputs(30, decay="row", initial=False)
    args = [inputs[n].to(torch.bfloat16) for n in ("i", "e", "s", "log_o")]
    y, m = eos(*args, mode="chunk", chunk_size=8, output_final_state=True)
    assert y.dtype == torch.bfloat16 and m.dtype == torch.float32
    ref = run(
        {**inputs, **dict(zip(("i", "e", "s", "log_o"), [a.double() for a in args], strict=False))},
        "recurrent",
        torch.float64,
        grads=False,
    )
    assert_close({"y": y}, {"y": ref["y"]}, dtype=torch.bfloat16)
    # the memory is returned in float32, so it is held to float32's tolerance (bfloat16's would
    # pass a memory rounded to bfloat16)
    assert_close({"m_T": m}, {"m_T": ref["m_T"]}, dtype=torch.float32)
    # carried into the next call (and a step), that float32 state leaves y bfloat16 (it made y float32)
    y_next, m_next = eos(*args, mode="chunk", initial_state=m, output_final_state=True)
    assert y_next.dtype == torch.bfloat16 and m_next.dtype == torch.float32
    y_step, m_step = eos_step(*(a[:, :1] for a in args), m)
    assert y_step.dtype == torch.bfloat16 and m_step.dtype == torch.float32


@pytest.mark.parametrize("mode", ["parallel", "chunk", "fft"])
@pytest.mark.parametrize("decay", ["none", "row", "full", "outer"])
def test_autocast_leaves_the_operator_in_float32(decay, mode):
    """Under torch.autocast (the engine's bf16 precision) the operator still computes in float32:
    autocast would run its matmuls in bfloat16 (about 3e-3 relative error on this problem, in
    the outputs and in the gradients of the backward that follows), far outside float32's
    tolerance."""
    time_invariant = mode == "fft"
    inputs = make_inputs(
        45,
        e="vec" if time_invariant else "dd",
        s="mat" if time_invariant else "dd",
        decay=decay,
        dd_decay=not time_invariant,
        seed=4,
    )
    expected = run(inputs, "recurrent", torch.float64)
    actual = run(inputs, mode, torch.float32, autocast=True)
    assert_close(actual, expected, dtype=torch.float32, context=f"{mode} {decay}")


def test_autocast_with_keyword_arguments():
    """The guard finds the device among keyword arguments too."""
    inputs = make_inputs(45, decay="row", initial=False, seed=4)
    expected = run(inputs, "recurrent", torch.float64, grads=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = eos(**{n: inputs[n].float() for n in ("i", "e", "s", "log_o")}, mode="chunk")
    assert_close({"y": y}, {"y": expected["y"]}, dtype=torch.float32)


def test_explain_rules():
    dd = make_inputs(100, decay="row")
    di = make_inputs(100, e="vec", s="mat", decay="full", dd_decay=False)

    def args(x):
        return (x["i"], x["e"], x["s"], x["log_o"])

    assert explain(*args(dd)).mode == "chunk" and explain(*args(dd)).kernel == "matmul"
    assert explain(*args(di)).mode == "fft"
    assert explain(*args(make_inputs(100, e="vec", s="vec", decay="row", dd_decay=True))).mode == "chunk"
    assert explain(*args(make_inputs(100, decay="full")), mode="chunk").kernel == "elementwise"
    assert explain(*args(make_inputs(1, decay="row"))).mode == "recurrent"
    assert "data-independent" in explain(*args(di)).reason
    product = args(make_inputs(100, decay="product", dd_decay=(True, False)))
    # Mamba's structure on the CPU: the native scan where its kernel builds (tests/ops/test_native_scan.py)
    assert explain(*product).mode == ("native" if native_unavailable() is None else "chunk")
    chunked = explain(*product, mode="chunk")
    assert chunked.kernel == "elementwise" and "decay=product" in chunked.reason
    assert explain(*args(make_inputs(100, e="vec", s="mat", decay="product", dd_decay=False))).mode == "fft"
    # a product spanning only K is the row decay it is, for the matmul kernel
    row = explain(*args(make_inputs(100, decay="product-row", dd_decay=(True, False))))
    assert row.kernel == "matmul" and "decay=row" in row.reason


@pytest.mark.parametrize("tail,strong_form", [((1, 1), "_pairwise"), ((4, 1), "_intra_subchunked")])
def test_explain_says_which_decays_take_the_strong_form(tail, strong_form, monkeypatch):
    """explain's account of the matmul kernel's data-dependent choice is the one the kernel makes:
    a chunk of 16 steps of log decays near -3 spans beyond SAFE_SPAN (the strong decays' form),
    chunks of 4 steps do not; T 200 makes one segment. The PyTorch form's choice: the scalar decay
    is taken from the native kernel (tests/ops/test_native_chunk.py), which has no such choice."""
    from lcsm.ops import chunk_matmul

    for module in ("lcsm.ops.chunk", "lcsm.ops.eos"):  # modules (lcsm.ops.eos names the function)
        monkeypatch.setattr(importlib.import_module(module), "native_chunk_unsupported", lambda p: "off")
    g = torch.Generator().manual_seed(0)
    i, e, s = (torch.randn(1, 200, 2, 4, generator=g) for _ in range(3))
    log_o = -3 * torch.rand(1, 200, 2, *tail, generator=g)
    calls = []
    original = getattr(chunk_matmul, strong_form)
    monkeypatch.setattr(chunk_matmul, strong_form, lambda *a, **k: calls.append(1) or original(*a, **k))
    for C, strong in ((16, True), (4, False)):
        calls.clear()
        reason = explain(i, e, s, log_o, chunk_size=C).reason
        eos(i, e, s, log_o, mode="chunk", chunk_size=C)
        assert bool(calls) == strong
        expected = "factorised in 0 of 1 segment(s)" if strong else "factorised through each chunk's start in all 1"
        assert expected in reason, reason


def _bad(match, *args, **kwargs):
    with pytest.raises((ValueError, TypeError), match="^" + match):
        eos(*args, **kwargs)


def test_errors_name_the_argument():
    x = make_inputs(10, decay="row")
    i, e, s, g = x["i"], x["e"], x["s"], x["log_o"]
    _bad(r"i: expected \[B, T, H, D\]", i[0], e, s)
    _bad(r"e: data-dependent e must be \[B, T, H, K\]", i, e[:, :5], s)
    _bad(r"s: expand dimension K of s is 5", i, e, torch.randn(B, 10, H, 5, dtype=torch.float64))
    _bad(r"log_o: last two dims", i, e, s, torch.zeros(B, 10, H, K + 1, 1, dtype=torch.float64))
    _bad(r"log_o: data-dependent log_o must start with", i, e, s, g[:, :3])
    _bad(r"initial_state: expected \[B, H, K, D\]", i, e, s, g, initial_state=torch.zeros(B, H, K, D + 1))
    _bad(r"mode='fft' needs data-independent e, s and log_o .* e, s, log_o are data-dependent", i, e, s, g, mode="fft")
    _bad(r"chunk_size: expected an integer >= 1, got 0", i, e, s, g, chunk_size=0)
    _bad(r"mode: expected one of", i, e, s, g, mode="fastest")
    _bad(r"real_output: expected True or False, got 'yes'", i, e, s, g, real_output="yes")
    _bad(r"output_final_state: expected True or False, got 'no'", i, e, s, g, output_final_state="no")
    _bad(r"i: expected a floating-point or complex tensor, got dtype torch.int64", i.long(), e, s)
    meta = torch.zeros(B, 10, H, D, device="meta")
    _bad(r"e: all inputs must be on one device, got i on meta, e on cpu", meta, e, s)
    _bad(r"e: expected \[B, T, H, K\], \[H, K\] or \[H, K, D\]", i, torch.zeros(K), s)
    _bad(r"e: data-independent e must be \[H, K\] with H = 2, got \[3, 4\]", i, torch.zeros(3, K), s)
    _bad(r"s: data-independent matrix s must be \[H, K, D\] = \[2, K, 3\], got \[2, 4, 5\]", i, e, torch.zeros(H, K, 5))
    _bad(
        r"log_o: data-independent log_o must be \[H, K\|1, D\|1\] with H = 2, got \[3, 4, 1\]",
        i,
        e,
        s,
        torch.zeros(3, K, 1),
    )
    _bad(
        r"log_o: expected \[B, T, H, K\|1, D\|1\] \(data-dependent\), .* got 4-d tensor \[2, 10, 2, 4\]",
        i,
        e,
        s,
        torch.zeros(B, 10, H, K),
    )
    p = make_inputs(10, decay="product", dd_decay=(True, False))["log_o"]
    _bad(
        r"log_o.a: data-dependent log_o.a must start with \[B, T, H\] = \[2, 10, 2\], got \[2, 3, 2, 1, 3\]",
        i,
        e,
        s,
        LogProduct(p.a[:, :3], p.b),
    )
    _bad(
        r"log_o.b: last two dims must be \(K or 1, D or 1\) = \(4 or 1, 3 or 1\), got \[2, 4, 5\]",
        i,
        e,
        s,
        LogProduct(p.a, torch.zeros(H, K, 5, dtype=torch.float64)),
    )
    _bad(
        r"log_o.b: expected \[B, T, H, K\|1, D\|1\] \(data-dependent\) or \[H, K\|1, D\|1\] "
        r"\(data-independent\), got 2-d tensor \[4, 3\]",
        i,
        e,
        s,
        LogProduct(p.a, p.b[0]),
    )
    _bad(
        r"log_o.b: expected a floating-point or complex tensor, got dtype torch.int64",
        i,
        e,
        s,
        LogProduct(p.a, p.b.long()),
    )
    _bad(
        r"log_o.b: all inputs must be on one device, got .*log_o.a on cpu, log_o.b on meta",
        i,
        e,
        s,
        LogProduct(p.a, torch.zeros(H, K, D, device="meta")),
    )
    with pytest.raises(ValueError, match=r"^i_t: eos_step takes one token"):
        eos_step(i, e, s, g, torch.zeros(B, H, K, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^i_t: eos_step takes one token, expected \[B, 1, H, D\], got \[2, 2, 3\]"):
        eos_step(i[:, 0], e[:, :1], s[:, :1], g[:, :1], torch.zeros(B, H, K, D, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^state: eos_step needs the memory \[B, H, K, D\]"):
        eos_step(i[:, :1], e[:, :1], s[:, :1], g[:, :1], None)
    with pytest.raises(ValueError, match=r"^state: expected \[B, H, K, D\] = \[2, 2, 4, 3\], got \[2, 2, 3, 4\]"):
        eos_step(i[:, :1], e[:, :1], s[:, :1], g[:, :1], torch.zeros(B, H, D, K, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^state: expected a floating-point or complex tensor"):
        eos_step(i[:, :1], e[:, :1], s[:, :1], g[:, :1], torch.zeros(B, H, K, D, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strength", [20.0, 80.0])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "outer"])
@pytest.mark.parametrize("chunk_size", [48, 64])
def test_strong_decay_branches_with_gradients(decay, strength, dtype, chunk_size):
    """Decays strong enough that chunks (and, at 80, sub-chunks of 16 and of 4 steps) exceed the
    single-reference span, so every level of the matmul kernel's sub-chunking is exercised (down to
    single steps in float32), gradients included."""
    check(
        make_inputs(130, decay=decay, strength=strength, seed=29),
        "chunk",
        dtype,
        chunk_size=chunk_size,
        context=f"strength={strength}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_single_steps_beyond_the_safe_span(dtype):
    """Full K x D decays down to -500 per step (LCSM's SSM parameterisation reaches -100: delta x A
    with A up to K): one step alone exceeds SAFE_SPAN in both dtypes, which a factorised
    (cumulative-product) form could not survive; the elementwise kernel's stepwise recurrence keeps
    outputs, state and every gradient finite and exact."""
    check(
        make_inputs(37, decay="full", strength=500.0, seed=41),
        "chunk",
        dtype,
        chunk_size=16,
        context="full strength=500",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "outer"])
def test_matmul_kernel_decay_gradient_beyond_the_safe_span(decay, dtype):
    """The matmul kernel's dlog_o is a reverse cumulative sum whose boundary term
    sum dM * conj(o_T m_{T-1}) is taken without the last input (ChunkMatmulFunction): with it, an
    O(1) cancellation against the last step cost float32 all accuracy once dlog_o = O(o) got
    small (from about -120 per step). Here single steps decay by up to -500, with a random
    cotangent on the final state. A separable decay gets half the strength in each factor, so
    that o itself is as strong as the others: at 500 per factor d initial_state = dm_1 conj(o_1)
    is below float32's smallest denormal."""
    strength = 250.0 if decay == "outer" else 500.0
    check(
        make_inputs(37, decay=decay, strength=strength, seed=41),
        "chunk",
        dtype,
        chunk_size=16,
        context=f"{decay} strength={strength}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "full", "outer"])
def test_parallel_decay_gradient_under_strong_decays(decay, dtype):
    """The parallel form's own-step weight exp(Gamma_t - Gamma_t) = 1 took part in the gradient
    through the difference, two O(1) terms cancelling to dlog_o = O(o): 4e-3 relative error at
    -30 per step in float64, the whole of it at -50. Every step's log decay in [-60, -50] (half
    in each factor of a separable one: float32's denormals end near exp(-103)), a cotangent on the
    final state."""
    inputs = make_inputs(23, decay=decay, seed=43)
    drawn = _uniform_decays(inputs["log_o"], -5.0 if decay == "outer" else -10.0, seed=3)
    inputs["log_o"] = tuple(x - 25.0 for x in drawn) if decay == "outer" else drawn - 50.0
    check(inputs, "parallel", dtype, context=decay)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "decay,strength",
    [("none", 1.0)] + [(decay, strength) for decay in ("scalar", "row", "col", "outer") for strength in (1.0, 40.0)],
)
def test_segmented_long_sequences(decay, strength, dtype, monkeypatch):
    """The matmul kernel runs long sequences in segments with the memory carried across (and,
    backward, the adjoint memory and the decay gradient's running sum carried back); shrink the
    segment so a short test crosses several boundaries (including one that is not a multiple of
    the chunk), at moderate decays and at decays strong enough for the sub-chunked branches."""
    import lcsm.ops.chunk_matmul as chunk_matmul

    monkeypatch.setattr(chunk_matmul, "SEGMENT", 20)
    check(
        make_inputs(61, decay=decay, seed=31, strength=strength),
        "chunk",
        dtype,
        chunk_size=8,
        context=f"{decay} strength={strength}",
    )


@pytest.mark.parametrize("width,expected", [(64, 512), (65, 512), (96, 320), (4, 2048)])
def test_segments_hold_the_budget_to_half_a_chunk(width, expected):
    """Segments are the whole number of chunks nearest SEGMENT_BYTES (B 1, H 4, float32: 512 KiB
    is 512 steps of width 64, 504 of 65, 341 of 96), at most SEGMENT steps, and tile T with
    whole chunks but the last."""
    import lcsm.ops.chunk_matmul as chunk_matmul

    parts = chunk_matmul._segments(5000, 64, 4 * width * 4)
    assert parts[0].stop - parts[0].start == expected
    assert parts[0].start == 0 and parts[-1].stop == 5000
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))
    assert all((p.stop - p.start) % 64 == 0 for p in parts[:-1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize(
    "e,s,decay,complex_decay",
    [
        ("dd", "dd", "full", False),
        ("dd", "dd", "full", True),
        ("mat", "dd", "outer", False),
        ("dd", "mat", "none", False),
        ("vec", "mat", "row", True),
        ("mat", "vec", "full", False),
        ("dd", "dd", "product", False),
        ("dd", "dd", "product", True),
        ("mat", "vec", "product-outer", False),
    ],
)
def test_elementwise_blocks(e, s, decay, complex_decay, block, dtype, monkeypatch):
    """On a CPU the elementwise kernel runs a chunk's steps in blocks of memories that fit
    BLOCK_BYTES: at these tiny sizes one block is the whole chunk, so shrink the budget to blocks
    of one step (the large-batch case) and of three (blocks that do not divide the chunk of 8,
    itself not dividing T), with time-shared and per-step e, s and decays. (On other devices a
    block is the whole chunk, the path every other test takes.)"""
    import lcsm.ops._blocks as blocks

    memory_dtype = {torch.float64: torch.complex128, torch.float32: torch.complex64}[dtype] if complex_decay else dtype
    monkeypatch.setattr(
        blocks, "BLOCK_BYTES", block * B * H * K * D * torch.empty((), dtype=memory_dtype).element_size()
    )
    assert blocks.block_steps(B, H, K, D, memory_dtype, torch.device("cpu"), 8) == block
    assert blocks.block_steps(B, H, K, D, memory_dtype, torch.device("cuda"), 8) == 8
    dd = (s != "vec", False) if decay == "product" else s != "vec"
    inputs = make_inputs(29, e=e, s=s, decay=decay, dd_decay=dd, complex_decay=complex_decay, seed=13)
    assert explain(*(inputs[n] for n in NAMES[:4]), mode="chunk").kernel == "elementwise"
    check(inputs, "chunk", dtype, chunk_size=8, context=f"block {block} e={e} s={s} {decay}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("decay", ["none", "scalar", "row", "col", "outer"])
def test_chunk_autograd_baseline(decay, dtype, monkeypatch):
    """The matmul kernel differentiated by autograd (the benchmark's memory baseline) against the
    recurrence: outputs, final state and every gradient, T 61 in chunks of 8 and segments of 20
    (shrunk so that the memory is carried across segment boundaries)."""
    import importlib

    from lcsm.ops import chunk, chunk_matmul

    # the package exports the function eos, which shadows its module of the same name
    eos_module = importlib.import_module("lcsm.ops.eos")
    monkeypatch.setattr(eos_module, "eos_chunk", functools.partial(chunk.eos_chunk, backward="autograd"))
    monkeypatch.setattr(chunk_matmul, "SEGMENT", 20)
    check(make_inputs(61, decay=decay), "chunk", dtype, chunk_size=8, context=f"autograd {decay}")


def test_chunk_backward_option_is_checked():
    """``backward="autograd"`` is the matmul kernel's benchmark baseline only; the elementwise
    kernel refuses it, and an unknown value is refused by both, naming the argument."""
    from lcsm.ops._inputs import canonicalize
    from lcsm.ops.chunk import eos_chunk

    full = make_inputs(9, decay="full", seed=3)
    p = canonicalize(full["i"], full["e"], full["s"], full["log_o"])
    with pytest.raises(ValueError, match=r"backward: the elementwise kernel .* only the 'custom' backward"):
        eos_chunk(p, 4, backward="autograd")
    row = make_inputs(9, decay="row", seed=3)
    with pytest.raises(ValueError, match=r"backward: expected 'custom' or 'autograd', got 'fast'"):
        eos_chunk(canonicalize(row["i"], row["e"], row["s"], row["log_o"]), 4, backward="fast")


# ----------------------------------------------------------------------------- separable decays


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dd", [(True, False), (False, True)])
@pytest.mark.parametrize("strength", [20.0, 80.0])
def test_outer_strong_decays_with_mixed_parts(dd, strength, dtype):
    """A separable decay whose parts differ in data dependence, strong enough for the sub-chunked
    branches (and, at 80, diagonal blocks cut again), chunk size 48 (sub-chunks of 16) not
    dividing T = 130, gradients of both parts included."""
    check(
        make_inputs(130, decay="outer", dd_decay=dd, strength=strength, seed=43),
        "chunk",
        dtype,
        chunk_size=48,
        context=f"outer dd={dd} strength={strength}",
    )


def test_outer_explain_names_the_kernel():
    def args(x):
        return (x["i"], x["e"], x["s"], x["log_o"])

    vec = make_inputs(100, decay="outer", dd_decay=(True, False))
    for mode in ("auto", "chunk"):
        plan = explain(*args(vec), mode=mode)
        assert (plan.mode, plan.kernel) == ("chunk", "matmul"), plan
        assert "decay=outer" in plan.reason and "separable decay" in plan.reason, plan
    mat = explain(*args(make_inputs(100, e="vec", s="mat", decay="outer")))
    assert mat.kernel == "elementwise" and "K x D s" in mat.reason and "two factors" in mat.reason, mat
    assert explain(*args(make_inputs(100, e="vec", s="vec", decay="outer", dd_decay=False))).mode == "fft"
    assert explain(*args(make_inputs(100, e="vec", s="vec", decay="outer", dd_decay=(False, True)))).mode == "chunk"
    assert explain(*args(make_inputs(1, decay="outer"))).mode == "recurrent"


def test_outer_pair_errors_name_the_part():
    x = make_inputs(10, decay="outer")
    i, e, s, (row, col) = x["i"], x["e"], x["s"], x["log_o"]
    _bad(
        r"log_o\[0\]: data-dependent row decay must be \[B, T, H, K, 1\] = \[2, 10, 2, 4, 1\], "
        r"got \[2, 10, 2, 1, 3\]",
        i,
        e,
        s,
        (col, col),
    )
    _bad(
        r"log_o\[1\]: data-dependent column decay must be \[B, T, H, 1, D\] = \[2, 10, 2, 1, 3\], "
        r"got \[2, 9, 2, 1, 3\]",
        i,
        e,
        s,
        (row, col[:, :9]),
    )
    _bad(
        r"log_o\[0\]: data-independent row decay must be \[H, K, 1\] = \[2, 4, 1\], got \[2, 4, 3\]",
        i,
        e,
        s,
        (torch.zeros(H, K, D, dtype=torch.float64), col),
    )
    _bad(
        r"log_o\[1\]: data-independent column decay must be \[H, 1, D\] = \[2, 1, 3\], got \[2, 3, 1\]",
        i,
        e,
        s,
        (row, torch.zeros(H, D, 1, dtype=torch.float64)),
    )
    _bad(
        r"log_o\[1\]: the column factor of a separable log_o must be .* got 2-d tensor \[1, 3\]",
        i,
        e,
        s,
        (row, torch.zeros(1, D, dtype=torch.float64)),
    )
    _bad(r"log_o: a separable oscillation is a pair .* got a tuple of length 3", i, e, s, (row, col, col))
    _bad(r"log_o\[1\]: expected a floating-point or complex tensor, got dtype torch.int64", i, e, s, (row, col.long()))
    _bad(r"log_o\[0\]: all inputs must be on one device", i, e, s, (row.to("meta"), col))
    with pytest.raises(ValueError, match=r"log_o\[0\]: data-dependent row decay"):
        eos_step(i[:, :1], e[:, :1], s[:, :1], (row, col[:, :1]), torch.zeros(B, H, K, D, dtype=torch.float64))


# ----------------------------------------------------------------------------- a decay of exactly 0


def _zero_decay(log_o, where):
    """log_o with o = 0 exactly, log_o = -inf (as log(sigmoid(x)) gives for x <= -104 in float32):
    at one step t of a per-step decay (one K row of a time-shared one), or everywhere (where
    "all"). A separable pair takes it in its row part; a product a * b (a > 0 > b) in b, or as
    a = +inf where only a is per-step."""
    inf = float("inf")

    def put(x, value):
        x = x.clone()
        if where == "all":
            x.fill_(value)
        elif x.dim() == 5:
            x[:, where] = value
        else:
            x[:, :1] = value
        return x

    if isinstance(log_o, LogProduct):
        if where != "all" and log_o.b.dim() != 5 and log_o.a.dim() == 5:
            return LogProduct(put(log_o.a, inf), log_o.b)
        return LogProduct(log_o.a, put(log_o.b, -inf))
    if isinstance(log_o, tuple):
        return (put(log_o[0], -inf), log_o[1])
    return put(log_o, -inf)


def check_zero_decay(inputs, mode, dtype, chunk_size=16, context=""):
    """``check`` for inputs with some o = 0: y, m_T and the gradients of i, e, s and m_0 finite and
    the recurrence's. A product's operand takes dlog_o times the other operand, 0 * inf where that
    is infinite: NaN in the reference, and the same entries must be non-finite here; every other
    entry is compared as usual."""
    expected = run(inputs, "recurrent", torch.float64)
    actual = run(inputs, mode, dtype, chunk_size=chunk_size)
    for name in ("y", "m_T", "di", "de", "ds", "dinitial_state"):
        if expected.get(name) is not None:
            assert bool(torch.isfinite(actual[name]).all()), f"{mode} {dtype} {context}: {name} is not finite"
    finite = {n: torch.isfinite(x) for n, x in expected.items() if x is not None}
    for name, mask in finite.items():
        same = torch.equal(torch.isfinite(actual[name]), mask)
        assert same, f"{mode} {dtype} {context}: {name} is finite where the reference's is not, or the reverse"
    assert_close(
        {n: torch.where(mask, actual[n].to(expected[n].dtype), 0) for n, mask in finite.items()},
        {n: torch.where(mask, expected[n], 0) for n, mask in finite.items()},
        dtype=dtype,
        context=f"zero decay {mode} {dtype} {context}",
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["auto", "parallel", "chunk", "step"])
@pytest.mark.parametrize("where", [30, "all"])
@pytest.mark.parametrize("decay,dd", [(decay, dd) for decay, dd in DECAYS if decay != "none"])
def test_a_decay_of_exactly_zero(decay, dd, where, mode, dtype):
    """log_o = -inf (o = 0: the memory is forgotten) at step 30 of 65 (or in one row of a
    time-shared decay), or everywhere: every mode as the recurrence, no NaN from -inf - (-inf) or
    -inf * 0 in cumulative log decays; dlog_o is the recurrence's (0 where o = 0)."""
    inputs = make_inputs(65, decay=decay, dd_decay=dd)
    inputs["log_o"] = _zero_decay(inputs["log_o"], where)
    check_zero_decay(inputs, mode, dtype, context=f"{decay} dd={dd} -inf at {where}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("where", [0, 30, "all"])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "full", "outer", "product"])
def test_a_decay_of_exactly_zero_fft(decay, where, dtype):
    """Time-invariant systems (fft, auto's pick): o = 0 in one row (o^0 = 1 must not become
    exp(-inf * 0)) or everywhere."""
    dd = False if decay != "product" else (False, False)
    inputs = make_inputs(65, e="vec", s="vec", decay=decay, dd_decay=dd)
    inputs["log_o"] = _zero_decay(inputs["log_o"], where)
    for mode in ("fft", "auto"):
        check_zero_decay(inputs, mode, dtype, context=f"{decay} -inf at {where}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("t", [0, 15, 16, 64])
@pytest.mark.parametrize("decay", ["scalar", "row", "col", "outer", "full"])
def test_a_decay_of_exactly_zero_at_chunk_boundaries(decay, t, dtype):
    """o = 0 at the first step (m_0's gradient), at a chunk's last and first steps, and at the
    sequence's last step (the matmul kernel's final-memory term), from zero and non-zero m_0."""
    for initial in (True, False):
        inputs = make_inputs(65, decay=decay, initial=initial, seed=7)
        inputs["log_o"] = _zero_decay(inputs["log_o"], t)
        check_zero_decay(inputs, "chunk", dtype, context=f"{decay} -inf at {t} m0={initial}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_decay_of_exactly_zero_complex(dtype):
    """A complex log oscillation -inf + i theta is o = 0 as well."""
    inputs = make_inputs(65, decay="row", complex_decay=True)
    log_o = inputs["log_o"].clone()
    log_o.real[:, 30] = -float("inf")
    inputs["log_o"] = log_o
    for mode in ("auto", "parallel"):
        check_zero_decay(inputs, mode, dtype, context="complex -inf at 30")
