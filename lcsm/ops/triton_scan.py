"""The selective scan as Triton kernels: the EOS recurrence with K-vector e and s and a full K x D
decay, on CUDA devices (``native_scan``'s problem, there in C for the CPU).

    m_t = exp(a_t * b) * m_{t-1} + e_t (x) x_t,    y_t = sum_k s_t[k] m_t[k, :]

with a [B, H, T, 1 | K, D] (Mamba's Delta_t, one row shared by every k) and b [H, K, D] time-invariant
(A); a full log decay tensor is a * 1. The chunk mode's elementwise kernel runs this as PyTorch
operations, a few a step: on a GPU each is a kernel launch, and the Mamba model trained at ~5K
tokens/s at every length (bench/results/efficiency_gpu.md).

One program per (batch * head, block of ``BD`` columns) walks the sequence in blocks of ``STEPS``
steps. A block's memories are a linear recurrence, m_t = A_t m_{t-1} + X_t with A_t = exp(a_t b) and
X_t = e_t (x) x_t, so all of them come from one associative scan over the block ([STEPS, K, BD]
pairs combined as (A1, X1) then (A2, X2) -> (A1 A2, A2 X1 + X2)) and the memory carried into it:
m_t = A_{..t} m_start + X_{..t}. The forward keeps the memory entering every block (``starts``).

Backward, block by block in reverse: the adjoint g_t = dL/dm_t follows the reverse recurrence
g_t = s_t (x) dy_t + exp(a_{t+1} b) g_{t+1}, one reverse scan with the same combine and the adjoint
carried from the later block; the memories each decay multiplies (m_{t-1}) are recomputed from the
block's kept start by a scan over the same pairs one step earlier. Then, per step,
dx_t = sum_k g_t e_t, de_t = sum_d g_t x_t, ds_t = sum_d m_t dy_t, d(log o_t) = g_t o_t m_{t-1},
da_t = d(log o_t) b (summed over k for one row) and db = sum_t d(log o_t) a_t. de, ds and db are
sums over columns (or the batch and the segments below) that span programs: each program writes its
share, summed after the launch (no atomics: the result does not depend on the programs' order); for
de and ds a backward program takes a group of column blocks (``column_groups``) and adds each
block's part to the group's share, which bounds the shares' memory.

Segments: a launch with fewer programs than ``MIN_PROGRAMS`` (twice the device's multiprocessors:
Mamba at batch 1 has 96 at D 1536) also splits the sequence into ``segments``. The kernel's
SUMMARY pass reduces each segment to one pair (the product of its decays, its memory from a zero
start; backward: the product of its adjoint decays, its first adjoint from a zero one after it),
``_carry_kernel`` composes them in order (in reverse for the adjoint) into the value entering each
segment, and the kernel then runs every segment from its own value at once.

Packed documents (``cu_seqlens``): each step knows its document (``doc``); at a document's first step
the pair becomes (0, X_t + A_t m0[doc]) (the memory restarted from the document's own initial state),
at its last step the memory is written as the document's final state, and the adjoint recurrence is
cut there (its pair (0, s_t (x) dy_t + dm_T[doc])). No layout, no padding: a block may hold several
documents.

Compute in the inputs' dtype (float32, or float64 for the tests); no matmul, so nothing is rounded to
a tensor-core format. Under ``TRITON_INTERPRET=1`` set before triton is imported, the kernels run on
CPU tensors (``triton_chunk.INTERPRETED``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._inputs import EOSProblem, on_device
from .native_scan import scan_gradients_like, scan_operands

Tensor = torch.Tensor

STEPS = 16  # a block of steps: the scan's length, and the steps between kept memories
MAX_K = 256  # K rows held in one block (BD columns shrink as K grows, down to one)
# The [STEPS, K, BD] blocks a program holds (BD from the values) and its warps, forward and backward,
# from ptxas's register reports for sm_90 at Mamba's shape (K 16, D 1536; bench/triton_registers.py,
# bench/results/triton_registers.md), not from timings: the forward holds one block of pairs and
# its scan (4096 values, 4 warps: 128 registers, no spill); the backward about six (adjoints,
# memories, decays and two scans), which spill at 4096 values (4 or 8 warps) or 4 warps, not at
# 2048 values and 8 warps (182 registers; 203 packed).
BLOCK_VALUES = 4096
WARPS = 4
BLOCK_VALUES_BACKWARD = 2048
WARPS_BACKWARD = 8


# A launch with fewer programs than this (batch * heads * column blocks) splits the sequence into
# segments too (``segments``); None: twice the device's streaming multiprocessors (the CPU: 1).
MIN_PROGRAMS: int | None = None
MIN_SEGMENT_STEPS = 256  # a segment's least length (each costs a summary pass and a carry step)


def segments(programs: int, T: int, device: torch.device) -> tuple[int, int]:
    """(S, L): S segments of L steps (a multiple of STEPS) so that programs * S reaches
    ``MIN_PROGRAMS``, each at least ``MIN_SEGMENT_STEPS`` long; (1, the whole sequence) when the
    programs alone reach it."""
    blocks = triton.cdiv(max(T, 1), STEPS)
    target = MIN_PROGRAMS
    if target is None:
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    if programs >= target:
        return 1, blocks * STEPS
    per = max(triton.cdiv(MIN_SEGMENT_STEPS, STEPS), triton.cdiv(blocks * programs, target))
    return triton.cdiv(blocks, per), per * STEPS


# The backward's de and ds are sums over the columns, each program adding its share: one buffer
# [groups, B, H, T, K] a sum, its column groups at most this many times D / K, so that a buffer is
# at most this many times the size of x (a group of columns per program, each block of it in turn)
SHARES_PER_INPUT = 1


def column_groups(K: int, D: int, BD: int) -> int:
    """The backward's groups of column blocks (one program each): every block its own group where
    the shares fit ``SHARES_PER_INPUT``, else fewer (Mamba's K 16, D 1536: 96 groups of 2 blocks of 8)."""
    return max(1, min(triton.cdiv(D, BD), int(SHARES_PER_INPUT * D // max(K, 1))))


def columns(K: int, D: int, backward: bool = False) -> int:
    """Columns a program holds, BD: a power of two with STEPS * K' * BD at most the forward's or the
    backward's block of values (K' the next power of two of K), at most D's."""
    rows = triton.next_power_of_2(K)
    values = BLOCK_VALUES_BACKWARD if backward else BLOCK_VALUES
    return max(1, min(values // (STEPS * rows), triton.next_power_of_2(D)))


@triton.jit
def _combine(a1, x1, a2, x2):
    """Two steps of m -> a m + x, the first then the second (for the reverse scan: the later block
    then the step before it, the same composition)."""
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _rows(t, T, doc_ptr, bi, PACKED: tl.constexpr):
    """Each step's document and whether it opens or closes it: (doc, first, last) for steps t [STEPS]
    (False outside 0..T-1)."""
    valid = (t >= 0) & (t < T)
    if PACKED:
        doc = tl.load(doc_ptr + t, mask=valid, other=-1)
        before = tl.load(doc_ptr + t - 1, mask=valid & (t > 0), other=-1)
        after = tl.load(doc_ptr + t + 1, mask=t + 1 < T, other=-1)
        return doc, valid & (doc != before), valid & (doc != after)
    doc = tl.zeros_like(t) + bi
    return doc, valid & (t == 0), valid & (t == T - 1)


@triton.jit
def _decays(a_ptr, t, valid, offs_k, offs_d, md, mkd, bmat, sa_t, sa_k, A_ROWS: tl.constexpr):
    """(a_t [STEPS, 1 | K, BD], o_t = exp(a_t b) [STEPS, K, BD]) of the steps t; a is 0 where not valid."""
    if A_ROWS:
        ptrs = a_ptr + t[:, None, None] * sa_t + offs_k.to(tl.int64)[None, :, None] * sa_k + offs_d[None, None, :]
        a = tl.load(ptrs, mask=valid[:, None, None] & mkd[None], other=0.0)
    else:
        a = tl.load(a_ptr + t[:, None] * sa_t + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        a = a[:, None, :]
    return a, tl.exp(a * bmat[None])


@triton.jit
def _per_doc(ptr, doc, rows, offs_k, offs_d, mkd, s_doc, s_k):
    """A per-document [N, .., K, D] tensor's rows for the steps' documents ([STEPS, K, BD], 0 where
    ``rows`` is False); ``ptr`` already at the head."""
    ptrs = ptr + doc[:, None, None] * s_doc + offs_k.to(tl.int64)[None, :, None] * s_k + offs_d[None, None, :]
    return tl.load(ptrs, mask=rows[:, None, None] & mkd[None], other=0.0)


@triton.jit
def _pairs(
    x_ptr,
    e_ptr,
    a_ptr,
    m0_ptr,
    t,
    T,
    doc,
    first,
    block,
    offs_k,
    offs_d,
    mk,
    md,
    mkd,
    bmat,
    sx_t,
    se_t,
    sa_t,
    sa_k,
    s0_doc,
    s0_k,
    A_ROWS: tl.constexpr,
    HAS_M0: tl.constexpr,
):
    """The scan's pairs (A_t, X_t) for steps t [STEPS], identity (1, 0) outside ``block``; at a
    document's first step (0, X_t + A_t m0[doc]). Also returns x_t, e_t, a_t and o_t."""
    valid = (t >= 0) & (t < T)
    x = tl.load(x_ptr + t[:, None] * sx_t + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
    e = tl.load(e_ptr + t[:, None] * se_t + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
    a, o = _decays(a_ptr, t, valid, offs_k, offs_d, md, mkd, bmat, sa_t, sa_k, A_ROWS)
    X = e[:, :, None] * x[:, None, :]
    if HAS_M0:
        X += o * _per_doc(m0_ptr, doc, first, offs_k, offs_d, mkd, s0_doc, s0_k)
    A = tl.where(first[:, None, None], 0.0, o)
    keep = (block & valid)[:, None, None]
    return tl.where(keep, A, 1.0), tl.where(keep, X, 0.0), x, e, a, o


@triton.jit
def _row(x_ptr, e_ptr, s_ptr, a_ptr, m0_ptr, bi, hi, sx_b, sx_h, se_b, se_h, ss_b, ss_h, sa_b, sa_h, s0_h):
    """The operands' pointers at batch row bi, head hi (m0's at the head: it is per document)."""
    return (
        x_ptr + bi * sx_b + hi * sx_h,
        e_ptr + bi * se_b + hi * se_h,
        s_ptr + bi * ss_b + hi * ss_h,
        a_ptr + bi * sa_b + hi * sa_h,
        m0_ptr + hi * s0_h,
    )


@triton.jit
def _segment(bh, T, K, D, L, S, BT: tl.constexpr):
    """(blocks of the sequence, this program's offset in the per-segment [B * H, S, K, D] buffers,
    its first block and the one after its last): its segment of L steps, all of them unless
    segmented."""
    blocks = tl.cdiv(T, BT)
    n0 = tl.program_id(2) * (L // BT)
    return blocks, (bh * S + tl.program_id(2)) * K * D, n0, tl.minimum(n0 + L // BT, blocks)


@triton.jit
def _scan_forward_kernel(
    x_ptr, e_ptr, s_ptr, a_ptr, b_ptr, m0_ptr, doc_ptr, y_ptr, mT_ptr, starts_ptr, seg_ptr, sum_a_ptr,
    T, H, K, D, L, S,
    sx_b, sx_h, sx_t, se_b, se_h, se_t, ss_b, ss_h, ss_t, sa_b, sa_h, sa_t, sa_k, sb_h, sb_k, s0_doc, s0_h, s0_k,
    A_ROWS: tl.constexpr, HAS_M0: tl.constexpr, PACKED: tl.constexpr, KEEP: tl.constexpr,
    SEGMENTED: tl.constexpr, SUMMARY: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    bi, hi = bh // H, bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, KP)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mk, md = offs_k < K, offs_d < D
    mkd = mk[:, None] & md[None, :]
    kd = offs_k[:, None] * D + offs_d[None, :]
    bmat = tl.load(b_ptr + hi * sb_h + offs_k.to(tl.int64)[:, None] * sb_k + offs_d[None, :], mask=mkd, other=0.0)
    x_ptr, e_ptr, s_ptr, a_ptr, m0_ptr = _row(
        x_ptr, e_ptr, s_ptr, a_ptr, m0_ptr, bi, hi, sx_b, sx_h, se_b, se_h, ss_b, ss_h, sa_b, sa_h, s0_h
    )
    mT_ptr += hi * K * D
    blocks, segment, n0, n1 = _segment(bh, T, K, D, L, S, BT)
    if SEGMENTED and not SUMMARY:
        m = tl.load(seg_ptr + segment + kd, mask=mkd, other=0.0)  # the memory entering the segment
    else:
        m = tl.zeros([KP, BD], dtype=y_ptr.dtype.element_ty)
    product = tl.full([KP, BD], 1.0, dtype=y_ptr.dtype.element_ty)
    for n in range(n0, n1):
        t = (n * BT + offs_t).to(tl.int64)
        valid = t < T
        if KEEP and not SUMMARY:
            tl.store(starts_ptr + (bh * blocks + n) * K * D + kd, m, mask=mkd)
        doc, first, last = _rows(t, T, doc_ptr, bi, PACKED)
        A, X, _, _, _, _ = _pairs(
            x_ptr, e_ptr, a_ptr, m0_ptr, t, T, doc, first, valid, offs_k, offs_d, mk, md, mkd, bmat,
            sx_t, se_t, sa_t, sa_k, s0_doc, s0_k, A_ROWS, HAS_M0,
        )  # fmt: skip
        A, X = tl.associative_scan((A, X), 0, _combine)
        M = A * m[None] + X
        # steps past T pass the memory on unchanged: the last row is the block's last memory
        block_end = offs_t[:, None, None] == BT - 1
        if SUMMARY:
            product = tl.sum(tl.where(block_end, A, 0.0), 0) * product
        else:
            s = tl.load(s_ptr + t[:, None] * ss_t + offs_k[None, :], mask=valid[:, None] & mk[None, :], other=0.0)
            y = tl.sum(s[:, :, None] * M, 1)
            tl.store(y_ptr + (bh * T + t[:, None]) * D + offs_d[None, :], y, mask=valid[:, None] & md[None, :])
            ends = mT_ptr + doc[:, None, None] * (H * K * D) + kd[None]
            tl.store(ends, M, mask=last[:, None, None] & mkd[None])
        m = tl.sum(tl.where(block_end, M, 0.0), 0)
    if SUMMARY:
        # the segment as one pair: its decays' product and its memory from a zero start
        tl.store(sum_a_ptr + segment + kd, product, mask=mkd)
        tl.store(seg_ptr + segment + kd, m, mask=mkd)


@triton.jit
def _scan_backward_kernel(
    x_ptr, e_ptr, s_ptr, a_ptr, b_ptr, m0_ptr, doc_ptr, starts_ptr, dy_ptr, dmT_ptr, seg_ptr, sum_a_ptr,
    dx_ptr, de_ptr, ds_ptr, da_ptr, db_ptr, dm0_ptr,
    T, B, H, K, D, L, S,
    sx_b, sx_h, sx_t, se_b, se_h, se_t, ss_b, ss_h, ss_t, sa_b, sa_h, sa_t, sa_k, sb_h, sb_k, s0_doc, s0_h, s0_k,
    A_ROWS: tl.constexpr, HAS_M0: tl.constexpr, HAS_DMT: tl.constexpr, PACKED: tl.constexpr,
    SEGMENTED: tl.constexpr, SUMMARY: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    bi, hi = bh // H, bh % H
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, KP)
    mk = offs_k < K
    x_ptr, e_ptr, s_ptr, a_ptr, m0_ptr = _row(
        x_ptr, e_ptr, s_ptr, a_ptr, m0_ptr, bi, hi, sx_b, sx_h, se_b, se_h, ss_b, ss_h, sa_b, sa_h, s0_h
    )
    dm0_ptr += hi * K * D
    dmT_ptr += hi * K * D
    # de and ds are sums over the columns: this program's share [B * H, T, K] of the column groups'
    # [groups, B * H, T, K] (zeros on entry), to which each of its column blocks adds its own
    share = (tl.program_id(1) * B * H + bh) * T * K
    blocks, segment, n0, n1 = _segment(bh, T, K, D, L, S, BT)
    for column_block in range(tl.program_id(1), tl.cdiv(D, BD), tl.num_programs(1)):
        offs_d = column_block * BD + tl.arange(0, BD)
        md = offs_d < D
        mkd = mk[:, None] & md[None, :]
        kd = offs_k[:, None] * D + offs_d[None, :]
        bmat = tl.load(b_ptr + hi * sb_h + offs_k.to(tl.int64)[:, None] * sb_k + offs_d[None, :], mask=mkd, other=0.0)
        # the adjoint at the later block's first step: from the later segments where SEGMENTED
        if SEGMENTED and not SUMMARY:
            g = tl.load(seg_ptr + segment + kd, mask=mkd, other=0.0)
        else:
            g = tl.zeros([KP, BD], dtype=dy_ptr.dtype.element_ty)
        product = tl.full([KP, BD], 1.0, dtype=dy_ptr.dtype.element_ty)
        db = tl.zeros([KP, BD], dtype=dy_ptr.dtype.element_ty)
        for r in range(0, n1 - n0):
            n = n1 - 1 - r
            t = (n * BT + offs_t).to(tl.int64)
            valid = t < T
            vd = valid[:, None] & md[None, :]
            vk = valid[:, None] & mk[None, :]
            doc, first, last = _rows(t, T, doc_ptr, bi, PACKED)
            dy = tl.load(dy_ptr + (bh * T + t[:, None]) * D + offs_d[None, :], mask=vd, other=0.0)
            s = tl.load(s_ptr + t[:, None] * ss_t + offs_k[None, :], mask=vk, other=0.0)
            # adjoints: g_t = s_t (x) dy_t + o_{t+1} g_{t+1}, cut at a document's last step
            _, o_next = _decays(a_ptr, t + 1, t + 1 < T, offs_k, offs_d, md, mkd, bmat, sa_t, sa_k, A_ROWS)
            Ga = tl.where(last[:, None, None], 0.0, o_next)
            Gx = s[:, :, None] * dy[:, None, :]
            if HAS_DMT:
                Gx += _per_doc(dmT_ptr, doc, last, offs_k, offs_d, mkd, H * K * D, D)
            Ga = tl.where(valid[:, None, None], Ga, 1.0)
            Ga, Gx = tl.associative_scan((Ga, Gx), 0, _combine, reverse=True)
            G = Ga * g[None] + Gx
            block_start = offs_t[:, None, None] == 0
            g = tl.sum(tl.where(block_start, G, 0.0), 0)
            if SUMMARY:
                product = tl.sum(tl.where(block_start, Ga, 0.0), 0) * product
            else:
                # the memories the decays multiply, m_{t-1} (m0[doc] at a document's first step):
                # the forward's pairs one step earlier, from the block's kept start
                u = t - 1
                udoc, ufirst, _ = _rows(u, T, doc_ptr, bi, PACKED)
                Pa, Px, _, _, _, _ = _pairs(
                    x_ptr, e_ptr, a_ptr, m0_ptr, u, T, udoc, ufirst, offs_t > 0, offs_k, offs_d, mk, md, mkd, bmat,
                    sx_t, se_t, sa_t, sa_k, s0_doc, s0_k, A_ROWS, HAS_M0,
                )  # fmt: skip
                Pa, Px = tl.associative_scan((Pa, Px), 0, _combine)
                start = tl.load(starts_ptr + (bh * blocks + n) * K * D + kd, mask=mkd, other=0.0)
                P = Pa * start[None] + Px
                if HAS_M0:
                    m0 = _per_doc(m0_ptr, doc, first, offs_k, offs_d, mkd, s0_doc, s0_k)
                    P = tl.where(first[:, None, None], m0, P)
                else:
                    P = tl.where(first[:, None, None], 0.0, P)
                _, _, x, e, a, o = _pairs(
                    x_ptr, e_ptr, a_ptr, m0_ptr, t, T, doc, first, valid, offs_k, offs_d, mk, md, mkd, bmat,
                    sx_t, se_t, sa_t, sa_k, s0_doc, s0_k, A_ROWS, False,
                )  # fmt: skip
                tl.store(dx_ptr + (bh * T + t[:, None]) * D + offs_d[None, :], tl.sum(G * e[:, :, None], 1), mask=vd)
                tk = t[:, None] * K + offs_k[None, :]
                de = tl.load(de_ptr + share + tk, mask=vk, other=0.0) + tl.sum(G * x[:, None, :], 2)
                tl.store(de_ptr + share + tk, de, mask=vk)
                M = o * P + e[:, :, None] * x[:, None, :]
                ds = tl.load(ds_ptr + share + tk, mask=vk, other=0.0) + tl.sum(M * dy[:, None, :], 2)
                tl.store(ds_ptr + share + tk, ds, mask=vk)
                dlog = G * o * P
                if A_ROWS:
                    da_at = ((bh * T + t[:, None, None]) * K + offs_k[None, :, None]) * D + offs_d[None, None, :]
                    tl.store(da_ptr + da_at, dlog * bmat[None], mask=valid[:, None, None] & mkd[None])
                else:
                    da = tl.sum(dlog * bmat[None], 1)
                    tl.store(da_ptr + (bh * T + t[:, None]) * D + offs_d[None, :], da, mask=vd)
                db += tl.sum(dlog * a, 0)
                if HAS_M0:
                    # d m0[doc] = o_t g_t at the document's first step
                    firsts = dm0_ptr + doc[:, None, None] * (H * K * D) + kd[None]
                    tl.store(firsts, o * G, mask=first[:, None, None] & mkd[None])
        if SUMMARY:
            # the segment as one pair of the reverse recurrence: its decays' product and its adjoint
            # at its first step from a zero adjoint after it
            tl.store(sum_a_ptr + segment + kd, product, mask=mkd)
            tl.store(seg_ptr + segment + kd, g, mask=mkd)
        else:
            tl.store(db_ptr + segment + kd, db, mask=mkd)


@triton.jit
def _carry_kernel(sum_a_ptr, sum_x_ptr, seg_ptr, S, K, D, REVERSE: tl.constexpr, KP: tl.constexpr, BD: tl.constexpr):
    """Across segments: the value entering each (forward: the memory, m_0 = 0 and
    m_{j+1} = A_j m_j + X_j; REVERSE: the adjoint after each, from the last one's 0 backwards) from
    the segments' pairs [B * H, S, K, D]."""
    bh = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, KP)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mkd = (offs_k < K)[:, None] & (offs_d < D)[None, :]
    kd = offs_k[:, None] * D + offs_d[None, :]
    v = tl.zeros([KP, BD], dtype=seg_ptr.dtype.element_ty)
    for r in range(0, S):
        j = S - 1 - r if REVERSE else r
        at = (bh * S + j) * K * D + kd
        a = tl.load(sum_a_ptr + at, mask=mkd, other=0.0)
        x = tl.load(sum_x_ptr + at, mask=mkd, other=0.0)
        tl.store(seg_ptr + at, v, mask=mkd)
        v = a * v + x


def _documents(cu: Tensor | None, T: int, device: torch.device) -> Tensor | None:
    """Each step's document, int64 [T], from the row's bounds (None: one document a row)."""
    if cu is None:
        return None
    steps = torch.arange(T, device=device)
    return torch.bucketize(steps, cu[1:].to(device=device, dtype=torch.int64), right=True)


class _Call:
    """One launch's operands (each last dimension contiguous), sizes, grid and strides."""

    def __init__(self, x, e, s, a, b, m0, cu, backward: bool = False):
        unit = [t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (x, e, s, a)]
        self.x, self.e, self.s, self.a = unit
        self.b = b.contiguous()
        self.m0 = None if m0 is None else (m0 if m0.stride(-1) == 1 else m0.contiguous())
        self.B, self.H, self.T, self.D = x.shape
        self.K = e.shape[-1]
        if self.K > MAX_K:
            raise ValueError(f"e: the Triton scan holds at most {MAX_K} memory rows, got K = {self.K}")
        if self.T == 0 or (cu is not None and self.B != 1):
            # eos answers T = 0 itself and checks the bounds (packed rows are one row of T steps)
            raise ValueError(f"triton_scan: expected T >= 1 and, with cu, B = 1; got x {list(x.shape)}")
        self.docs = 1 if cu is None else cu.shape[0] - 1
        self.doc = _documents(cu, self.T, x.device)
        self.BD = columns(self.K, self.D, backward)
        self.BH = self.B * self.H
        self.blocks = triton.cdiv(self.T, STEPS)
        self.column_blocks = triton.cdiv(self.D, self.BD)
        self.groups = column_groups(self.K, self.D, self.BD) if backward else self.column_blocks
        self.S, self.L = segments(self.BH * self.groups, self.T, x.device)
        self.grid = (self.BH, self.groups, self.S)
        m0_strides = (0, 0, 0) if self.m0 is None else (self.m0.stride(0), self.m0.stride(1), self.m0.stride(2))
        a_rows = self.a.stride(3) if self.a.shape[3] > 1 else 0
        self.strides = (
            *self.x.stride()[:3],
            *self.e.stride()[:3],
            *self.s.stride()[:3],
            *self.a.stride()[:3],
            a_rows,
            *self.b.stride()[:2],
            *m0_strides,
        )
        self.constants = {
            "A_ROWS": self.a.shape[3] > 1,
            "HAS_M0": self.m0 is not None,
            "PACKED": cu is not None,
            "BT": STEPS,
            "KP": triton.next_power_of_2(self.K),
            "BD": self.BD,
            "num_warps": WARPS_BACKWARD if backward else WARPS,
        }

    def operands(self) -> tuple:
        # unused pointers (no initial state, one document a row) point at x: never read
        return self.x, self.e, self.s, self.a, self.b, _or(self.m0, self.x), _or(self.doc, self.x)

    def launch(self, kernel, args_before: tuple, args_after: tuple, *, reverse: bool, **flags) -> None:
        """``kernel`` over the grid, on the inputs' device. Segmented (S > 1): first its summary of
        each segment (SUMMARY: the segment as one pair), then the values entering the segments
        carried across them (``_carry_kernel``, backwards for the adjoint when ``reverse``), then the
        kernel itself from them."""
        sizes = (self.L, self.S, *self.strides)

        def run(buffers: tuple, summary: bool, **more) -> None:
            kernel[self.grid](
                *self.operands(), *args_before, *buffers, *args_after, *sizes,
                SEGMENTED=self.S > 1, SUMMARY=summary, **{**flags, **more}, **self.constants,
            )  # fmt: skip

        with on_device(self.x):
            if self.S == 1:
                run((self.x, self.x), False)  # no segment buffers: never read
                return
            seg = self.x.new_empty(self.BH, self.S, self.K, self.D)
            product = torch.empty_like(seg)
            run((seg, product), True, **({"KEEP": False} if "KEEP" in flags else {}))
            carry = {k: self.constants[k] for k in ("KP", "BD")}
            carry_grid = (self.BH, self.column_blocks)
            _carry_kernel[carry_grid](product, seg, seg, self.S, self.K, self.D, REVERSE=reverse, **carry)
            run((seg, product), False)


def _or(x: Tensor | None, other: Tensor) -> Tensor:
    return other if x is None else x


@torch.library.custom_op("lcsm::triton_scan", mutates_args=())
def triton_scan(
    x: Tensor, e: Tensor, s: Tensor, a: Tensor, b: Tensor, m0: Tensor | None, cu: Tensor | None, keep: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, m_T, the memories entering each block of STEPS steps) for ``native_scan``'s operands:
    x [B, H, T, D], e, s [B, H, T, K], a [B, H, T, 1 | K, D] and b [H, K, D] (the log decay a * b;
    broadcast views allowed), m0 and m_T [B N, H, K, D] (m0 may be None), cu None (one document a
    row) or the N documents' bounds of the B = 1 row. float32 or float64, CUDA (or the CPU under
    Triton's interpreter). ``keep``: whether the memories are kept for a backward (else an empty
    tensor: at T 32K, D 1536, K 16 they are 200 MB a batch row in float32)."""
    k = _Call(x, e, s, a, b, m0, cu)
    y = x.new_empty(k.B, k.H, k.T, k.D)
    m_T = x.new_zeros(k.B * k.docs, k.H, k.K, k.D)
    starts = x.new_empty(k.B, k.H, k.blocks, k.K, k.D) if keep else x.new_empty(0)
    outputs = (y, m_T, starts if keep else y)
    k.launch(_scan_forward_kernel, outputs, (k.T, k.H, k.K, k.D), reverse=False, KEEP=keep)
    return y, m_T, starts


@triton_scan.register_fake
def _(x, e, s, a, b, m0, cu, keep):
    B, H, T, D = x.shape
    K, docs = e.shape[-1], 1 if cu is None else cu.shape[0] - 1
    blocks = (T + STEPS - 1) // STEPS
    starts = x.new_empty(B, H, blocks, K, D) if keep else x.new_empty(0)
    return x.new_empty(B, H, T, D), x.new_empty(B * docs, H, K, D), starts


@torch.library.custom_op("lcsm::triton_scan_backward", mutates_args=())
def triton_scan_backward(
    x: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    m0: Tensor | None,
    cu: Tensor | None,
    starts: Tensor,
    gy: Tensor,
    gm_T: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``triton_scan``'s inputs x, e, s, a, b and m0 (zeros when m0 is None), of
    the views it was given (autograd sums them to each input's shape)."""
    k = _Call(x, e, s, a, b, m0, cu, backward=True)
    B, H, T, K, D = k.B, k.H, k.T, k.K, k.D
    gy = gy.contiguous()
    gm_T = None if gm_T is None else gm_T.contiguous()
    dx, da = x.new_empty(B, H, T, D), x.new_empty(B, H, T, a.shape[3], D)
    de, ds = x.new_zeros(k.groups, B, H, T, K), x.new_zeros(k.groups, B, H, T, K)
    # db's shares, one per (batch * head, segment), and the initial states' gradients (zeros for
    # the rows no document starts in)
    db, dm0 = x.new_empty(B, H, k.S, K, D), x.new_zeros(B * k.docs, H, K, D)
    inputs, outputs = (starts, gy, _or(gm_T, gy)), (dx, de, ds, da, db, dm0, T, B, H, K, D)
    k.launch(_scan_backward_kernel, inputs, outputs, reverse=True, HAS_DMT=gm_T is not None)
    return dx, de.sum(0), ds.sum(0), da, db.sum((0, 2)), dm0


@triton_scan_backward.register_fake
def _(x, e, s, a, b, m0, cu, starts, gy, gm_T):
    return scan_gradients_like(x, e, a, cu)


def _setup_context(ctx, inputs, output):
    x, e, s, a, b, m0, cu, keep = inputs
    if not keep:
        raise RuntimeError("triton_scan: a backward needs the memories the forward kept (keep=True)")
    # the kept memories take no gradient, and an unused output's is None, not a tensor of zeros
    # (the kept memories' would be [B, H, T / 16, K, D])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, e, s, a, b, m0, cu, output[2])


def _backward(ctx, gy, gm_T, _):
    x, e, s, a, b, m0, cu, starts = ctx.saved_tensors
    gy = gy if gy is not None else torch.zeros_like(x)
    dx, de, ds, da, db, dm0 = triton_scan_backward(x, e, s, a, b, m0, cu, starts, gy, gm_T)
    return dx, de, ds, da, db, dm0 if m0 is not None else None, None, None


triton_scan.register_autograd(_backward, setup_context=_setup_context)


def eos_triton_scan(p: EOSProblem, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Mode "triton" with a full K x D decay: y [B, H, T, D] and the final states (m_T [B, H, K, D],
    or with ``cu_seqlens`` each document's [N, H, K, D], from its own initial state p.m0) for a
    problem ``eos._triton_unsupported`` accepts."""
    x, e, s, a, b = scan_operands(p)
    operands = (x, e, s, a, b) if p.m0 is None else (x, e, s, a, b, p.m0)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in operands)
    y, m_T, _ = triton_scan(x, e, s, a, b, p.m0, cu_seqlens, keep)
    return y, m_T
