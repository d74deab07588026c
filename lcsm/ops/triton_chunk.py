"""Triton kernels for the chunk mode's workhorse form: K-vector e and s with no decay, a scalar
decay, a row decay (varies over K) or a column decay (varies over D); real inputs, float32
compute (inputs float32, bfloat16 or float16).

Imported only when a Triton plan runs (``eos`` with mode "triton", or "auto" on CUDA tensors):
the package imports without triton. Under ``TRITON_INTERPRET=1`` set before this module is
imported, the kernels are decorated as Triton's interpreter functions and run on CPU tensors
(the tests do this); ``INTERPRETED`` records which.

Forward, for chunks of BT steps (16, 32 or 64) and cumulative logs G taken from each chunk start:

    states kernel   one program per (batch * head, block of K rows, block of D columns) walks
                    the chunks in order, writes the memory S_n at each chunk start and carries
                    S_{n+1} = exp(G_last) * S_n + (e * exp(G_last - G))^T (i * exp(G_last - G)),
                    each exp on the side its decay acts on (K for row and scalar, D for column)
    output kernel   one program per (batch * head, sub-block of BC = 16 steps, block of D
                    columns): y = (s * exp(G)) S_n (the carried memory), plus the sub-blocks of
                    the same chunk before it, plus its own diagonal block
    strict kernel   (for the decay gradient) o_T * m_{T-1}: the last chunk's update of its stored
                    S_n without the last step, one program per (sequence or document * head, K
                    block, D block)

Every factor is an exp of a non-positive number, so decays down to log o = -30 per step (and
beyond: log o is raised to ``LOG_ZERO`` as everywhere in the chunk forms) stay finite. The
earlier sub-blocks factorise through the log just before the query sub-block (query factors
exp(G_t - r) <= 1, key factors exp(r - G_j) <= 1); the diagonal sub-block of a row or column decay
cannot factorise safely (its 16 steps may span a log of 30 * 16 = 480, far past float32's e^88 on
the side that grows), so every pair (t, j) of it takes its own exp(G_t - G_j), formed for t >= j
only: all pairs at once, [16, 16, 32] factors for each block of 32 keys' columns of a row decay
(summed over them into the 16 x 16 map of the pairs, which a matmul then applies), [16, 16, BD] for
a column decay (applied to the inputs' columns directly).

Matmuls take bfloat16 operands for bfloat16 inputs (tensor cores; the accumulation is float32, the
carried memory kept in float32 and rounded only as an operand), float32 operands otherwise, each
product as three TF32 tensor-core products (``input_precision="tf32x3"``: high * high + high * low
+ low * high, float32's accuracy, docs/eos.md; ``ieee`` products run on the CUDA cores and spilled
registers).

Packed documents (``cu_seqlens``): ``ChunkLayout`` lays each document out from a chunk boundary,
zeros after it to its last chunk's end, so that no chunk holds two documents; only the states
kernel reads the boundaries (it restarts the memory at a document's first chunk and writes its
final state after its last), and the strict kernel each document's last step.

Backward: the same decomposition as ``chunk_matmul.ChunkMatmulFunction`` (LCSM appendix 5.1, see
docs/eos.md), each of its three EOS problems run by the forward kernels: ds is the forward problem
transposed (row and column decays swap), di and de one reverse-time problem and its transpose; the
decay gradient is the reverse cumulative sum of the same strict (own-step-free) terms, with the
boundary term from o_T * m_{T-1}, which the strict kernel computes directly.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import triton
import triton.language as tl

from ._autograd import first_order
from ._inputs import EOSProblem, finite_log, on_device
from .chunk import matmul_operands

Tensor = torch.Tensor

KINDS = {"none": 0, "scalar": 1, "row": 2, "col": 3}
TRANSPOSED = {"none": "none", "scalar": "scalar", "row": "col", "col": "row"}
CHUNKS = (16, 32, 64)
SUB = 16  # the output kernel's sub-block: tl.dot's least size
MAX_WIDTH = 256  # the output kernel holds a [K, BD] memory block in registers (the backward: [D, BD])
BLOCK_K = 64  # the states kernel's block of memory rows
BLOCK_D = 64
# Launch shapes from ptxas's register reports for sm_90 (K = D = 128, BT = 64, the arguments
# specialised as a launch does), not from timings (bench/triton_registers.py,
# bench/results/triton_registers.md): with 8 warps, one pipeline stage for the output kernel and
# two for the states and strict kernels, no variant spills but the float32 output kernel without a
# decay or with a column decay (48 / 8 bytes with triton 3.9); with 4 warps the float32 row-decay
# output kernel spills 900 bytes. ``lcsm bench gpu --shapes`` times the alternatives.
WARPS_STATES = 8  # the states and strict kernels'
STAGES_STATES = 2
WARPS_OUTPUT = 8
STAGES_OUTPUT = 1
DIAGONAL_K = 32  # the output kernel's block of key columns in a row decay's diagonal sub-block
BLOCK_D_COL_FLOAT32 = 32  # the output kernel's block of D columns for a float32 column decay


@triton.jit
def _dot(a, b, BF16: tl.constexpr):
    """a @ b with float32 accumulation, of bfloat16 operands or of full float32 ones."""
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)) if BF16 else tl.dot(a, b, input_precision="tf32x3")


# Whether triton decorated the kernels for its interpreter (TRITON_INTERPRET=1 at import), read
# from the decorated function itself: the variable's own reading has moved between triton versions.
INTERPRETED = not isinstance(_dot, triton.runtime.JITFunction)


@triton.jit
def _chunk_update(
    S,
    e_base,
    i_base,
    g_base,
    t0,
    limit,
    K,
    D,
    se_t,
    se_k,
    si_t,
    si_d,
    sg_t,
    sg_x,
    offs_k,
    offs_d,
    DECAY: tl.constexpr,
    BT: tl.constexpr,
    BF16: tl.constexpr,
):
    """The memory after the chunk starting at t0, from the memory S before it, taking only the
    inputs of steps t < limit (limit T: all; T - 1: all but the sequence's last step)."""
    # in int64: a time times a stride passes 2^31 past ~1M steps at H * K = 2048 (the inputs' time
    # stride), ~16M at K = 128 (the logs')
    t0 = tl.cast(t0, tl.int64)
    offs_t = t0 + tl.arange(0, BT)
    mt = offs_t < limit
    mk = offs_k < K
    md = offs_d < D
    e = tl.load(e_base + offs_t[:, None] * se_t + offs_k[None, :] * se_k, mask=mt[:, None] & mk[None, :], other=0.0)
    x = tl.load(i_base + offs_t[:, None] * si_t + offs_d[None, :] * si_d, mask=mt[:, None] & md[None, :], other=0.0)
    e = e.to(tl.float32)
    x = x.to(tl.float32)
    last = t0 + BT - 1  # G is padded to whole chunks with log 0: its last row is the chunk's total
    if DECAY == 1:
        g = tl.load(g_base + offs_t * sg_t)
        g_last = tl.load(g_base + last * sg_t)
        e = e * tl.exp(g_last - g)[:, None]
        S = S * tl.exp(g_last)
    elif DECAY == 2:
        g = tl.load(g_base + offs_t[:, None] * sg_t + offs_k[None, :] * sg_x, mask=mk[None, :], other=0.0)
        g_last = tl.load(g_base + last * sg_t + offs_k * sg_x, mask=mk, other=0.0)
        e = e * tl.exp(g_last[None, :] - g)
        S = S * tl.exp(g_last)[:, None]
    elif DECAY == 3:
        g = tl.load(g_base + offs_t[:, None] * sg_t + offs_d[None, :] * sg_x, mask=md[None, :], other=0.0)
        g_last = tl.load(g_base + last * sg_t + offs_d * sg_x, mask=md, other=0.0)
        x = x * tl.exp(g_last[None, :] - g)
        S = S * tl.exp(g_last)[None, :]
    return S + _dot(tl.trans(e), x, BF16)


@triton.jit
def _memory_block(pid_k, pid_d, K, D, BK: tl.constexpr, BD: tl.constexpr):
    """A program's block of memory rows offs_k and columns offs_d, with its offsets kd and mask mkd
    in a contiguous [.., K, D] memory (m0, the states, the final memories)."""
    offs_k = pid_k * BK + tl.arange(0, BK)
    offs_d = pid_d * BD + tl.arange(0, BD)
    return offs_k, offs_d, offs_k[:, None] * D + offs_d[None, :], (offs_k < K)[:, None] & (offs_d < D)[None, :]


@triton.jit
def _states_kernel(
    e_ptr,
    i_ptr,
    g_ptr,
    m0_ptr,
    states_ptr,
    final_ptr,
    first_ptr,
    last_ptr,
    T,
    H,
    K,
    D,
    N,
    se_b,
    se_h,
    se_t,
    se_k,
    si_b,
    si_h,
    si_t,
    si_d,
    sg_b,
    sg_h,
    sg_t,
    sg_x,
    DECAY: tl.constexpr,
    HAS_M0: tl.constexpr,
    PACKED: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    BF16: tl.constexpr,
):
    pid_d = tl.program_id(0)
    pid_k = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)  # offsets of large tensors pass 2^31
    b = bh // H
    h = bh % H
    # rows of the memory evolve independently (each decays on its own and takes e_t[k] i_t^T), so
    # blocks of K rows are programs of their own
    offs_k, offs_d, kd, mkd = _memory_block(pid_k, pid_d, K, D, BK, BD)
    e_base = e_ptr + b * se_b + h * se_h
    i_base = i_ptr + b * si_b + h * si_h
    g_base = g_ptr + b * sg_b + h * sg_h
    if HAS_M0 and not PACKED:
        S = tl.load(m0_ptr + bh * K * D + kd, mask=mkd, other=0.0).to(tl.float32)
    else:
        S = tl.zeros([BK, BD], dtype=tl.float32)
    for n in range(0, N):
        if PACKED:
            # chunk n opens document first - 1 (first > 0): the memory restarts from its own m0
            first = tl.load(first_ptr + n)
            # the flag as a [BK, BD] block: masks of a scalar flag are refused by the interpreter
            opens = (first + tl.zeros([BK, BD], dtype=tl.int32)) > 0
            doc = (first - 1).to(tl.int64)
            if HAS_M0:
                m0 = tl.load(m0_ptr + (doc * H + h) * K * D + kd, mask=mkd & opens, other=0.0).to(tl.float32)
                S = tl.where(opens, m0, S)
            else:
                S = tl.where(opens, 0.0, S)
        tl.store(states_ptr + (bh * N + n) * K * D + kd, S, mask=mkd)
        S = _chunk_update(
            S,
            e_base,
            i_base,
            g_base,
            n * BT,
            T,
            K,
            D,
            se_t,
            se_k,
            si_t,
            si_d,
            sg_t,
            sg_x,
            offs_k,
            offs_d,
            DECAY,
            BT,
            BF16,
        )
        if PACKED:
            last = tl.load(last_ptr + n)
            closes = (last + tl.zeros([BK, BD], dtype=tl.int32)) > 0
            tl.store(final_ptr + ((last - 1).to(tl.int64) * H + h) * K * D + kd, S, mask=mkd & closes)
    if not PACKED:
        tl.store(final_ptr + bh * K * D + kd, S, mask=mkd)


