"""The Triton kernels of ``eos`` (mode "triton", ``lcsm/ops/triton_chunk.py``) against the PyTorch
chunk form and the recurrent reference: outputs, final states and every gradient under random
cotangents, odd T, chunks that do not divide T, all four decay layouts, with and without an
initial state.

On a CUDA device the compiled kernels run there; without one, on the CPU under Triton's
interpreter, which tests/conftest.py turns on before triton is imported (it cannot be turned on
later in a process: see there).
"""

import pytest
import torch
from torch.nn.functional import logsigmoid

from lcsm.ops import eos, explain
from lcsm.testing import assert_close, gradients

pytest.importorskip("triton")
from lcsm.ops import triton_chunk  # noqa: E402  (after the skip: it imports triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_chunk.INTERPRETED,
    reason="no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=0 set before the run)",
)
# One batch row and one head keep the interpreter's runs short (it runs every program's tl
# operations one by one in Python);
# test_batch_and_heads covers several of each.
B, H, K, D = 1, 1, 16, 16


def _dots_as_on_the_device() -> bool:
    """Whether tests/conftest.py made the interpreter's tl.dot compute as the device does."""
    from triton.runtime import interpreter

    return getattr(interpreter.InterpreterBuilder.create_dot, "emulates_device", False)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs(T, decay, initial, strength=None, seed=0, B=B, H=H, K=K, D=D):
    """float64 inputs; log_o = logsigmoid(x + 1), or uniform in [strength, 0] when given."""
    tail = {"none": None, "scalar": (1, 1), "row": (K, 1), "col": (1, D)}[decay]
    log_o = None
    if tail is not None:
        if strength is None:
            log_o = logsigmoid(_rand(B, T, H, *tail, seed=seed + 4) + 1.0)
        else:
            gen = torch.Generator().manual_seed(seed + 4)
            log_o = strength * torch.rand(B, T, H, *tail, generator=gen, dtype=torch.float64)
    return {
        "i": _rand(B, T, H, D, seed=seed + 1),
        "e": _rand(B, T, H, K, seed=seed + 2) / K**0.5,
        "s": _rand(B, T, H, K, seed=seed + 3),
        "log_o": log_o,
        "initial_state": _rand(B, H, K, D, seed=seed + 5) if initial else None,
    }


def _run(inputs, mode, dtype, chunk_size, cu_seqlens=None):
    """y, the final state and the gradient of every input under the shared random cotangents."""
    leaves = {n: x.to(DEVICE, dtype).requires_grad_() for n, x in inputs.items() if x is not None}
    y, final = eos(
        leaves["i"],
        leaves["e"],
        leaves["s"],
        leaves.get("log_o"),
        mode=mode,
        initial_state=leaves.get("initial_state"),
        output_final_state=True,
        chunk_size=chunk_size,
        cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE),
    )
    return gradients({"y": y, "final": final}, leaves)


def _check(inputs, chunk_size, context):
    got = _run(inputs, "triton", torch.float32, chunk_size)
    assert_close(got, _run(inputs, "chunk", torch.float32, chunk_size), torch.float32, f"{context} vs chunk")
    assert_close(got, _run(inputs, "recurrent", torch.float64, chunk_size), torch.float32, f"{context} vs recurrent")


@pytest.mark.parametrize("decay", ["none", "scalar", "row", "col"])
@pytest.mark.parametrize(("T", "chunk_size", "initial"), [(37, 16, True), (50, 32, False)])
def test_against_chunk_and_recurrent(decay, T, chunk_size, initial):
    _check(_inputs(T, decay, initial), chunk_size, f"triton {decay} T={T} C={chunk_size} initial={initial}")


@pytest.mark.parametrize("decay", ["row", "col"])
def test_strong_decays(decay):
    """log_o down to -30 per step: the pairwise diagonal and the references between sub-blocks
    keep every exp of a non-positive number (a factorisation through the chunk start would reach
    e^{30 * 16} and overflow)."""
    _check(_inputs(21, decay, True, strength=-30.0, seed=7), 16, f"triton strong {decay}")


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_batch_and_heads(decay):
    """B and H above 1: every program finds its own batch and head (the strides of each, the
    decay's included; the row and column decays address it the same way)."""
    _check(_inputs(19, decay, True, seed=3, B=2, H=3), 16, f"triton B=2 H=3 {decay}")


