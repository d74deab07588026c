"""The Triton selective scan (``lcsm/ops/triton_scan.py``: ``eos`` mode "triton" with a full K x D
decay) against the recurrent reference in float64: outputs, final states and every gradient under
random cotangents, in float64 and float32, odd lengths across several blocks of steps, Mamba's
product (either operand order, one or K rows), a full decay tensor, time-shared e or s, strong
decays, packed documents against each document alone, and the plan's choices and refusals.

On a CUDA device the compiled kernels run there (the inputs are moved to it, the results back);
without one, on the CPU under Triton's interpreter (tests/conftest.py).
"""

import pytest
import test_packed as packed
import torch
from test_eos import make_inputs

from lcsm.ops import LogProduct, eos, explain
from lcsm.testing import assert_close

pytest.importorskip("triton")
from lcsm.ops import triton_chunk, triton_scan  # noqa: E402  (after the skip: they import triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_chunk.INTERPRETED,
    reason="no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=0 set before the run)",
)


def _to_device(x):
    if isinstance(x, LogProduct):
        return LogProduct(_to_device(x.a), _to_device(x.b))
    return None if x is None else x.to(DEVICE)


def _eos_on_device(**kwargs):
    """``eos`` with its tensors on DEVICE (autograd carries the gradients back) and its outputs on the CPU."""
    y, m = eos(**{k: _to_device(v) if k != "mode" and k != "output_final_state" else v for k, v in kwargs.items()})
    return y.cpu(), m.cpu()


def _check(inputs, dtype, context, cu_seqlens=None):
    """mode "triton" in ``dtype`` against the recurrent form in float64 (with ``cu_seqlens``: each
    document alone), outputs and every gradient."""
    if cu_seqlens is not None:
        packed.check_packed(_eos_on_device, inputs, cu_seqlens, dtype, context, mode="triton")
        return
    names = ("i", "e", "s", "log_o", "initial_state")
    args = {n: packed._cast(inputs[n], dtype) for n in names}
    reference = {n: packed._cast(inputs[n], torch.float64) for n in names}
    got = packed.outputs_and_grads(lambda a: _eos_on_device(**a, mode="triton", output_final_state=True), args)
    expected = packed.outputs_and_grads(lambda a: eos(**a, mode="recurrent", output_final_state=True), reference)
    assert_close(got, expected, dtype, context=context)


# Mamba's product (a step [.., 1, D] times a time-invariant K x D matrix, in either order: the second
# operand time-invariant, or the first), and a full K x D log decay tensor
DECAYS = [("product", (True, False)), ("product", (False, True)), ("full", True), ("full", False)]


@pytest.mark.parametrize(("T", "initial", "dtype"), [(17, True, torch.float64), (50, False, torch.float32)])
@pytest.mark.parametrize(("decay", "dd"), DECAYS)
def test_against_the_reference(decay, dd, T, initial, dtype):
    inputs = make_inputs(T, decay=decay, dd_decay=dd, initial=initial)
    assert explain(inputs["i"], inputs["e"], inputs["s"], inputs["log_o"], mode="triton").kernel == "triton-scan"
    _check(inputs, dtype, f"{decay} dd={dd} T={T} initial={initial}")