@triton.jit
def _strict_final_kernel(
    e_ptr,
    i_ptr,
    g_ptr,
    states_ptr,
    strict_ptr,
    limits_ptr,
    T,
    H,
    K,
    D,
    N,
    se_b,
    se_h,
    se_t,
    se_k,
    si_b,
    si_h,
    si_t,
    si_d,
    sg_b,
    sg_h,
    sg_t,
    sg_x,
    DECAY: tl.constexpr,
    PACKED: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    BF16: tl.constexpr,
):
    """o_T * m_{T-1} of each sequence (each document when PACKED): the chunk holding its last step
    applied to the stored memory entering it, without that step (limits: the last step's place in
    the row). Apart from the states kernel, whose loop it would otherwise burden with a second
    update (ptxas then spills: bench/results/triton_registers.md)."""
    pid_d = tl.program_id(0)
    pid_k = tl.program_id(1)
    rh = tl.program_id(2).to(tl.int64)
    row = rh // H
    h = rh % H
    b = 0 if PACKED else row  # documents are laid out in one row
    limit = tl.load(limits_ptr + row).to(tl.int64)
    n = limit // BT
    offs_k, offs_d, kd, mkd = _memory_block(pid_k, pid_d, K, D, BK, BD)
    S = tl.load(states_ptr + ((b * H + h) * N + n) * K * D + kd, mask=mkd, other=0.0)
    S = _chunk_update(
        S,
        e_ptr + b * se_b + h * se_h,
        i_ptr + b * si_b + h * si_h,
        g_ptr + b * sg_b + h * sg_h,
        n * BT,
        limit,
        K,
        D,
        se_t,
        se_k,
        si_t,
        si_d,
        sg_t,
        sg_x,
        offs_k,
        offs_d,
        DECAY,
        BT,
        BF16,
    )
    tl.store(strict_ptr + rh * K * D + kd, S, mask=mkd)


