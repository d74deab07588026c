"""The Triton carry of the WY / UT chunk forms (mode "triton", ``lcsm/ops/triton_delta.py``) of
``eos_delta`` and ``eos_dplr`` against the PyTorch chunk form and the recurrent reference:
outputs, final states and every gradient under random cotangents, odd T, chunks that do not
divide T (and are no power of two), with and without a gate and an initial state, a = e shared
and not, a per-row decay and micro-steps, one span and several.

On a CUDA device the compiled kernels run there; without one, on the CPU under Triton's
interpreter, which tests/conftest.py turns on before triton is imported.
"""

import contextlib

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm.ops import eos_delta, eos_dplr, explain, explain_dplr
from lcsm.ops.delta import carry_for
from lcsm.testing import assert_close, gradients

pytest.importorskip("triton")
from lcsm.ops import triton_chunk, triton_delta  # noqa: E402  (after the skip: they import triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not triton_chunk.INTERPRETED,
    reason="no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=0 set before the run)",
)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _inputs(T, gate, initial, B=1, H=1, K=16, D=20, seed=0):
    """float64 DeltaNet-like inputs: unit keys b, a = e = beta k (beta in [0, 1]), a gate
    logsigmoid(x + 2) per step; a separate a (``a``) perturbs beta k."""
    k = normalize(_rand(B, T, H, K, seed=seed), dim=-1)
    beta = torch.rand(B, T, H, 1, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return {
        "i": _rand(B, T, H, D, seed=seed + 2),
        "e": beta * k,
        "s": _rand(B, T, H, K, seed=seed + 3),
        "a": beta * normalize(k + 0.3 * _rand(B, T, H, K, seed=seed + 4), dim=-1),
        "b": k,
        "log_o": logsigmoid(_rand(B, T, H, seed=seed + 5) + 2.0) if gate else None,
        "initial_state": _rand(B, H, K, D, seed=seed + 6) if initial else None,
    }


@contextlib.contextmanager
def _launches():
    """Counts the Triton carry's forward launches, so that a test of mode "triton" fails if its
    path never reached the kernel (equal results alone cannot tell)."""
    calls = []
    original = triton_delta.triton_delta_carry

    def counted(*args):
        calls.append(1)
        return original(*args)

    triton_delta.triton_delta_carry = counted
    try:
        yield calls
    finally:
        triton_delta.triton_delta_carry = original


def _run(inputs, mode, dtype, chunk_size, shared=False, op=eos_delta, cu_seqlens=None):
    """y, the final state and every input's gradient under the shared random cotangents, of
    ``op(i, e, s, a, b, log_o)`` (eos_delta, or eos_dplr with log_o as its log_alpha); ``shared``
    passes e itself as a (DeltaNet: the kernel's products formed once). Mode "triton" must launch
    the kernel."""
    with _launches() as calls:
        out = _call(inputs, mode, dtype, chunk_size, shared, op, cu_seqlens)
    assert (len(calls) > 0) == (mode == "triton"), f"mode {mode}: {len(calls)} Triton carry launches"
    return out


def _call(inputs, mode, dtype, chunk_size, shared, op, cu_seqlens):
    leaves = {
        n: x.to(DEVICE, dtype).requires_grad_()
        for n, x in inputs.items()
        if x is not None and not (shared and n == "a")
    }
    y, final = op(
        leaves["i"],
        leaves["e"],
        leaves["s"],
        leaves["e"] if shared else leaves["a"],
        leaves["b"],
        leaves.get("log_o"),
        mode=mode,
        initial_state=leaves.get("initial_state"),
        output_final_state=True,
        chunk_size=chunk_size,
        cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE),
    )
    return gradients({"y": y, "final": final}, leaves)


def _check(inputs, chunk_size, shared, context):
    got = _run(inputs, "triton", torch.float32, chunk_size, shared)
    assert_close(got, _run(inputs, "chunk", torch.float32, chunk_size, shared), torch.float32, f"{context} vs chunk")
    reference = _run(inputs, "recurrent", torch.float64, chunk_size, shared)
    assert_close(got, reference, torch.float32, f"{context} vs recurrent")


