"""Chunkwise-parallel forms of the EOS operator (linear in T): the chunk mode's entry point.

Two kernels, chosen by the structure of the problem (``kernel_for``): ``matmul``
(``chunk_matmul``) for K-vector e and s with a decay that is none, scalar, row, column or
separable (with none, a scalar, a row or a column one, on real CPU tensors, its form in C:
``native_scan.native_chunk``);
``elementwise`` (``chunk_scan``) for everything else. ``eos_chunk`` maps the canonical problem's
tensors onto each kernel's arguments, here and nowhere else (``matmul_operands`` also serves the
Triton kernels, ``triton_chunk``, which take the matmul kernel's arguments).
"""

from __future__ import annotations

import torch

from ._inputs import EOSProblem
from .chunk_matmul import ChunkMatmulFunction, chunk_matmul
from .chunk_scan import ChunkElementwiseFunction, traced_elementwise
from .native_scan import native_chunk, native_chunk_unsupported

Tensor = torch.Tensor


def kernel_for(p: EOSProblem) -> str:
    """``matmul`` when e and s are K-vectors and the decay is none, scalar, row, column or
    separable ("outer"); ``elementwise`` otherwise (a separable decay then multiplied out a block of steps at a time, a
    product of operands block by block)."""
    if p.e_is_vector and p.s_is_vector and p.decay_kind not in ("full", "product"):
        return "matmul"
    return "elementwise"


def chunk_length(chunk_size: int, T: int) -> int:
    """The chunk length C the chunk mode runs with. A chunk longer than the sequence would only pad
    it (the C x C intra-chunk map makes the cost grow with C, not T): C = min(chunk_size, T).
    Traced by torch.compile, T is symbolic and C stays ``chunk_size``: min(chunk_size, T) would
    fix T in the graph, and the kernel's sizes derive from C as Python integers."""
    return chunk_size if torch.compiler.is_compiling() else max(1, min(chunk_size, T))


# ----------------------------------------------------------------------------- entry point


def matmul_operands(p: EOSProblem) -> tuple[Tensor, Tensor, Tensor, Tensor | None, str]:
    """Canonical problem -> (s, e, i, g, kind) for the matmul kernel: s and e [B, H, T, K], i
    [B, H, T, D], g in the layout of ``kind`` (``chunk_matmul._chunk_matmul_segment``). The unit
    dims go by squeeze, not indexing: squeeze's backward is a view, where the backward of
    x[..., 0] writes the gradient into a zero-filled tensor of the full shape (a fresh,
    page-faulted 64 MiB each at T 65536, H 4, K 64)."""
    B, H, T = p.B, p.H, p.T
    s = p.s.squeeze(-1).expand(B, H, T, p.K)
    e = p.e.squeeze(-1).expand(B, H, T, p.K)
    kind = p.decay_kind
    g = None
    if kind == "scalar":
        g = p.g.reshape(*p.g.shape[:3], 1).expand(B, H, T, 1)
    elif kind == "row":
        g = p.g.squeeze(-1).expand(B, H, T, p.K)
    elif kind == "col":
        g = p.g.squeeze(-2).expand(B, H, T, p.D)
    elif kind == "outer":
        row, col = p.g_outer
        g = torch.cat([row.squeeze(-1).expand(B, H, T, p.K), col.squeeze(-2).expand(B, H, T, p.D)], -1)
    return s, e, p.i, g, kind


def eos_chunk(p: EOSProblem, chunk_size: int, backward: str = "custom") -> tuple[Tensor, Tensor]:
    """Chunk mode: y [B, H, T, D] and m_T [B, H, K, D] for the canonical problem p, in chunks of
    ``chunk_size`` steps. ``backward``: "custom" (the kernels' memory-light Functions) or "autograd"
    (autograd through the matmul kernel's forward; kept for the benchmark's memory comparison)."""
    if backward not in ("custom", "autograd"):
        raise ValueError(f"backward: expected 'custom' or 'autograd', got {backward!r}")
    C = chunk_length(chunk_size, p.T)
    if kernel_for(p) == "matmul":
        s, e, i, g, kind = matmul_operands(p)
        if backward == "custom":
            if native_chunk_unsupported(p) is None:  # real, on the CPU, not separable: the C kernel
                g = None if g is None else g.to(i.dtype)  # the kernel raises -inf to LOG_ZERO itself
                return native_chunk(s, e, i, g, p.m0, C, kind)
            return ChunkMatmulFunction.apply(s, e, i, g, p.m0, kind, C)
        return chunk_matmul(s, e, i, g, kind, p.m0, C)
    if backward != "custom":
        raise ValueError(
            f"backward: the elementwise kernel (decay {p.decay_kind!r}, e {tuple(p.e.shape)}, "
            f"s {tuple(p.s.shape)}) has only the 'custom' backward, got {backward!r}; "
            "'autograd' is the matmul kernel's baseline"
        )
    if torch.compiler.is_compiling():
        # traced: a doubling form with autograd's backward (the step loop would fix T)
        return traced_elementwise(p.i, p.e, p.s, p.g_full, p.m0, C)
    if p.g_product is not None:
        return ChunkElementwiseFunction.apply(p.i, p.e, p.s, *p.g_product, p.m0, C, True)
    g_a, g_b = p.g_outer if p.g_outer is not None else (p.g, None)
    return ChunkElementwiseFunction.apply(p.i, p.e, p.s, g_a, g_b, p.m0, C, False)