def test_without_the_final_state():
    """y alone (no final state asked for): the backward takes no final-state cotangent (None, not
    zeros) and gives the reference's gradients."""
    x = make_inputs(29, decay="product", dd_decay=(True, False), initial=True, seed=6)
    names = ("i", "e", "s", "log_o", "initial_state")
    got = {n: packed._cast(x[n], torch.float32) for n in names}
    ref = {n: packed._cast(x[n], torch.float64) for n in names}

    def grads(args, mode):
        leaves = [args["i"], args["e"], args["s"], args["log_o"].a, args["log_o"].b, args["initial_state"]]
        moved = {n: _to_device(v) for n, v in args.items()} if mode == "triton" else args
        y, _ = eos(**moved, mode=mode)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        return dict(zip(("i", "e", "s", "a", "b", "m0"), torch.autograd.grad(y, leaves, cot.to(y)), strict=True))

    assert_close({k: v.cpu() for k, v in grads(got, "triton").items()}, grads(ref, "recurrent"), torch.float32)
    # the kept memories are no differentiable output: autograd forms no zero gradient for them
    i, e, s = (_to_device(got[n]).transpose(1, 2) for n in ("i", "e", "s"))
    a, b = _to_device(got["log_o"].a).transpose(1, 2), _to_device(got["log_o"].b)
    kept = triton_scan.triton_scan(i, e, s, a, b, None, None, True)[2]
    assert kept.numel() > 0 and not kept.requires_grad


def test_one_step():
    _check(make_inputs(1, decay="product", dd_decay=(True, False)), torch.float64, "T=1")


@pytest.mark.parametrize(("e", "s"), [("vec", "dd"), ("dd", "vec")])
def test_time_shared_expand_and_shrink(e, s):
    """Data-independent e or s: read with a zero time stride; their gradients sum over the steps."""
    _check(make_inputs(33, e=e, s=s, decay="product", dd_decay=(True, False)), torch.float64, f"e={e} s={s}")


def test_rows_of_the_step_operand():
    """A product whose time-varying operand has K rows ([.., K, D], stored per row) and K, D no
    powers of two spanning several column blocks (K = 20 holds 8 columns a program)."""
    T, K, D = 23, 20, 19
    g = torch.Generator().manual_seed(3)
    inputs = {
        "i": torch.randn(1, T, 2, D, generator=g, dtype=torch.float64),
        "e": torch.randn(1, T, 2, K, generator=g, dtype=torch.float64) / K**0.5,
        "s": torch.randn(1, T, 2, K, generator=g, dtype=torch.float64),
        "log_o": LogProduct(
            torch.rand(1, T, 2, K, D, generator=g, dtype=torch.float64),
            -torch.rand(2, K, D, generator=g, dtype=torch.float64),
        ),
        "initial_state": torch.randn(1, 2, K, D, generator=g, dtype=torch.float64),
    }
    assert triton_scan.columns(K, D) == 8
    _check(inputs, torch.float32, "K=20 D=19")


def test_decays_of_any_strength():
    """log o down to about -400 a step: every decay an exp of a non-positive number (0 in float32
    below exp(-104)), no scan product overflows."""
    _check(make_inputs(40, decay="product", dd_decay=(True, False), strength=100.0), torch.float32, "strong")