@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "gate"])
@pytest.mark.parametrize("shared", [True, False], ids=["a-is-e", "a-not-e"])
@pytest.mark.parametrize(("T", "chunk_size", "initial"), [(37, 16, True), (45, 20, False)])
def test_against_chunk_and_recurrent(gate, shared, T, chunk_size, initial):
    _check(_inputs(T, gate, initial), chunk_size, shared, f"T={T} C={chunk_size} gate={gate} shared={shared}")


def test_batch_heads_and_spans():
    """B 2, H 3, K = D = 32, and T = 150 at C = 16: ten chunks, so the routed kernel runs in spans of
    eight chunks under activation checkpointing, each span's carry one kernel launch (recomputed
    in the backward)."""
    _check(_inputs(150, True, True, B=2, H=3, K=32, D=32, seed=7), 16, True, "B2 H3 T150")


def _dplr(x, log_alpha, mode, chunk_size, dtype=torch.float32, cu_seqlens=None):
    """eos_dplr's y, final state and every gradient; x's i, e, a, b may carry micro-steps."""
    return _run({**x, "log_o": log_alpha}, mode, dtype, chunk_size, op=eos_dplr, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("structure", ["scalar", "row", "row-micro-steps"])
def test_eos_dplr_runs_the_carry(structure):
    """eos_dplr's three chunk structures with mode "triton": a scalar decay (routed to eos_delta's
    kernel), a per-row decay (KDA, RWKV-7; the WY form of dplr.py, its gamma one per memory row) and
    a per-row decay with two micro-steps a token (DeltaProduct), against mode "chunk" in float32
    and the recurrence in float64; explain names the kernel."""
    T, H, K = 29, 2, 16
    x = _inputs(T, False, True, H=H, K=K, seed=3)
    gen = torch.Generator().manual_seed(11)
    if structure == "scalar":
        log_alpha = logsigmoid(torch.randn(1, T, H, generator=gen, dtype=torch.float64) + 2.0)
    else:
        log_alpha = logsigmoid(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) + 2.0)
    if structure == "row-micro-steps":
        for name in ("i", "e", "a", "b"):
            second = _rand(*x[name].shape, seed=len(name) + 20)
            second = normalize(second, dim=-1) if name == "b" else 0.5 * second
            x[name] = torch.stack([x[name], second], 3)
    got = _dplr(x, log_alpha, "triton", 8)
    assert_close(got, _dplr(x, log_alpha, "chunk", 8), torch.float32, f"{structure} vs chunk")
    reference = _dplr(x, log_alpha, "recurrent", 8, torch.float64)
    assert_close(got, reference, torch.float32, f"{structure} vs recurrent")
    args = [x[n].to(DEVICE, torch.float32) for n in ("i", "e", "s", "a", "b")]
    plan = explain_dplr(*args, log_alpha.to(DEVICE, torch.float32), mode="triton", chunk_size=8)
    kernel = "delta-triton" if structure == "scalar" else "wy-triton"
    assert (plan.mode, plan.kernel) == ("triton", kernel), plan
    assert "Triton kernel (requested)" in plan.reason, plan


def test_recomputed_spans_of_the_wy_form():
    """T = 300 at C = 8 with a per-row decay: 38 chunks, three spans of the recomputing backward
    (``_DplrSpans``, 16 chunks a span), each span's carry one kernel launch."""
    x = _inputs(300, False, True, H=1, K=16, D=16, seed=5)
    log_alpha = logsigmoid(_rand(1, 300, 1, 16, seed=12) + 3.0)
    assert_close(_dplr(x, log_alpha, "triton", 8), _dplr(x, log_alpha, "chunk", 8), torch.float32, "spans")


