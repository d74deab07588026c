"""The chunk form without a decay in C (``lcsm.ops.native_scan.native_chunk``, source
lcsm/ops/_native/chunk.h) against its twin, the PyTorch matmul kernel (``ChunkMatmulFunction``
with kind "none"), and the recurrence written out, in float64: the output, the final state and the
gradients of s, e, x and the initial state under random cotangents, in float64 and float32, at
lengths the chunks do not divide, widths that are not whole vectors, with and without an initial
state and a final-state cotangent, on the caller's [B, T, H, *] layout, a contiguous one and
broadcast operands; eos's dispatch to it; its refusals."""

import pytest
import torch

from lcsm.ops import eos, explain
from lcsm.ops import native_scan as native
from lcsm.ops.chunk_matmul import ChunkMatmulFunction
from lcsm.testing import assert_close, gradients


def recurrence(s, e, x, m0):
    """m_t = m_{t-1} + e_t x_t^T, y_t = m_t^T s_t, step by step: s, e [B, H, T, K], x [B, H, T, D]."""
    B, H, T, K = s.shape
    m = m0 if m0 is not None else s.new_zeros(B, H, K, x.shape[-1])
    ys = []
    for t in range(T):
        m = m + e[:, :, t, :, None] * x[:, :, t, None, :]
        ys.append((s[:, :, t, :, None] * m).sum(-2))
    return torch.stack(ys, 2), m


def twin(s, e, x, m0, chunk):
    return ChunkMatmulFunction.apply(s, e, x, None, m0, "none", chunk)


def run(form, leaves: dict, chunk: int, final_cotangent: bool, layout: str):
    """(y, m_T) of ``form`` and the gradients of every leaf; s, e, x given head-major [B, H, T, *]
    as views of [B, T, H, *] tensors ("caller"), as contiguous [B, H, T, *] ("contiguous") or e
    broadcast over time and the batch ("broadcast")."""
    leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    s, e, x = (leaves[n] for n in "sex")
    if layout == "caller":
        s, e, x = (t.transpose(1, 2) for t in (s, e, x))
    elif layout == "broadcast":
        e = e.expand(s.shape)
    args = (s, e, x, leaves.get("m0"))
    y, m_T = recurrence(*args) if form is recurrence else form(*args, chunk)
    outputs = {"y": y, "m_T": m_T} if final_cotangent else {"y": y}
    return gradients(outputs, leaves)


def make(B, T, H, K, D, layout, initial, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda X: (B, T, H, X)) if layout == "caller" else (lambda X: (B, H, T, X))
    leaves = {"s": torch.randn(*shape(K), generator=g, dtype=torch.float64)}
    leaves["e"] = torch.randn(*(shape(K) if layout != "broadcast" else (1, H, 1, K)), generator=g, dtype=torch.float64)
    leaves["x"] = torch.randn(*shape(D), generator=g, dtype=torch.float64)
    if initial:
        leaves["m0"] = torch.randn(B, H, K, D, generator=g, dtype=torch.float64)
    return leaves


def skip_without_kernel():
    if native.native_unavailable() is not None:
        pytest.skip(native.native_unavailable())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "B,T,H,K,D,chunk",
    [(2, 37, 3, 5, 7, 8), (1, 130, 2, 64, 64, 64), (1, 200, 2, 16, 24, 48), (2, 1, 1, 3, 2, 4), (1, 70, 1, 33, 9, 16)],
)
@pytest.mark.parametrize("layout", ["caller", "contiguous", "broadcast"])
@pytest.mark.parametrize("initial,final_cotangent", [(True, True), (False, False), (True, False)])
def test_native_chunk_equals_its_twin_and_the_recurrence(B, T, H, K, D, chunk, layout, initial, final_cotangent, dtype):
    skip_without_kernel()
    leaves = make(B, T, H, K, D, layout, initial, seed=T + K)
    exact = run(recurrence, leaves, chunk, final_cotangent, layout)
    context = f"B{B} T{T} H{H} K{K} D{D} chunk {chunk} {layout} initial {initial} dM {final_cotangent} {dtype}"
    assert_close(run(twin, leaves, chunk, final_cotangent, layout), exact, dtype=torch.float64, context=context)
    low = {k: v.to(dtype) for k, v in leaves.items()}
    assert_close(run(native.native_chunk, low, chunk, final_cotangent, layout), exact, dtype=dtype, context=context)


def test_native_chunk_gradcheck():
    skip_without_kernel()
    leaves = make(1, 11, 2, 3, 4, "caller", True, seed=3)
    args = tuple(v.requires_grad_() for v in leaves.values())

    def fn(s, e, x, m0):
        return native.native_chunk(s.transpose(1, 2), e.transpose(1, 2), x.transpose(1, 2), m0, 4)

    assert torch.autograd.gradcheck(fn, args)


def test_eos_takes_the_native_chunk_kernel_without_a_decay(monkeypatch):
    """mode chunk (and auto) without a decay on real CPU tensors run native_chunk, and explain says
    so; with a decay, complex or traced they do not."""
    skip_without_kernel()
    calls = []
    kernel = native.native_chunk
    monkeypatch.setattr("lcsm.ops.chunk.native_chunk", lambda *a: calls.append(1) or kernel(*a))
    x = torch.randn(1, 50, 2, 8, dtype=torch.float64)
    y, _ = eos(x, x, x, mode="chunk", chunk_size=16)
    assert len(calls) == 1
    want, _ = eos(x, x, x, mode="recurrent")
    assert_close({"y": y}, {"y": want}, dtype=torch.float64)
    assert "in C (native_chunk" in explain(x, x, x).reason
    decay = -torch.rand(1, 50, 2, 1, 1, dtype=torch.float64)
    assert "native_chunk" not in explain(x, x, x, decay, mode="chunk").reason
    eos(x, x, x, decay, mode="chunk")
    assert len(calls) == 1
    z = x.to(torch.complex128)
    assert "not the native chunk kernel: compute dtype torch.complex128" in explain(z, z, z, mode="chunk").reason


def test_native_chunk_refuses_what_it_cannot_take():
    skip_without_kernel()
    s = torch.zeros(1, 2, 5, 3)
    with pytest.raises(
        ValueError, match=r"native_chunk: expected s and e \[B, H, T, K\].*got \[1, 2, 5, 3\], \[1, 2, 4, 3\]"
    ):
        native.native_chunk(s, torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 5, 4), None, 4)
    with pytest.raises(ValueError, match=r"m0 \[B, H, K, D\].*\[1, 2, 4, 3\]"):
        native.native_chunk(s, s, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 4, 3), 4)
    with pytest.raises(ValueError, match="one dtype and chunk >= 1, got torch.float32, torch.float64"):
        native.native_chunk(s, s.double(), torch.zeros(1, 2, 5, 4), None, 4)
    with pytest.raises(ValueError, match="float32 or float64 CPU tensors, got torch.float16"):
        native.native_chunk(s.half(), s.half(), torch.zeros(1, 2, 5, 4).half(), None, 4)