@triton.jit
def _output_kernel(
    s_ptr,
    e_ptr,
    i_ptr,
    g_ptr,
    states_ptr,
    y_ptr,
    T,
    H,
    K,
    D,
    N,
    ss_b,
    ss_h,
    ss_t,
    ss_k,
    se_b,
    se_h,
    se_t,
    se_k,
    si_b,
    si_h,
    si_t,
    si_d,
    sg_b,
    sg_h,
    sg_t,
    sg_x,
    DECAY: tl.constexpr,
    STRICT: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BD: tl.constexpr,
    BF16: tl.constexpr,
    BKD: tl.constexpr,
):
    pid_c = tl.program_id(0)  # the chunk axis: the only one that grows with T, and axis 0 has no 65535 limit
    pid_d = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)  # offsets of large tensors pass 2^31
    b = bh // H
    h = bh % H
    n = pid_c // (BT // BC)
    sub = pid_c % (BT // BC)
    t0 = tl.cast(n * BT + sub * BC, tl.int64)  # times strides: int64 (_chunk_update)
    offs_t = t0 + tl.arange(0, BC)
    offs_k = tl.arange(0, BK)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mt = offs_t < T
    mk = offs_k < K
    md = offs_d < D
    s_base = s_ptr + b * ss_b + h * ss_h
    e_base = e_ptr + b * se_b + h * se_h
    i_base = i_ptr + b * si_b + h * si_h
    g_base = g_ptr + b * sg_b + h * sg_h
    s = tl.load(s_base + offs_t[:, None] * ss_t + offs_k[None, :] * ss_k, mask=mt[:, None] & mk[None, :], other=0.0)
    s = s.to(tl.float32)
    kd = offs_k[:, None] * D + offs_d[None, :]
    S = tl.load(states_ptr + (bh * N + n) * K * D + kd, mask=mk[:, None] & md[None, :], other=0.0)
    # the log just before the sub-block: the reference its earlier sub-blocks factorise through
    # (0 for the chunk's first sub-block, which has none)
    r_at = tl.maximum(t0 - 1, 0)
    has_prev = sub > 0
    rows = tl.arange(0, BC)

    # the carried memory's share, and the chunk's earlier sub-blocks
    acc = tl.zeros([BC, BD], dtype=tl.float32)
    if DECAY == 0:
        y = _dot(s, S, BF16)
    elif DECAY == 1:
        gq = tl.load(g_base + offs_t * sg_t)
        y = _dot(s, S, BF16) * tl.exp(gq)[:, None]
    elif DECAY == 2:
        gq = tl.load(g_base + offs_t[:, None] * sg_t + offs_k[None, :] * sg_x, mask=mk[None, :], other=0.0)
        y = _dot(s * tl.exp(gq), S, BF16)
        r = tl.where(has_prev, tl.load(g_base + r_at * sg_t + offs_k * sg_x, mask=mk, other=0.0), 0.0)
        s_ref = s * tl.exp(gq - r[None, :])
    else:
        gq = tl.load(g_base + offs_t[:, None] * sg_t + offs_d[None, :] * sg_x, mask=md[None, :], other=0.0)
        y = _dot(s, S, BF16) * tl.exp(gq)
        r = tl.where(has_prev, tl.load(g_base + r_at * sg_t + offs_d * sg_x, mask=md, other=0.0), 0.0)
    for j in range(0, sub):
        offs_j = tl.cast(n * BT + j * BC, tl.int64) + tl.arange(0, BC)
        mj = offs_j < T
        ej = tl.load(
            e_base + offs_j[:, None] * se_t + offs_k[None, :] * se_k, mask=mj[:, None] & mk[None, :], other=0.0
        )
        xj = tl.load(
            i_base + offs_j[:, None] * si_t + offs_d[None, :] * si_d, mask=mj[:, None] & md[None, :], other=0.0
        )
        ej = ej.to(tl.float32)
        xj = xj.to(tl.float32)
        if DECAY == 0:
            acc += _dot(_dot(s, tl.trans(ej), BF16), xj, BF16)
        elif DECAY == 1:
            gj = tl.load(g_base + offs_j * sg_t)
            a = _dot(s, tl.trans(ej), BF16) * tl.exp(gq[:, None] - gj[None, :])
            acc += _dot(a, xj, BF16)
        elif DECAY == 2:
            gj = tl.load(g_base + offs_j[:, None] * sg_t + offs_k[None, :] * sg_x, mask=mk[None, :], other=0.0)
            a = _dot(s_ref, tl.trans(ej * tl.exp(r[None, :] - gj)), BF16)
            acc += _dot(a, xj, BF16)
        else:
            gj = tl.load(g_base + offs_j[:, None] * sg_t + offs_d[None, :] * sg_x, mask=md[None, :], other=0.0)
            acc += _dot(_dot(s, tl.trans(ej), BF16), xj * tl.exp(r[None, :] - gj), BF16)
    if DECAY == 3:
        acc = acc * tl.exp(gq - r[None, :])
    y += acc

    # the diagonal sub-block: pairs j <= t (j < t when STRICT), a [BC, BC] map a of the pairs' s_t . e_j
    causal = rows[:, None] >= rows[None, :] + STRICT
    xi = tl.load(i_base + offs_t[:, None] * si_t + offs_d[None, :] * si_d, mask=mt[:, None] & md[None, :], other=0.0)
    xi = xi.to(tl.float32)
    if DECAY == 2:
        # a row decay's steps do not factorise here (module docstring): each pair's exp(G_t - G_j)
        # over K, formed for all pairs at once, [BC, BC, BKD] for each block of BKD key columns
        a = tl.zeros([BC, BC], dtype=tl.float32)
        for kb in tl.range(0, BK, BKD):
            offs_kb = kb + tl.arange(0, BKD)
            mtk = mt[:, None] & (offs_kb < K)[None, :]
            sb = tl.load(s_base + offs_t[:, None] * ss_t + offs_kb[None, :] * ss_k, mask=mtk, other=0.0)
            eb = tl.load(e_base + offs_t[:, None] * se_t + offs_kb[None, :] * se_k, mask=mtk, other=0.0)
            gb = tl.load(
                g_base + offs_t[:, None] * sg_t + offs_kb[None, :] * sg_x, mask=(offs_kb < K)[None, :], other=0.0
            )
            w = tl.exp(tl.where(causal[:, :, None], gb[:, None, :] - gb[None, :, :], 0.0))
            a += tl.sum(sb.to(tl.float32)[:, None, :] * eb.to(tl.float32)[None, :, :] * w, 2)
    else:
        ei = tl.load(
            e_base + offs_t[:, None] * se_t + offs_k[None, :] * se_k, mask=mt[:, None] & mk[None, :], other=0.0
        )
        a = _dot(s, tl.trans(ei.to(tl.float32)), BF16)
        if DECAY == 1:
            a = a * tl.exp(tl.where(causal, gq[:, None] - gq[None, :], 0.0))
    a = tl.where(causal, a, 0.0)
    if DECAY == 3:
        # a column decay's likewise, over D: [BC, BC, BD]
        w = tl.exp(tl.where(causal[:, :, None], gq[:, None, :] - gq[None, :, :], 0.0))
        y += tl.sum(a[:, :, None] * w * xi[None, :, :], 1)
    else:
        y += _dot(a, xi, BF16)
    tl.store(y_ptr + (bh * T + offs_t[:, None]) * D + offs_d[None, :], y, mask=mt[:, None] & md[None, :])


def chunk_steps(chunk_size: int, T: int) -> int:
    """The kernels' chunk BT for ``eos``'s chunk_size: the largest of 16, 32, 64 that is at most
    chunk_size and not needlessly longer than T (16 at least; the chunk changes no result)."""
    want = min(chunk_size, max(T, 1), CHUNKS[-1])
    return max(c for c in CHUNKS if c == CHUNKS[0] or c <= want)


def cumulative(g: Tensor, BT: int) -> Tensor:
    """Chunk-local cumulative logs [B, H, N * BT, X] (float32, contiguous) of g [B, H, T, X],
    padded to whole chunks with log 0, o raised as in the other chunk forms (``finite_log``).
    Summed in float64: each G is then the float32 rounding of its exact value."""
    B, H, T, X = g.shape
    N = (T + BT - 1) // BT
    logs = torch.nn.functional.pad(finite_log(g, torch.float32), (0, 0, 0, N * BT - T))
    return logs.reshape(B, H, N, BT, X).cumsum(3, dtype=torch.float64).to(torch.float32).reshape(B, H, N * BT, X)


def _strides(x: Tensor) -> tuple[int, ...]:
    return tuple(x.stride())


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """Packed documents (``cu_seqlens``) laid out chunk-aligned: document n's tokens start at a
    multiple of BT and are followed by zeros (inputs, log decay 0) up to its last chunk's end, so
    no chunk holds two documents. The output kernel then needs no boundaries (each chunk's start
    memory is its own document's); the states kernel restarts the memory at each document's first
    chunk and writes the document's final state after its last. At most BT - 1 steps of padding a
    document.

    ``pos`` [T]: each token's position in the laid-out row of ``T_pad`` steps; per chunk (int32):
    ``first``/``last`` 1 + the document the chunk opens/closes (0: none); per token ``doc``; per
    document ``starts`` and ``lasts`` (its first and last token, packed positions) and ``limits``
    (int32: its last token's position in the laid-out row; the strict memory o_T m_{T-1} takes the
    steps before it)."""

    pos: Tensor
    T_pad: int
    first: Tensor
    last: Tensor
    doc: Tensor
    starts: Tensor
    lasts: Tensor
    limits: Tensor

    @property
    def N(self) -> int:
        return len(self.starts)

    @staticmethod
    def of(bounds: list[int], BT: int, device: torch.device) -> ChunkLayout:
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        chunks = [math.ceil(n / BT) for n in lengths]
        opened = [0]
        for c in chunks:
            opened.append(opened[-1] + c)
        first = torch.zeros(opened[-1], dtype=torch.int32)
        last = torch.zeros(opened[-1], dtype=torch.int32)
        limits = torch.zeros(len(lengths), dtype=torch.int32)
        pos = torch.empty(bounds[-1], dtype=torch.int64)
        for n, (length, c0, c1) in enumerate(zip(lengths, opened[:-1], opened[1:], strict=True)):
            first[c0] = n + 1
            last[c1 - 1] = n + 1
            limits[n] = c0 * BT + length - 1
            pos[bounds[n] : bounds[n + 1]] = torch.arange(c0 * BT, c0 * BT + length)
        cu = torch.tensor(bounds, dtype=torch.int64)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), cu[1:] - cu[:-1])
        return ChunkLayout(
            *(x.to(device) for x in (pos,)),
            opened[-1] * BT,
            *(x.to(device) for x in (first, last, doc, cu[:-1], cu[1:] - 1, limits)),
        )

    def reversed(self) -> ChunkLayout:
        """The layout of the laid-out row read backwards (the backward's reverse-time problems:
        tensors laid out, then flipped): each document's chunks in reverse order, opening where
        it closed. Its ``pos``, per-token and per-document fields are not those of a packed row."""
        return dataclasses.replace(self, first=self.last.flip(0), last=self.first.flip(0))

    def lay_out(self, x: Tensor) -> Tensor:
        """[1, H, T, X] -> [1, H, T_pad, X], zeros between documents."""
        return x.new_zeros(*x.shape[:2], self.T_pad, x.shape[3]).index_copy_(2, self.pos, x)

    def pack(self, x: Tensor) -> Tensor:
        """[1, H, T_pad, X] -> [1, H, T, X]: the documents' steps."""
        return x.index_select(2, self.pos)

    def per_token(self, x: Tensor) -> Tensor:
        """A per-document [N, H, X] as [1, H, T, X], each token taking its document's row."""
        return x.transpose(0, 1).index_select(1, self.doc).unsqueeze(0)

    def reverse_cumsum(self, x: Tensor) -> Tensor:
        """Sum over each token's later steps of its own document (itself included), x [1, H, T, X];
        accumulated in float64 so that subtracting the later documents' share loses nothing."""
        total = x.flip(2).cumsum(2, dtype=torch.float64).flip(2)
        after = torch.nn.functional.pad(total, (0, 0, 0, 1)).index_select(2, self.lasts + 1)
        return (total - after.index_select(2, self.doc)).to(x.dtype)