@pytest.mark.parametrize(
    ("structure", "lengths", "chunk_size"),
    [
        # documents starting and ending inside chunks (eos_delta's segment masks), one of 1 token
        ("scalar", [5, 16, 1, 18, 9], 8),
        # chunk-aligned documents (the WY form): a reset at a span's first chunk (doc 1 at chunk 16),
        # two in consecutive chunks (docs 2 and 3 at chunks 24, 25; doc 2 ends where it starts)
        ("row", [64, 30, 3, 50], 4),
    ],
)
def test_packed_documents(structure, lengths, chunk_size):
    """cu_seqlens through both chunk forms with mode "triton": each document's memory from its own
    initial state, its final state read at its last token; against mode "chunk" (float32) and each
    document alone through the recurrence (float64), every gradient included."""
    T, H, K = sum(lengths), 2, 16
    N = len(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = _inputs(T, False, False, H=H, K=K, seed=8)
    x["initial_state"] = _rand(N, H, K, 20, seed=9)
    tail = () if structure == "scalar" else (K,)
    log_alpha = logsigmoid(_rand(1, T, H, *tail, seed=10) + 2.0)
    got = _dplr(x, log_alpha, "triton", chunk_size, cu_seqlens=cu)
    assert_close(got, _dplr(x, log_alpha, "chunk", chunk_size, cu_seqlens=cu), torch.float32, "packed vs chunk")
    reference = _dplr(x, log_alpha, "recurrent", chunk_size, torch.float64, cu_seqlens=cu)
    assert_close(got, reference, torch.float32, "packed vs recurrent")
    args = [x[n].to(DEVICE, torch.float32) for n in ("i", "e", "s", "a", "b")]
    cu_t = torch.tensor(cu, device=DEVICE)
    plan = explain_dplr(
        *args, log_alpha.to(DEVICE, torch.float32), mode="triton", chunk_size=chunk_size, cu_seqlens=cu_t
    )
    assert plan.kernel == ("delta-triton" if structure == "scalar" else "wy-triton"), plan


def test_packed_documents_through_eos_delta():
    """eos_delta's own packed path (a gate, a = e shared, per-document initial states)."""
    cu = [0, 7, 8, 30, 41]
    x = _inputs(41, True, False, H=2, seed=13)
    x["initial_state"] = _rand(4, 2, 16, 20, seed=14)
    got = _run(x, "triton", torch.float32, 8, shared=True, cu_seqlens=cu)
    assert_close(got, _run(x, "chunk", torch.float32, 8, shared=True, cu_seqlens=cu), torch.float32, "vs chunk")
    reference = _run(x, "recurrent", torch.float64, 8, shared=True, cu_seqlens=cu)
    assert_close(got, reference, torch.float32, "vs recurrent")


def test_auto_carries_in_triton_on_cuda_only():
    x = {n: t.to(DEVICE, torch.float32) for n, t in _inputs(40, True, False).items() if t is not None}
    plan = explain_dplr(x["i"], x["e"], x["s"], x["e"], x["b"], x["log_o"], gate_first=True)
    if DEVICE == "cuda":
        assert plan.kernel == "delta-triton" and "CUDA tensors and triton installed" in plan.reason, plan
    else:
        assert plan.kernel == "delta" and "a loop over chunks" in plan.reason, plan


def test_what_the_carry_cannot_serve_names_the_mode():
    x = {n: t.to(DEVICE, torch.float32) for n, t in _inputs(12, True, False).items() if t is not None}
    args = [x[n] for n in ("i", "e", "s", "a", "b")]
    with pytest.raises(ValueError, match=r"mode='triton' cannot serve these inputs: compute dtype torch.float64"):
        eos_delta(*[t.double() for t in args], x["log_o"].double(), mode="triton")
    with pytest.raises(ValueError, match=r"mode='triton' cannot serve these inputs: K = 129: more than 128"):
        wide = [torch.zeros(1, 12, 1, 129, device=DEVICE) for _ in range(4)]
        eos_delta(args[0], *wide, mode="triton")


@pytest.mark.parametrize("name", ["fwp", "comba", "rwkv7", "gated_deltaproduct"])
def test_layers_with_a_mode_option_run_the_carry(name):
    """A layer built with mode "triton" (DeltaNet's fwp and Comba: a scalar or no decay; RWKV-7: a
    per-row decay; Gated DeltaProduct: micro-steps) equals the same weights with mode "chunk":
    output and every parameter's gradient; 70 tokens, several chunks at each layer's chunk size."""
    from lcsm import layers

    torch.manual_seed(0)
    x = torch.randn(2, 70, 32, device=DEVICE)
    options = {"chunk_size": 8} if name == "fwp" else {}
    results = []
    for mode in ("triton", "chunk"):
        torch.manual_seed(1)
        layer = layers.build(name, 32, mode=mode, **options).to(DEVICE)
        leaves = {"x": x.clone().requires_grad_(), **dict(layer.named_parameters())}
        with _launches() as calls:
            results.append(gradients({"y": layer(leaves["x"])}, leaves))
        assert (len(calls) > 0) == (mode == "triton"), f"{name} mode {mode}: {len(calls)} launches"
    assert_close(results[0], results[1], torch.float32, f"{name} triton vs chunk")


def test_what_torch_compile_traces(monkeypatch):
    """Tracing, the delta-rule carry and eos's kernels serve (a traced graph calls them as custom
    ops: the compiled tests here and in test_triton_chunk.py), but not packed documents."""
    x = {n: t.to(DEVICE, torch.float32) for n, t in _inputs(12, True, False).items() if t is not None}
    args = [x[n] for n in ("i", "e", "s", "a", "b")]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert carry_for("triton", args[0], 16)[0] == "triton"
    with pytest.raises(ValueError, match=r"mode='triton' cannot serve these inputs: traced by torch.compile"):
        carry_for("triton", args[0], 16, packed=True)
    assert carry_for("auto", args[0], 16, packed=True)[0] == "torch"
    assert explain(args[0], args[1], args[2], None, mode="triton").mode == "triton"
    cu = torch.tensor([0, 5, 12], device=DEVICE)
    with pytest.raises(ValueError, match=r"traced by torch.compile .*\(packed documents\)"):
        explain(args[0], args[1], args[2], None, mode="triton", cu_seqlens=cu)


@pytest.mark.parametrize("op", ["eos_delta", "eos_dplr"])
def test_compiled_graphs_launch_the_carry(monkeypatch, op):
    """torch.compile(fullgraph=True, dynamic=True) of mode "triton" with a gate (eos_dplr: a
    per-row decay, KDA's structure, on its own WY / UT form): the traced graph carries the memory by
    the kernels' custom ops (one forward and one backward launch a call) instead of the doubling
    scan, at two lengths past one chunk through one graph, and equals eager (whose chunks stop at T
    where the traced ones pad a chunk more: equal up to float32 rounding)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    launches = []
    for name in ("_carry_forward", "_carry_backward"):
        original = getattr(triton_delta, name)
        monkeypatch.setattr(triton_delta, name, lambda *a, f=original: launches.append(1) or f(*a))

    def f(i, e, s, a, b, g, m0):
        if op == "eos_delta":
            return eos_delta(i, e, s, a, b, g, mode="triton", initial_state=m0, output_final_state=True, chunk_size=16)
        return eos_dplr(i, e, s, a, b, g, mode="triton", initial_state=m0, output_final_state=True, chunk_size=16)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T in (37, 50):
        x = _inputs(T, True, True, seed=T)
        if op == "eos_dplr":  # a per-row decay on the memory's K rows
            x["log_o"] = logsigmoid(_rand(1, T, 1, 16, seed=T + 9) + 2.0)
        leaves = {n: t.to(DEVICE, torch.float32).requires_grad_() for n, t in x.items()}
        results = []
        for fn in (f, compiled):
            launches.clear()
            y, m = fn(*leaves.values())
            results.append(gradients({"y": y, "m_T": m}, leaves))
            # eager eos_dplr recomputes its forward in the backward (its spans): one launch more
            want = 3 if fn is f and op == "eos_dplr" else 2
            assert len(launches) == want, (op, T, fn is f, len(launches))
        assert_close(results[1], results[0], torch.float32, f"{op} T={T} compiled vs eager")
    assert counter.frame_count == 1