@pytest.mark.parametrize(
    ("case", "steps", "dtype"),
    [("product", 16, torch.float64), ("full", 32, torch.float32), ("packed", 16, torch.float64)],
)
def test_segments(monkeypatch, case, steps, dtype):
    """Launches with too few programs split the sequence into segments (``segments``): each segment
    summarised as one pair, the memories (forward) and adjoints (backward) carried across them, each
    segment run from its own; here forced (at least 64 programs, segments of one or two blocks of 16
    steps, T 65 and 50), the same results as the reference."""
    monkeypatch.setattr(triton_scan, "MIN_PROGRAMS", 64)
    monkeypatch.setattr(triton_scan, "MIN_SEGMENT_STEPS", steps)
    assert triton_scan.segments(4, 65, torch.device(DEVICE)) == (-(-5 // (steps // 16)), steps)
    if case == "packed":
        b = packed._bounds("random")
        inputs = packed.make_inputs("product", n_docs=len(b) - 1, initial=True, seed=5)
        _check(inputs, dtype, "segments, packed", cu_seqlens=b)
    else:
        inputs = make_inputs(65, decay=case, dd_decay=(True, False) if case == "product" else True, initial=True)
        _check(inputs, dtype, f"segments of {steps} steps, {case}")


def test_segments_follow_the_programs(monkeypatch):
    """Enough programs: one segment, the whole sequence; fewer: segments of at least
    MIN_SEGMENT_STEPS, as many as bring the programs to the target; the CPU's target is one program."""
    cpu = torch.device("cpu")
    assert triton_scan.segments(1, 10_000, cpu) == (1, 10_000)
    monkeypatch.setattr(triton_scan, "MIN_PROGRAMS", 264)
    assert triton_scan.segments(300, 32768, cpu) == (1, 32768)
    assert triton_scan.segments(16, 16384, cpu) == (17, 63 * 16)  # 1024 blocks, 63 a segment
    assert triton_scan.segments(200, 16384, cpu) == (2, 776 * 16)  # two reach it
    assert triton_scan.segments(1, 1024, cpu) == (4, 256)  # not below 256 steps
    assert triton_scan.column_groups(16, 1536, 8) == 96  # Mamba's: two blocks of 8 columns a group
    assert triton_scan.column_groups(128, 128, 1) == 1  # K = D: one group
    assert triton_scan.column_groups(4, 40, 32) == 2  # every block its own


def test_column_groups(monkeypatch):
    """The backward's programs each take a group of column blocks in turn, adding each block's
    share of de and ds to the group's (``column_groups``): here 11 blocks of 2 columns in 3 groups
    (4, 4, 3 blocks), with segments too, against the reference."""
    monkeypatch.setattr(triton_scan, "BLOCK_VALUES_BACKWARD", 128)
    monkeypatch.setattr(triton_scan, "column_groups", lambda K, D, BD: 3)
    monkeypatch.setattr(triton_scan, "MIN_PROGRAMS", 16)
    monkeypatch.setattr(triton_scan, "MIN_SEGMENT_STEPS", 16)
    assert triton_scan.columns(4, 21, backward=True) == 2
    g = torch.Generator().manual_seed(8)
    T, D = 25, 21
    inputs = make_inputs(T, decay="product", dd_decay=(True, False), initial=True)
    inputs["i"] = torch.randn(2, T, 2, D, generator=g, dtype=torch.float64)
    a = torch.nn.functional.softplus(torch.randn(2, T, 2, 1, D, generator=g, dtype=torch.float64))
    inputs["log_o"] = LogProduct(a, -torch.rand(2, 4, D, generator=g, dtype=torch.float64))
    inputs["initial_state"] = torch.randn(2, 2, 4, D, generator=g, dtype=torch.float64)
    _check(inputs, torch.float64, "3 column groups")


def test_launches_run_on_the_inputs_device():
    """Triton launches on the current CUDA device: every launch of lcsm's kernels runs under
    ``on_device``, which makes the inputs' device current (cuda:1 here, a stand-in tensor: no GPU
    is needed to build the context) and does nothing off CUDA."""
    import contextlib
    from types import SimpleNamespace

    from lcsm.ops._inputs import on_device

    context = on_device(SimpleNamespace(device=torch.device("cuda", 1)))
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    assert isinstance(on_device(torch.zeros(1)), contextlib.nullcontext)


def test_forward_without_gradients(monkeypatch):
    """Under no_grad (or with no input requiring one) the forward keeps no memories for a backward
    (an empty tensor) and returns the same outputs and final states."""
    x = make_inputs(37, decay="product", dd_decay=(True, False), seed=2)
    args = [_to_device(x[n]).float() for n in ("i", "e", "s")]
    log_o = LogProduct(_to_device(x["log_o"].a).float(), _to_device(x["log_o"].b).float())
    m0 = _to_device(x["initial_state"]).float()
    kept = []
    scan = triton_scan.triton_scan
    monkeypatch.setattr(triton_scan, "triton_scan", lambda *a: kept.append(a[-1]) or scan(*a))
    with torch.no_grad():
        y, m = eos(*args, log_o, mode="triton", initial_state=m0, output_final_state=True)
    y_ref, m_ref = eos(*args, log_o, mode="triton", initial_state=m0.requires_grad_(), output_final_state=True)
    assert kept == [False, True]
    assert torch.equal(y, y_ref) and torch.equal(m, m_ref)
    assert scan(*(t.transpose(1, 2) for t in args), log_o.a[:, :, :, 0].transpose(1, 2).unsqueeze(3),
                log_o.b, None, None, False)[2].numel() == 0  # fmt: skip


@pytest.mark.parametrize(
    ("decay", "bounds", "initial", "dtype"),
    [
        ("product", "ones", True, torch.float64),
        ("full", "random", True, torch.float64),
        ("product", "random", False, torch.float32),
    ],
)
def test_packed_documents_against_each_alone(decay, bounds, initial, dtype):
    """cu_seqlens: documents of one token at the start, inside and at the end and blocks of 16
    steps across document starts; each document from its own initial state, its own final state
    and every gradient against each document run alone."""
    b = packed._bounds(bounds)
    inputs = packed.make_inputs(decay, n_docs=len(b) - 1, initial=initial, seed=4)
    plan = explain(inputs["i"], inputs["e"], inputs["s"], inputs["log_o"], mode="triton", cu_seqlens=torch.tensor(b))
    assert plan.kernel == "triton-scan" and "restarted from each document's own initial state" in plan.reason
    _check(inputs, dtype, f"packed {bounds}", cu_seqlens=b)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (dict(decay="product", dd_decay=True), "one operand is time-invariant"),
        (dict(decay="product", dd_decay=(True, False), e="mat"), "K x D e"),
        (dict(decay="product", dd_decay=(True, False), complex_decay=True), "complex inputs"),
        (dict(decay="product", dd_decay=(True, False), K=300), "K = 300: more than 256"),
    ],
)
def test_refuses_what_it_cannot_serve(case, expected):
    case = dict(case)
    K = case.pop("K", None)
    inputs = make_inputs(20, **case)
    if K is not None:
        inputs.update(e=inputs["e"][..., :1].expand(-1, -1, -1, K), s=inputs["s"][..., :1].expand(-1, -1, -1, K))
        inputs["log_o"] = LogProduct(inputs["log_o"].a, inputs["log_o"].b[:, :1].expand(-1, K, -1))
    args = [_to_device(inputs[n]) for n in ("i", "e", "s", "log_o")]
    with pytest.raises(ValueError, match="mode='triton' cannot serve these inputs") as err:
        explain(*args, mode="triton")
    assert expected in str(err.value)