@pytest.mark.parametrize("decay", ["row", "col"])
def test_forward_without_gradients(decay):
    """Under no_grad the forward skips what only the decay gradient reads (a column decay then
    takes each step's own term inside the kernel, not added afterwards)."""
    x = {n: v.to(DEVICE, torch.float32) for n, v in _inputs(37, decay, True, seed=9).items()}
    args = (x["i"], x["e"], x["s"], x["log_o"])
    kwargs = {"initial_state": x["initial_state"], "output_final_state": True, "chunk_size": 16}
    with torch.no_grad():
        y, final = eos(*args, mode="triton", **kwargs)
    y_ref, final_ref = eos(*args, mode="chunk", **kwargs)
    assert_close({"y": y, "final": final}, {"y": y_ref, "final": final_ref}, torch.float32, f"no_grad {decay}")


@pytest.mark.parametrize(("K", "D", "decay"), [(80, 24, "row"), (20, 80, "col")])
def test_widths_across_blocks(K, D, decay):
    """K and D that are no powers of two and span several blocks (the states kernel's blocks of 64
    rows and 64 columns, the output kernel's of 64 columns, 32 for a float32 column decay, and its
    diagonal sub-block's of 32 key columns): the masks and block offsets."""
    _check(_inputs(21, decay, True, seed=11, K=K, D=D), 16, f"triton K={K} D={D} {decay}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """bfloat16 inputs take bfloat16 matmul operands (float32 accumulation), float16 ones float32
    operands: held to the input dtype's tolerance against the float32 chunk form on the same
    rounded values."""
    if dtype == torch.bfloat16 and DEVICE == "cpu" and not _dots_as_on_the_device():
        pytest.skip(
            "Triton's interpreter multiplies bfloat16 tl.dot operands wrongly (3.9: 1e10 off on a plain product) "
            "and tests/conftest.py could not make it compute as the device does"
        )
    inputs = {n: x.to(dtype).to(torch.float64) for n, x in _inputs(21, "row", True).items()}
    got = _run(inputs, "triton", dtype, 16)
    assert got["y"].dtype == dtype
    assert_close(got, _run(inputs, "chunk", torch.float32, 16), dtype, f"triton {dtype} row")


# Documents of 5, 16 (one whole chunk: the next document's first decay must not leak into its
# last step backwards), 1 and 18 tokens; chunks of 16.
BOUNDS = [0, 5, 21, 22, 40]


def _packed_inputs(decay, initial, seed):
    x = _inputs(BOUNDS[-1], decay, False, seed=seed, H=2)
    if initial:
        x["initial_state"] = _rand(len(BOUNDS) - 1, 2, K, D, seed=seed + 5)
    return x


@pytest.mark.parametrize(
    ("decay", "initial"), [("none", True), ("scalar", True), ("row", True), ("col", True), ("row", False)]
)
def test_packed_documents(decay, initial):
    """cu_seqlens: each document from its own initial state (or zeros), its own final state, and
    nothing across a boundary: against the packed chunk form and the recurrence run document by
    document in float64, y, the final states and every gradient."""
    inputs = _packed_inputs(decay, initial, seed=13)
    got = _run(inputs, "triton", torch.float32, 16, BOUNDS)
    context = f"triton packed {decay} initial={initial}"
    assert_close(got, _run(inputs, "chunk", torch.float32, 16, BOUNDS), torch.float32, f"{context} vs chunk")
    assert_close(got, _run(inputs, "recurrent", torch.float64, 16, BOUNDS), torch.float32, f"{context} vs recurrent")


def test_packed_layout():
    """Each document from a chunk boundary, zeros after it; the chunk tables name the documents
    each chunk opens and closes, and the reversed row's swap them."""
    layout = triton_chunk.ChunkLayout.of(BOUNDS, 16, torch.device("cpu"))
    assert layout.T_pad == 16 * (1 + 1 + 1 + 2)
    assert layout.pos.tolist()[:6] == [0, 1, 2, 3, 4, 16]
    assert layout.first.tolist() == [1, 2, 3, 4, 0] and layout.last.tolist() == [1, 2, 3, 0, 4]
    assert layout.limits.tolist() == [4, 31, 32, 65]
    back = layout.reversed()
    assert back.first.tolist() == [4, 0, 3, 2, 1] and back.last.tolist() == [0, 4, 3, 2, 1]
    x = torch.arange(1.0, 41.0).reshape(1, 1, 40, 1)
    assert torch.equal(layout.pack(layout.lay_out(x)), x)
    sums = layout.reverse_cumsum(x).flatten().tolist()
    assert sums[0] == sum(range(1, 6)) and sums[5] == sum(range(6, 22)) and sums[21] == 22.0 and sums[39] == 40.0


def test_explain_names_the_kernel():
    x = {n: v.to(DEVICE, torch.float32) for n, v in _inputs(40, "col", True).items()}
    plan = explain(x["i"], x["e"], x["s"], x["log_o"], mode="triton", chunk_size=32)
    assert plan.mode == "triton" and plan.kernel == "triton-col"
    assert "chunks of 32 steps" in str(plan)
    # auto takes the kernels on CUDA tensors only; on the CPU it keeps the PyTorch chunk form
    auto = explain(x["i"], x["e"], x["s"], x["log_o"])
    assert auto.mode == ("triton" if DEVICE == "cuda" else "chunk"), auto
    packed = explain(x["i"], x["e"], x["s"], x["log_o"], mode="triton", cu_seqlens=torch.tensor([0, 7, 40]))
    assert packed.kernel == "triton-col" and "each document laid out from a chunk boundary" in str(packed)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"log_o": "outer"}, "cannot serve these inputs: decay 'outer'"),
        ({"e": "matrix"}, "cannot serve these inputs: K x D e"),
        ({"width": 300}, "cannot serve these inputs: K = 300, D = 16: more than 256"),
        ({"dtype": torch.float64}, "compute dtype torch.float64"),
        ({"dtype": torch.complex64}, "complex inputs"),
        ({"device": "meta"}, "the tensors are on meta"),
        ({"dtype": torch.float64, "cu_seqlens": True}, "compute dtype torch.float64"),
    ],
)
def test_what_it_cannot_serve_is_a_value_error(change, message):
    T = 20
    dtype = change.get("dtype", torch.float32)
    x = {n: v.to(DEVICE, dtype) if v is not None else None for n, v in _inputs(T, "row", False).items()}
    if change.get("log_o") == "outer":
        x["log_o"] = (x["log_o"], x["log_o"].transpose(-1, -2)[..., :1, :].expand(B, T, H, 1, D))
    if "width" in change:
        wide = torch.ones(B, T, H, change["width"], device=DEVICE)
        x.update(e=wide, s=wide, log_o=None)
    if change.get("e") == "matrix":
        x["e"] = torch.ones(H, K, D, device=DEVICE)
    if "device" in change:
        x = {n: v.to(change["device"]) for n, v in x.items() if v is not None}
    kwargs = {"cu_seqlens": torch.tensor([0, 7, T])} if "cu_seqlens" in change else {}
    with pytest.raises(ValueError, match=f"mode='triton' {message}" if "cannot" in message else message):
        explain(x["i"], x["e"], x["s"], x.get("log_o"), mode="triton", **kwargs)
    with pytest.raises(ValueError, match=f"mode='triton' {message}" if "cannot" in message else message):
        eos(x["i"], x["e"], x["s"], x.get("log_o"), mode="triton", **kwargs)