def triton_chunk(
    s: Tensor,
    e: Tensor,
    i: Tensor,
    G: Tensor | None,
    kind: str,
    m0: Tensor | None,
    BT: int,
    bf16: bool,
    strict: bool = False,
    strict_final: bool = False,
    layout: ChunkLayout | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The forward kernels on one EOS problem (``chunk_matmul``'s names and layouts: s, e
    [B, H, T, K], i [B, H, T, D], m0 [B, H, K, D]; any strides), its log decay given as
    ``cumulative(g, BT)`` of g [B, H, T, 1 | K | D] for kind scalar | row | col (None: no decay).
    ``bf16``: bfloat16 matmul operands, else float32. ``strict`` leaves each step's own term out of
    y; ``strict_final`` also returns o_T * m_{T-1}. ``layout``: the inputs are packed documents
    laid out by it (B = 1, T = its T_pad); m0 and the returned memories are per document [N, H, K, D].
    Returns y [B, H, T, D], m_T and that memory (None unless asked), all float32. In a graph traced
    by torch.compile the launches are the custom op ``lcsm::triton_chunk`` (one document a row)."""
    if torch.compiler.is_compiling():
        if layout is not None:
            raise ValueError("triton_chunk: packed documents (layout) cannot be traced by torch.compile")
        y, final, final_strict = _triton_chunk_op(s, e, i, G, m0, kind, BT, bf16, strict, strict_final)
        return y, final, final_strict if strict_final else None
    return _launch(s, e, i, G, kind, m0, BT, bf16, strict, strict_final, layout)


def _launch(
    s: Tensor,
    e: Tensor,
    i: Tensor,
    G: Tensor | None,
    kind: str,
    m0: Tensor | None,
    BT: int,
    bf16: bool,
    strict: bool,
    strict_final: bool,
    layout: ChunkLayout | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``triton_chunk``'s kernel launches."""
    B, H, T, K = s.shape
    D = i.shape[-1]
    N = math.ceil(T / BT)
    states_of = B if layout is None else layout.N
    BK = max(16, triton.next_power_of_2(K))
    BK_states = min(BK, BLOCK_K)
    BD = max(16, min(BLOCK_D, triton.next_power_of_2(D)))
    if G is None:
        G = torch.zeros(B, H, N * BT, 1, dtype=torch.float32, device=s.device)
    if kind == "scalar":
        G = G[..., 0]
        g_strides = (*_strides(G), 0)
    else:
        g_strides = _strides(G)
    m0 = None if m0 is None else m0.to(torch.float32).contiguous()
    states = torch.empty(B, H, N, K, D, dtype=torch.float32, device=s.device)
    final = torch.empty(states_of, H, K, D, dtype=torch.float32, device=s.device)
    y = torch.empty(B, H, T, D, dtype=torch.float32, device=s.device)
    decay = KINDS[kind]
    # unread unless PACKED: any int32 tensor stands for the chunk tables
    unused = (s.new_zeros(1, dtype=torch.int32),) * 2
    tables = unused if layout is None else (layout.first, layout.last)
    states_grid = (triton.cdiv(D, BD), triton.cdiv(K, BK_states))
    # what the states and strict kernels share: sizes, the inputs' and logs' strides, constants
    sizes = (T, H, K, D, N, *_strides(e), *_strides(i), *g_strides)
    options = dict(
        DECAY=decay,
        PACKED=layout is not None,
        BT=BT,
        BK=BK_states,
        BD=BD,
        BF16=bf16,
        num_warps=WARPS_STATES,
        num_stages=STAGES_STATES,
    )
    with on_device(s):
        _states_kernel[(*states_grid, B * H)](
            e, i, G, final if m0 is None else m0, states, final, *tables, *sizes, HAS_M0=m0 is not None, **options
        )
        final_strict = None
        if strict_final:
            # each sequence's (document's) last step, as its place in the row
            limits = torch.full((B,), T - 1, dtype=torch.int32, device=s.device) if layout is None else layout.limits
            final_strict = torch.empty_like(final)
            strict_grid = (*states_grid, states_of * H)
            _strict_final_kernel[strict_grid](e, i, G, states, final_strict, limits, *sizes, **options)
        # a column decay's diagonal sub-block holds [SUB, SUB, BD] factors: in float32 (tf32x3
        # products) ptxas spills 788 bytes at BD 64, 8 at 32 (bench/triton_registers.py)
        BD_out = min(BD, BLOCK_D_COL_FLOAT32) if kind == "col" and not bf16 else BD
        _output_kernel[(N * (BT // SUB), triton.cdiv(D, BD_out), B * H)](
            s,
            e,
            i,
            G,
            states,
            y,
            T,
            H,
            K,
            D,
            N,
            *_strides(s),
            *_strides(e),
            *_strides(i),
            *g_strides,
            DECAY=decay,
            STRICT=int(strict),  # 1: pairs j < t, 0: j <= t
            BT=BT,
            BC=SUB,
            BK=BK,
            BD=BD_out,
            BF16=bf16,
            BKD=min(BK, DIAGONAL_K),
            num_warps=WARPS_OUTPUT,
            num_stages=STAGES_OUTPUT,
        )
    return y, final, final_strict


@torch.library.custom_op("lcsm::triton_chunk", mutates_args=())
def _triton_chunk_op(
    s: Tensor,
    e: Tensor,
    i: Tensor,
    G: Tensor | None,
    m0: Tensor | None,
    kind: str,
    BT: int,
    bf16: bool,
    strict: bool,
    strict_final: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``triton_chunk`` as an op a traced graph calls (one document a row); o_T * m_{T-1} empty
    unless ``strict_final`` (an op's outputs are tensors, none aliasing another)."""
    y, final, final_strict = _launch(s, e, i, G, kind, m0, BT, bf16, strict, strict_final, None)
    return y, final, final_strict if strict_final else final.new_empty(0)


@_triton_chunk_op.register_fake
def _(s, e, i, G, m0, kind, BT, bf16, strict, strict_final):
    (B, H, T, K), D = s.shape, i.shape[-1]
    y, final = s.new_empty(B, H, T, D, dtype=torch.float32), s.new_empty(B, H, K, D, dtype=torch.float32)
    return y, final, torch.empty_like(final) if strict_final else final.new_empty(0)


def _own_step(s: Tensor, e: Tensor, i: Tensor) -> Tensor:
    """Each step's own contribution (s_t . e_t) i_t, the part a strict output leaves out."""
    return (s * e).sum(-1, keepdim=True) * i


class TritonChunkFunction(torch.autograd.Function):
    """The Triton forward with the appendix-5.1 backward run by the same kernels (module
    docstring). Arguments as ``triton_chunk``'s, ``layout`` for packed documents (the operands
    packed [1, H, T, .], laid out inside); returns y [B, H, T, D] and m_T [B | N, H, K, D].

    As in ``ChunkMatmulFunction``, the decay gradient is formed from strict outputs (own-step
    terms left out, added back to the returned gradients afterwards) and the boundary term from
    o_T * m_{T-1}: the own-step parts are O(1) and cancel exactly, while the decay gradient may be
    O(o), which float32 would lose to the cancellation. With documents, each has its own boundary
    term, and the reverse-time problems run on the laid-out row read backwards."""

    @staticmethod
    def forward(
        ctx: Any,
        s: Tensor,
        e: Tensor,
        i: Tensor,
        g: Tensor | None,
        m0: Tensor | None,
        kind: str,
        BT: int,
        bf16: bool,
        layout: ChunkLayout | None = None,
    ) -> tuple[Tensor, Tensor]:
        lay, pack = _layout_maps(layout)
        # what only the decay gradient reads: the strict output (of a column decay) and o_T * m_{T-1}
        for_dg = g is not None and any(ctx.needs_input_grad[:5])
        G = None if g is None else cumulative(lay(g), BT)
        strict = for_dg and kind == "col"
        y, m_T, m_strict = triton_chunk(
            lay(s), lay(e), lay(i), G, kind, m0, BT, bf16, strict=strict, strict_final=for_dg, layout=layout
        )
        y = pack(y)
        y_strict = None
        if strict:
            y_strict = y
            y = y + _own_step(s, e, i)
        ctx.save_for_backward(s, e, i, g, m0, y_strict, m_strict)
        ctx.kind, ctx.BT, ctx.bf16, ctx.layout = kind, BT, bf16, layout
        return y, m_T

    @staticmethod
    @first_order
    def backward(ctx: Any, dy: Tensor | None, dm_T: Tensor | None) -> tuple[Tensor | None, ...]:
        s, e, i, g, m0, y_strict, m_strict = ctx.saved_tensors
        kind, BT, bf16, layout = ctx.kind, ctx.BT, ctx.bf16, ctx.layout
        lay, pack = _layout_maps(layout)
        backwards = None if layout is None else layout.reversed()
        tkind = TRANSPOSED[kind]
        B, H, T, K = s.shape
        D = i.shape[-1]
        dy = s.new_zeros(B, H, T, D) if dy is None else dy
        dM = s.new_zeros(B if layout is None else layout.N, H, K, D) if dm_T is None else dm_T

        def run(shrink, expand, inp, G, k, start, rows):
            return triton_chunk(shrink, expand, inp, G, k, start, BT, bf16, strict=True, layout=rows)

        s_l, e_l, i_l, dy_l = (lay(x) for x in (s, e, i, dy))
        # ds: the forward problem on the transposed memory, recomputed from m0^T
        G = None if g is None else cumulative(lay(g), BT)
        ds = pack(run(dy_l, i_l, e_l, G, tkind, None if m0 is None else m0.transpose(-1, -2), layout)[0])
        # di, de: the reverse-time adjoint problem; the adjoint at step t decays by o_{t+1} of its
        # own sequence (log 0 after the last step)
        g_rev = None
        if g is not None:
            g_next = torch.cat([g[:, :, 1:], torch.zeros_like(g[:, :, :1])], 2)
            if layout is not None:
                g_next = g_next.index_fill(2, layout.lasts, 0.0)
            g_rev = cumulative(lay(g_next).flip(2), BT)
        s_r, e_r, i_r, dy_r = (x.flip(2) for x in (s_l, e_l, i_l, dy_l))
        di, dM_start, _ = run(e_r, s_r, dy_r, g_rev, kind, dM, backwards)
        de = run(i_r, dy_r, s_r, g_rev, tkind, dM.transpose(-1, -2), backwards)[0]
        di, de = pack(di.flip(2)), pack(de.flip(2))

        dg = None
        lasts = -1 if layout is None else layout.lasts
        if g is not None:
            mm = dM * m_strict
            carry = mm.sum(-2) if kind == "col" else mm.sum(-1)
            if kind == "col":
                inputs = i * di
                inputs[:, :, lasts] = 0  # the last input's part is the one the boundary term leaves out
                term = dy * y_strict - inputs
            else:
                inputs = e * de
                inputs[:, :, lasts] = 0
                term = s * ds - inputs
            if kind == "scalar":
                term = term.sum(-1, keepdim=True)
                carry = carry.sum(-1, keepdim=True)
            if layout is None:
                dg = term.flip(2).cumsum(2).flip(2) + carry.unsqueeze(2)
            else:
                dg = layout.reverse_cumsum(term) + layout.per_token(carry)
        i_dy = (i * dy).sum(-1, keepdim=True)  # own-step terms share i . dy
        ds = ds.addcmul_(i_dy, e)
        de = de.addcmul_(i_dy, s)
        di = di.add_(_own_step(s, e, dy))
        dm0 = None
        if m0 is not None:
            dm0 = dM_start
            if g is not None:
                first = g[:, :, 0] if layout is None else g[0, :, layout.starts].transpose(0, 1)
                first = first.exp()
                dm0 = dM_start * (first.unsqueeze(-2) if kind == "col" else first.unsqueeze(-1))
        return ds, de, di, dg, dm0, None, None, None, None


def _layout_maps(layout: ChunkLayout | None):
    """(lay out, pack back) for packed documents; identities without them."""
    if layout is None:
        return (lambda x: x), (lambda x: x)
    return layout.lay_out, layout.pack


def eos_triton(p: EOSProblem, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Mode "triton": y [B, H, T, D] and m_T [B, H, K, D] for the canonical problem p (which
    ``eos._triton_unsupported`` has accepted), in chunks of ``chunk_steps(chunk_size, T)``."""
    s, e, i, g, kind = matmul_operands(p)
    # bfloat16 inputs take bfloat16 matmul operands (tensor cores): the inputs lose nothing to the
    # cast, the decayed ones and the carried memory no more than bfloat16's own precision. float16
    # inputs do not: the memory, a sum over up to T steps, can pass float16's range (65504).
    bf16 = p.out_dtype == torch.bfloat16
    return TritonChunkFunction.apply(s, e, i, g, p.m0, kind, chunk_steps(chunk_size, p.T), bf16)


def eos_triton_packed(p: EOSProblem, bounds: list[int], chunk_size: int) -> tuple[Tensor, Tensor]:
    """Mode "triton" on packed documents (``cu_seqlens`` as ``bounds``): y [1, H, T, D] and the
    final states [N, H, K, D], each document from its own initial state (p.m0 [N, H, K, D] or
    zeros), in chunks of ``chunk_steps(chunk_size, T)`` laid out by ``ChunkLayout``."""
    s, e, i, g, kind = matmul_operands(p)
    BT = chunk_steps(chunk_size, p.T)
    layout = ChunkLayout.of(bounds, BT, p.i.device)
    bf16 = p.out_dtype == torch.bfloat16
    return TritonChunkFunction.apply(s, e, i, g, p.m0, kind, BT, bf16, layout)