def test_compiled_graphs_call_the_kernel(monkeypatch):
    """torch.compile(fullgraph=True, dynamic=True) of mode "triton" with Mamba's product: the traced
    graph runs the kernels through the custom ops ``lcsm::triton_scan`` and its backward (one launch
    each way), at two lengths without retracing, with the eager call's outputs, final state and every
    gradient bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    calls = []
    call = triton_scan._Call
    monkeypatch.setattr(triton_scan, "_Call", lambda *a, **k: calls.append(1) or call(*a, **k))

    def f(i, e, s, a, b, m0):
        return eos(i, e, s, LogProduct(a, b), mode="triton", initial_state=m0, output_final_state=True)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T in (21, 34):
        x = make_inputs(T, decay="product", dd_decay=(True, False), seed=T)
        operands = (x["i"], x["e"], x["s"], x["log_o"].a, x["log_o"].b, x["initial_state"])
        leaves = [v.to(DEVICE, torch.float32).requires_grad_() for v in operands]
        results = []
        for fn in (f, compiled):
            calls.clear()
            y, m = fn(*leaves)
            grads = torch.autograd.grad((y * 1.3).sum() + (m * 0.7).sum(), leaves)
            assert len(calls) == 2, (T, len(calls))
            results.append([y, m, *grads])
        for eager, traced in zip(*results, strict=True):
            assert torch.equal(eager, traced), T
    assert counter.frame_count == 1