@pytest.mark.parametrize("decay", ["none", "scalar", "row", "col"])
def test_compiled_graphs_call_the_kernels(monkeypatch, decay):
    """torch.compile(fullgraph=True, dynamic=True) of mode "triton": the traced graph launches the
    kernels through the custom op ``lcsm::triton_chunk`` (forward: one call; backward: the three
    problems of appendix 5.1), at two lengths past one 16-step chunk (chunk_size 16) without
    retracing, with the eager call's outputs, final state and every gradient bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    calls = []
    launch = triton_chunk._launch
    monkeypatch.setattr(triton_chunk, "_launch", lambda *a: calls.append(1) or launch(*a))

    def f(i, e, s, log_o, m0):
        return eos(i, e, s, log_o, mode="triton", initial_state=m0, output_final_state=True, chunk_size=16)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T in (21, 34):
        x = _inputs(T, decay, initial=True, seed=T)
        leaves = [v.to(DEVICE, torch.float32).requires_grad_() for v in x.values() if v is not None]
        args = leaves if decay != "none" else [*leaves[:3], None, leaves[3]]
        results = []
        for fn in (f, compiled):
            calls.clear()
            y, m = fn(*args)
            grads = torch.autograd.grad((y * 1.3).sum() + (m * 0.7).sum(), leaves)
            assert len(calls) == 4, (decay, T, len(calls))
            results.append([y, m, *grads])
        for eager, traced in zip(*results, strict=True):
            assert torch.equal(eager, traced), (decay, T)
    assert counter.frame_count == 1
