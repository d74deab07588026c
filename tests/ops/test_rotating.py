"""The rotating frame (``eos_rotating``) against the complex system it stands for, computed by the
recurrent reference of ``eos`` in float64: outputs, final states and every gradient, including
theta's, under random cotangents on both outputs."""

import math
import re

import pytest
import torch
from torch.nn.functional import logsigmoid

from lcsm.ops import eos, eos_rotating
from lcsm.testing import assert_close

B, H, K, D = 2, 2, 4, 3


def make_inputs(T, *, decay="none", es="dd", theta_rows=K, initial="complex", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    def state():
        x = {
            "dd": lambda: rnd(B, T, H, K),
            "complex": lambda: torch.complex(rnd(B, T, H, K), rnd(B, T, H, K)),
            "vec": lambda: rnd(H, K),
        }[es]()
        return x / math.sqrt(K)

    decays = {
        "none": None,
        "scalar": (B, T, H, 1, 1),
        "row": (B, T, H, K, 1),
        "row_di": (H, K, 1),
        "col": (B, T, H, 1, D),
        "full": (B, T, H, K, D),
        "pair": None,
    }
    log_o = decays[decay] and logsigmoid(rnd(*decays[decay]) + 1.0)
    if decay == "pair":
        log_o = (logsigmoid(rnd(B, T, H, K, 1) + 1.0), logsigmoid(rnd(B, T, H, 1, D) + 2.0))
    m0 = {
        "complex": lambda: torch.complex(rnd(B, H, K, D), rnd(B, H, K, D)),
        "real": lambda: rnd(B, H, K, D),
        "none": lambda: None,
    }[initial]()
    # Angles up to 3 rad: several turns over the sequence, so a sign or frame error cannot hide.
    return {
        "i": rnd(B, T, H, D),
        "e": state(),
        "s": state(),
        "theta": 3 * torch.rand(H, theta_rows, generator=g, dtype=torch.float64),
        "log_o": log_o,
        "initial_state": m0,
    }


def _cast(x, dtype):
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(_cast(part, dtype) for part in x)
    target = {torch.float32: torch.complex64, torch.float64: torch.complex128}[dtype] if x.is_complex() else dtype
    return x.detach().to(target).requires_grad_(True)


def _leaves(x):
    for name, t in x.items():
        if isinstance(t, tuple):
            yield from ((f"{name}[{j}]", part) for j, part in enumerate(t))
        elif t is not None:
            yield name, t


def run(inputs, dtype, mode, chunk_size=8, reference=False):
    x = {k: _cast(v, dtype) for k, v in inputs.items()}
    if reference:
        rotation = 1j * x["theta"][..., None]  # [H, K|1, 1]
        log_o = x["log_o"]
        if log_o is None:
            log_o = rotation
        elif isinstance(log_o, tuple):
            log_o = (log_o[0] + rotation, log_o[1])
        else:
            log_o = log_o + rotation
        y, m = eos(
            x["i"],
            x["e"],
            x["s"],
            log_o,
            mode="recurrent",
            initial_state=x["initial_state"],
            output_final_state=True,
            real_output=True,
        )
    else:
        y, m = eos_rotating(
            x["i"],
            x["e"],
            x["s"],
            x["theta"],
            x["log_o"],
            mode=mode,
            initial_state=x["initial_state"],
            output_final_state=True,
            chunk_size=chunk_size,
        )
    g = torch.Generator().manual_seed(1)

    def rnd(t):
        return torch.randn(t.shape, generator=g, dtype=torch.float64)

    def cot(t):
        return (torch.complex(rnd(t), rnd(t)) if t.is_complex() else rnd(t)).to(t.dtype)

    names, xs = zip(*_leaves(x), strict=False)
    grads = torch.autograd.grad((y, m), xs, (cot(y), cot(m)))
    return {"y": y, "m_T": m, **{f"d{n}": gr for n, gr in zip(names, grads, strict=False)}}


def check(inputs, dtype, mode, chunk_size=8, context=""):
    expected = run(inputs, torch.float64, mode, reference=True)
    actual = run(inputs, dtype, mode, chunk_size=chunk_size)
    assert actual["y"].dtype == dtype and actual["m_T"].is_complex()
    assert_close(actual, expected, dtype=dtype, context=f"{mode} {dtype} {context}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["auto", "chunk", "parallel", "recurrent"])
@pytest.mark.parametrize("decay", ["none", "scalar", "row", "row_di", "col", "full", "pair"])
def test_every_decay_and_mode(decay, mode, dtype):
    check(make_inputs(29, decay=decay, seed=3), dtype, mode, context=decay)


@pytest.mark.parametrize("es", ["dd", "complex", "vec"])
@pytest.mark.parametrize("theta_rows", [K, 1])
@pytest.mark.parametrize("initial", ["complex", "real", "none"])
def test_expand_shrink_angles_and_states(es, theta_rows, initial):
    inputs = make_inputs(23, decay="row", es=es, theta_rows=theta_rows, initial=initial, seed=5)
    for dtype in (torch.float64, torch.float32):
        check(inputs, dtype, "chunk", chunk_size=5, context=f"es={es} theta [H, {theta_rows}] m0 {initial}")


@pytest.mark.parametrize("T", [1, 2, 64, 65])
def test_lengths(T):
    check(make_inputs(T, decay="scalar", seed=T), torch.float64, "chunk", chunk_size=16, context=f"T={T}")


def test_an_empty_sequence_returns_the_initial_state():
    x = make_inputs(0, decay="scalar")
    y, m = eos_rotating(
        x["i"], x["e"], x["s"], x["theta"], x["log_o"], initial_state=x["initial_state"], output_final_state=True
    )
    assert y.shape == (B, 0, H, D)
    assert torch.equal(m, x["initial_state"])


def test_float32_angles_stay_exact_over_long_sequences():
    # t * theta formed in float32 near t = 8192, theta ~ 3 would be off by ~2e-4 rad per angle. The
    # inputs are rounded to float32 first, so the float64 reference solves the same problem (a
    # rounded theta alone moves the angle t * theta by up to t * theta * 6e-8).
    x = make_inputs(8192, decay="none", seed=9)
    x = {
        k: (v[:1, :, :1] if k in ("i", "e", "s") else v[:1, :1] if k == "initial_state" else v[:1])
        for k, v in x.items()
        if v is not None
    }
    x = {k: v.to(torch.complex64 if v.is_complex() else torch.float32).to(v.dtype) for k, v in x.items()}
    check({**x, "log_o": None}, torch.float32, "chunk", chunk_size=64, context="T=8192")


def test_a_state_carries_across_calls():
    x = make_inputs(30, decay="row", seed=4)
    y, m = eos_rotating(
        x["i"], x["e"], x["s"], x["theta"], x["log_o"], initial_state=x["initial_state"], output_final_state=True
    )
    cut = 13

    def part(t, a, b):
        return t[:, a:b]

    y1, m1 = eos_rotating(
        part(x["i"], 0, cut),
        part(x["e"], 0, cut),
        part(x["s"], 0, cut),
        x["theta"],
        part(x["log_o"], 0, cut),
        initial_state=x["initial_state"],
        output_final_state=True,
    )
    y2, m2 = eos_rotating(
        part(x["i"], cut, 30),
        part(x["e"], cut, 30),
        part(x["s"], cut, 30),
        x["theta"],
        part(x["log_o"], cut, 30),
        initial_state=m1,
        output_final_state=True,
    )
    assert_close({"y": torch.cat([y1, y2], 1), "m_T": m2}, {"y": y, "m_T": m}, context="two calls")


def test_bad_arguments_name_what_they_expected():
    x = make_inputs(5, decay="row")

    def args(**kw):
        return {**{k: x[k] for k in ("i", "e", "s", "theta", "log_o")}, **kw}

    column = torch.zeros(B, 5, H, 1, D, dtype=torch.float64)
    cases = [
        (dict(mode="fft"), ValueError, "mode: eos_rotating expects one of"),
        (dict(i=torch.complex(x["i"], x["i"])), TypeError, "i: eos_rotating takes a real i"),
        (dict(i=x["i"][0]), ValueError, f"i: expected [B, T, H, D], got 3-d tensor [5, {H}, {D}]"),
        (dict(theta=torch.complex(x["theta"], x["theta"])), TypeError, "theta: eos_rotating takes a real theta"),
        (
            dict(log_o=torch.complex(x["log_o"], x["log_o"])),
            TypeError,
            "log_o: eos_rotating takes a real log_o (the decay; the rotation goes in theta)",
        ),
        (dict(log_o=(torch.complex(x["log_o"], x["log_o"]), column)), TypeError, "log_o[0]: eos_rotating takes a real"),
        (dict(log_o=(x["log_o"], torch.complex(column, column))), TypeError, "log_o[1]: eos_rotating takes a real"),
        (dict(theta=x["theta"][:, :3]), ValueError, f"theta: expected [H, K] = [{H}, {K}]"),
        (
            dict(e=torch.randn(H, K, D, dtype=torch.float64)),
            ValueError,
            f"e: eos_rotating takes a K-vector e, [B, T, H, K] = [{B}, 5, {H}, K] or [H, K] = [{H}, K], "
            f"got [{H}, {K}, {D}] (a K x D e has no rotating-frame form",
        ),
        (dict(s=x["s"][..., :3]), ValueError, "s: expected K = 4"),
        (dict(e=x["e"][:, :4]), ValueError, f"e: eos_rotating takes a K-vector e, [B, T, H, K] = [{B}, 5, {H}, K]"),
        (dict(log_o=x["log_o"][..., :3, :]), ValueError, "log_o: expected the rows"),
    ]
    for kw, exc, words in cases:
        a = args(**kw)
        mode = a.pop("mode", "auto")
        with pytest.raises(exc, match="^" + re.escape(words)):
            eos_rotating(a["i"], a["e"], a["s"], a["theta"], a["log_o"], mode=mode)
    with pytest.raises(ValueError, match=r"initial_state: expected \[B, H, K, D\]"):
        eos_rotating(x["i"], x["e"], x["s"], x["theta"], initial_state=torch.zeros(B, H, K, D + 1))
    with pytest.raises(ValueError, match=r"^output_final_state: expected True or False, got 'no'"):
        eos_rotating(x["i"], x["e"], x["s"], x["theta"], output_final_state="no")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["auto", "chunk", "parallel", "recurrent"])
@pytest.mark.parametrize("where", [5, "all"])
@pytest.mark.parametrize("decay", ["scalar", "row", "row_di", "full", "pair"])
def test_a_decay_of_exactly_zero(decay, where, mode, dtype):
    """log_o = -inf (o = 0) at one step (one row of a time-shared decay) or everywhere: the rotating
    frame as the complex system, outputs, final states and every gradient (dlog_o 0 there)."""
    inputs = make_inputs(21, decay=decay)

    def put(x):
        x = x.clone()
        if where == "all":
            x.fill_(-math.inf)
        elif x.dim() == 5:
            x[:, where] = -math.inf
        else:
            x[:, :1] = -math.inf
        return x

    log_o = inputs["log_o"]
    inputs["log_o"] = (put(log_o[0]), log_o[1]) if isinstance(log_o, tuple) else put(log_o)
    check(inputs, dtype, mode, context=f"{decay} -inf at {where}")
