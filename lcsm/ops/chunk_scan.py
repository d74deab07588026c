"""The chunk mode's ``elementwise`` kernel, with its adjoint (linear in T).

For everything the ``matmul`` kernel does not take: a full K x D decay (Mamba), K x D expand or
shrink states, a separable decay (its two factors multiplied out a block at a time), and a decay given as a product of
operands, log_o = a * b, formed one block of steps at a time. Per chunk, the recurrence
m_t = o_t * m_{t-1} + e_t (x) i_t runs step by step over [B, H, K, D] (exact for any decay): on a
CPU in blocks of steps whose memories fit in ``_blocks.BLOCK_BYTES`` (elsewhere a block is the
chunk), each block's shrink one batched product while they are in cache. Only the memory at chunk ends is
kept.

Backward: each chunk is recomputed from its saved start memory, in reverse chunk order, and the
adjoint recurrence (LCSM appendix 5.1, Type 1) runs over that chunk alone, in the forward's
blocks (``scan_chunk_backward``). Memory:
O(T (K + D) + (T / C) K D), not O(T K D).

Names: i [B, H, c, D] the input, e and s [B|1, H, c|1, K, D|1] the expand and shrink states, o
the decay as factors exp(log_o) (or a ``LogProduct`` of log_o's operands), m the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ._autograd import first_order
from ._blocks import block_steps
from ._inputs import LogProduct

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- elementwise kernel


_LOG2_E = math.log2(math.e)


def _exp(x: Tensor, in_place: bool = False) -> Tensor:
    """exp(x), written over x when ``in_place``. A real x goes as exp2(x log2 e): on this
    project's CPU (AVX-512, torch 2.13) float32 exp ran 2-3.5x slower than exp2 on arguments near
    -0.5 (a Mamba block's decays) and 19x slower on arguments spread over [-100, 0]
    (bench/results/mamba_s4.md); the extra rounding of x log2 e (relative error up to 4e-6 at
    |x| = 100 in float32) is of the size of the rounding that forms log_o = a * b itself."""
    if x.is_complex():
        return x.exp_() if in_place else x.exp()
    return (x.mul_(_LOG2_E) if in_place else x.mul(_LOG2_E)).exp2_()


def _time_slice(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    """Steps start..stop of a [B|1, H, T|1, ...] tensor (a time-shared one serves every step)."""
    if x is None or x.shape[2] == 1:
        return x
    return x[:, :, start:stop]


def _grad_for(x: Tensor, grad: Tensor) -> Tensor:
    """A gradient reduced to the (broadcast) shape of x, real where x is real."""
    if grad.is_complex() and not x.is_complex():
        grad = grad.real
    return grad.sum_to_size(x.shape)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt) @ b.to(dt)


def _contract_k(a: Tensor, h: Tensor) -> Tensor:
    """sum_k a[.., k, d] h[.., k, d] for a [.., K, D|1] and h [.., K, D] -> [.., D]; a batched
    vector-matrix product when a is a K-vector (no [.., K, D] temporary)."""
    if a.shape[-1] == 1:
        return _matmul(a.transpose(-1, -2), h).squeeze(-2)
    return (a * h).sum(-2)


def _promoted(*xs: Tensor | None) -> torch.dtype:
    dt = xs[0].dtype
    for x in xs[1:]:
        if x is not None:
            dt = torch.promote_types(dt, x.dtype)
    return dt


def _recur(i: Tensor, e: Tensor, o: list[Tensor], h: Tensor, out: Tensor, x: Tensor) -> Tensor:
    """``h_t = o_t * h_{t-1} + e_t (x) i_t`` for the n steps of i [B, H, n, D] (e and the decay
    factors o sliced alike) from the memory h, written into out[:, :, :n]; returns the last
    memory, a view of out. The inputs e_t (x) i_t of all n steps are formed first, in one
    operation, into x [B, H, >= n, K, D], and a decay of two factors is multiplied out for the
    block, so that each step is one operation: at small memories (batch 1) each operation costs
    more to dispatch than to compute (bench/results/mamba_s4.md). h may be out's last slot: a step reads the memory
    before it and writes its own slot, in place when they are the same."""
    n = i.shape[2]
    x = x[:, :, :n]
    torch.mul(e, i.unsqueeze(-2), out=x)
    factor = o[0] if len(o) == 1 else _product(o)
    xs, outs = x.unbind(2), out.unbind(2)
    factors = None if factor is None else factor.unbind(2) if factor.shape[2] > 1 else [factor[:, :, 0]] * n
    for t in range(n):
        if factors is None:
            torch.add(xs[t], h, out=outs[t])
        else:
            torch.addcmul(xs[t], factors[t], h, out=outs[t])
        h = outs[t]
    return h


def _product(factors: list[Tensor]) -> Tensor | None:
    """The decay o as one tensor from its factors (None for no decay)."""
    if not factors:
        return None
    o = factors[0]
    for factor in factors[1:]:
        o = o * factor
    return o


def _block_ranges(c: int, b: int) -> list[tuple[int, int]]:
    return [(a, min(a + b, c)) for a in range(0, c, b)]


# The elementwise kernel's decay ``o`` is a list of factors [B|1, H, c|1, K|1, D|1] whose product
# is o (none, one, or a separable pair's two), or a LogProduct of operands in that layout whose
# product is log o, from which each block forms its own factor exp(a * b) in cache.
Decay = list[Tensor] | LogProduct


def _operands(o: Decay) -> list[Tensor]:
    """The tensors the decay's gradients are taken for: its factors, or a product's a and b."""
    return [o.a, o.b] if isinstance(o, LogProduct) else list(o)


def _decay_slice(o: Decay, start: int, stop: int) -> Decay:
    """The decay of steps start..stop."""
    if isinstance(o, LogProduct):
        return LogProduct(_time_slice(o.a, start, stop), _time_slice(o.b, start, stop))
    return [_time_slice(f, start, stop) for f in o]


@dataclass(frozen=True)
class _FormedProduct(LogProduct):
    """One chunk's product with its factor exp(a * b) [B|1, H, c|1, K, D] formed (``_formed_once``)."""

    factor: Tensor


def _formed_once(o: Decay, i: Tensor, e: Tensor, m: Tensor) -> Decay:
    """The decay the backward's two passes over a chunk read (``_memories``, then
    ``scan_chunk_backward``): a product's factor formed once for both when the chunk is a single
    block, where each pass would form all of it again (at batch 1 the exp is a large part of the
    work); per block, in cache, otherwise."""
    if not isinstance(o, LogProduct):
        return o
    B, H, c, D = i.shape
    if block_steps(B, H, e.shape[3], D, _promoted(m, e, i, o.a, o.b), i.device, c) < c:
        return o
    return _FormedProduct(o.a, o.b, _block_factors(o, 0, c)[0])


def _block_factors(o: Decay, start: int, stop: int) -> list[Tensor]:
    """The factors of steps start..stop, a product's exp(a * b) formed for those steps alone."""
    if isinstance(o, _FormedProduct):
        return [_time_slice(o.factor, start, stop)]
    if isinstance(o, LogProduct):
        return [_exp(torch.mul(_time_slice(o.a, start, stop), _time_slice(o.b, start, stop)), in_place=True)]
    return _decay_slice(o, start, stop)


def _decay_grads(o: Decay, start: int, stop: int, dG: Tensor) -> list[tuple[int, Tensor]]:
    """(index in ``_operands(o)``, gradient before reduction) for steps start..stop given
    dG = dlog_o there: every factor's log takes dG (their logs add); a product's a takes
    dG conj(b) and b takes dG conj(a) (PyTorch's convention for complex inputs)."""
    if isinstance(o, LogProduct):
        a, b = _time_slice(o.a, start, stop), _time_slice(o.b, start, stop)
        return [(0, dG * b.conj()), (1, dG * a.conj())]
    return [(j, dG) for j in range(len(o))]


def scan_chunk(i: Tensor, e: Tensor, s: Tensor, o: Decay, m: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of the elementwise kernel: i [B, H, c, D], e/s [B|1, H, c|1, K, D|1], o a list of
    decay factors [B|1, H, c|1, K|1, D|1] whose product is the decay (exp(log_o); two for a
    separable pair, none for no decay) or a LogProduct of the log decay's operands, m [B, H, K, D]
    -> (y [B, H, c, D], the memory after the chunk [B, H, K, D]).

    ``h_t = o_t * h_{t-1} + e_t (x) i_t`` step by step is the recurrence itself: exact for any
    decay, with no cumulative product to overflow or cancel. The steps run in blocks (on a CPU,
    those whose memories fit in BLOCK_BYTES; ``block_steps``), each block followed by its shrink
    as one batched product, so the shrink reads memories still in cache: with a large batch a
    block is one step (the kernel is bound by memory traffic, and a chunk's [c, K, D] memories
    would make a round trip to main memory), with small memories a block is the whole chunk (few,
    large operations: the cost per operation then dominates), each step one operation
    (``_recur``). A separable decay's two factors are multiplied out one block at a time rather
    than into a materialised [B, H, T, K, D] tensor; a product's
    factor exp(a * b) is formed for each block as it runs. No autograd: ``scan_chunk_backward`` is
    its adjoint.
    """
    B, H, c, D = i.shape
    dtype = _promoted(m, e, i, *_operands(o))
    b = block_steps(B, H, e.shape[3], D, dtype, i.device, c)
    buffer = i.new_empty(B, H, b, e.shape[3], D, dtype=dtype)
    x = torch.empty_like(buffer)
    h, ys = m, []
    for a, z in _block_ranges(c, b):
        h = _recur(i[:, :, a:z], _time_slice(e, a, z), _block_factors(o, a, z), h, buffer, x)
        ys.append(_contract_k(_time_slice(s, a, z), buffer[:, :, : z - a]))
    return torch.cat(ys, 2), h.clone()


def _memories(i: Tensor, e: Tensor, o: Decay, m: Tensor) -> Tensor:
    """The memories h [B, H, c, K, D] after each step of a chunk, for its backward, in the
    forward's blocks (a product's factors formed block by block)."""
    B, H, c, D = i.shape
    hs = i.new_empty(B, H, c, e.shape[3], D, dtype=_promoted(m, e, i, *_operands(o)))
    h, b = m, block_steps(B, H, e.shape[3], D, hs.dtype, i.device, c)
    x = hs.new_empty(B, H, b, e.shape[3], D)
    for a, z in _block_ranges(c, b):
        h = _recur(i[:, :, a:z], _time_slice(e, a, z), _block_factors(o, a, z), h, hs[:, :, a:z], x)
    return hs


def _grad_outer(x: Tensor, A: Tensor, w: Tensor) -> Tensor:
    """The gradient of x [.., K, D|1] in a term x[.., k, d] w[.., d] whose adjoint is A [.., K, D]:
    sum_d A[.., k, d] w[.., d] when x is a K-vector, A * w otherwise, before reduction to x's shape."""
    if x.shape[-1] == 1:
        # As a row vector times A^T: CPU batched products with the vector on the right, A @ w,
        # ran about 6x slower at B 64, K 64, D 128 (1.0 ms against 0.17 ms, torch 2.13).
        return _matmul(w.unsqueeze(-2), A.mT).mT
    return A * w.unsqueeze(-2)


class _BlockGrads:
    """The gradient of an input x [B|1, H, c|1, ...] of one chunk, given block by block: ``out``
    is the chunk's slice of a per-step x's gradient buffer, written in place; None for a
    time-shared x, whose blocks are summed."""

    def __init__(self, x: Tensor, out: Tensor | None) -> None:
        self.x, self.out, self.total = x, out, None

    def slot(self, a: int, z: int, like: Tensor) -> Tensor | None:
        """The buffer's slice for steps a..z when a gradient shaped and typed like ``like`` can be
        written there as it is (no reduction, no real part); else None."""
        if self.out is None or self.out.dtype != like.dtype or self.out[:, :, a:z].shape != like.shape:
            return None
        return self.out[:, :, a:z]

    def add(self, a: int, z: int, grad: Tensor) -> None:
        if self.out is not None:
            part = self.out[:, :, a:z]
            part.copy_(_grad_for(part, grad))
        else:
            grad = _grad_for(self.x, grad)
            self.total = grad if self.total is None else self.total + grad

    def result(self) -> Tensor:
        return self.total if self.out is None else self.out


def scan_chunk_backward(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    o: Decay,
    m: Tensor,
    hs: Tensor,
    dy: Tensor,
    dm: Tensor,
    out: dict[str | int, Tensor | None],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], Tensor]:
    """The adjoint of ``scan_chunk`` (appendix 5.1, Type 1, restricted to one chunk), by the
    reverse-time recurrence ``dh_t = conj(o_{t+1}) dh_{t+1} + conj(s_t) dy_t``; with it
    ``dlog_o_t = conj(o_t) dh_t conj(h_{t-1})`` (reduced to each factor's shape: the factors
    multiply, so their logs add), ``de_t = dh_t conj(i_t)``, ``di_t = sum_k dh_t conj(e_t)`` and
    ``ds_t = dy_t conj(h_t)`` (PyTorch's conjugate convention for complex inputs); a product's
    operands then take dlog_o conj(b) and dlog_o conj(a) (``_decay_grads``). The recurrence
    runs step by step in the forward's blocks, from the last, and each block's gradients follow
    as batched products while its dh are in cache. hs are the chunk's memories (``_memories``);
    ``out`` maps "i", "e", "s" and each decay operand's index (``_operands``) to the chunk's slice
    of its gradient buffer, None for a time-shared input. Returns (di, de, ds, the operands'
    gradients, dm for the chunk's start memory), a per-step input's gradient being its ``out``
    slice."""
    B, H, c, D = i.shape
    K = e.shape[3]
    dY = dy.unsqueeze(-2)  # [B, H, c, 1, D]
    ec, sc, ic = e.conj(), s.conj(), i.conj()
    operands = _operands(o)
    grads = {
        "i": _BlockGrads(i, out["i"]),
        "e": _BlockGrads(e, out["e"]),
        "s": _BlockGrads(s, out["s"]),
        **{j: _BlockGrads(x, out[j]) for j, x in enumerate(operands)},
    }
    # A real memory read by complex s or dy takes the real part of its adjoint (two ops a step).
    real_part = not hs.is_complex() and (sc.is_complex() or dy.is_complex())
    b = block_steps(B, H, K, D, hs.dtype, hs.device, c)
    dH = hs.new_empty(B, H, b, K, D)
    dC = hs.new_empty(B, H, b, K, D) if operands else dH  # conj(o_t) dh_t, the carry into step t - 1
    carry = dm
    for a, z in reversed(_block_ranges(c, b)):
        n = z - a
        # As in the forward (``_recur``), one operation a step: the block's conj(s_t) dy_t formed
        # first, the decay multiplied out, dh_t = conj(o_(t+1)) dh_(t+1) + conj(s_t) dy_t in place,
        # and the carries conj(o_t) dh_t in one operation after the loop.
        if real_part:
            dH[:, :, :n].copy_((dY[:, :, a:z] * _time_slice(sc, a, z)).real)
        else:
            torch.mul(dY[:, :, a:z], _time_slice(sc, a, z), out=dH[:, :, :n])
        oc = _product([factor.conj() for factor in _block_factors(o, a, z)])
        steps = dH[:, :, :n].unbind(2)
        steps[n - 1].add_(carry)
        factors = None if oc is None else oc.unbind(2) if oc.shape[2] > 1 else [oc[:, :, 0]] * n
        for j in reversed(range(n - 1)):
            if factors is None:
                steps[j].add_(steps[j + 1])
            else:
                steps[j].addcmul_(factors[j + 1], steps[j + 1])
        if oc is not None:
            torch.mul(dH[:, :, :n], oc, out=dC[:, :, :n])
        # With no decay dC is dH, which the next block overwrites before reading its carry.
        carry = dC[:, :, 0] if operands else dC[:, :, 0].clone()
        grads["i"].add(a, z, _contract_k(_time_slice(ec, a, z), dH[:, :, :n]))
        grads["e"].add(a, z, _grad_outer(e, dH[:, :, :n], ic[:, :, a:z]))
        grads["s"].add(a, z, _grad_outer(s, hs[:, :, a:z].conj(), dy[:, :, a:z]))
        if operands:
            # A single factor's dlog_o goes straight into its buffer when it needs no reduction.
            direct = grads[0].slot(a, z, dC[:, :, :n]) if not isinstance(o, LogProduct) and len(o) == 1 else None
            dG = direct if direct is not None else torch.empty_like(dC[:, :, :n])
            torch.mul(dC[:, :, 1:n], hs[:, :, a : z - 1].conj(), out=dG[:, :, 1:])
            torch.mul(dC[:, :, 0], (hs[:, :, a - 1] if a > 0 else m).conj(), out=dG[:, :, 0])
            if direct is None:
                for j, grad in _decay_grads(o, a, z, dG):
                    grads[j].add(a, z, grad)
    d_operands = [grads[j].result() for j in range(len(operands))]
    return grads["i"].result(), grads["e"].result(), grads["s"].result(), d_operands, carry.clone()


def chunk_elementwise(
    i: Tensor, e: Tensor, s: Tensor, o: Decay, m0: Tensor | None, C: int
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The ``elementwise`` kernel over the whole sequence: i [B, H, T, D], e and s
    [B|1, H, T|1, K, D|1], o the decay factors [B|1, H, T|1, K|1, D|1] or a LogProduct of the log
    decay's operands, m0 [B, H, K, D] or None, chunks of C steps; returns y [B, H, T, D], m_T
    [B, H, K, D] and the chunks' start memories (N of [B, H, K, D])."""
    B, H, T, D = i.shape
    K = e.shape[3]
    M = m0 if m0 is not None else i.new_zeros(B, H, K, D)
    ys, states = [], []
    for start in range(0, T, C):
        stop = min(start + C, T)
        states.append(M)
        y_c, M = scan_chunk(
            i[:, :, start:stop],
            _time_slice(e, start, stop),
            _time_slice(s, start, stop),
            _decay_slice(o, start, stop),
            M,
        )
        ys.append(y_c)
    return torch.cat(ys, 2), M, states


class ChunkElementwiseFunction(torch.autograd.Function):
    """``chunk_elementwise`` whose backward recomputes one chunk at a time from its saved start
    memory and runs ``scan_chunk_backward`` over it, in reverse chunk order. The decay comes as up
    to two log tensors, g_a and g_b: a separable pair's row and column parts, whose exps multiply
    (g_b None for a single log), or with ``product`` the operands of log_o = g_a * g_b, saved as
    they are, exp(g_a * g_b) formed block by block in the forward and again in the backward (once
    for a chunk of one block, ``_formed_once``)."""

    @staticmethod
    def forward(
        ctx: Any,
        i: Tensor,
        e: Tensor,
        s: Tensor,
        g_a: Tensor | None,
        g_b: Tensor | None,
        m0: Tensor | None,
        C: int,
        product: bool,
    ) -> tuple[Tensor, Tensor]:
        logs = [x for x in (g_a, g_b) if x is not None]
        if product:
            decay = logs  # saved as they are, formed again in the backward
            y, m_T, states = chunk_elementwise(i, e, s, LogProduct(g_a, g_b), m0, C)
        else:
            decay = [_exp(x) for x in logs]  # the factors exp(g), formed once and saved
            y, m_T, states = chunk_elementwise(i, e, s, decay, m0, C)
        ctx.save_for_backward(i, e, s, m0, *decay, *states)
        ctx.C, ctx.operands, ctx.product = C, len(decay), product
        return y, m_T

    @staticmethod
    @first_order
    def backward(ctx: Any, dy: Tensor | None, dm_T: Tensor | None) -> tuple[Tensor | None, ...]:
        i, e, s, m0, *saved = ctx.saved_tensors
        # the decay factors exp(g) or a product's operands
        operands, states = saved[: ctx.operands], saved[ctx.operands :]
        C = ctx.C
        T = i.shape[2]
        dM = torch.zeros_like(states[-1]) if dm_T is None else dm_T
        dy = torch.zeros_like(i) if dy is None else dy
        # Each operand's gradient has its shape: dlog_o of o = exp(log_o), factor by factor, or a
        # product's da and db.
        full = {"i": i, "e": e, "s": s, **dict(enumerate(operands))}
        # A per-step input's gradient is written chunk by chunk into one buffer; a time-shared
        # input's (time dimension 1) is summed over the chunks.
        buffers = {name: None if name != "i" and x.shape[2] == 1 else torch.empty_like(x) for name, x in full.items()}
        sums = dict.fromkeys(full)
        for n in reversed(range(len(states))):
            start, stop = n * C, min(n * C + C, T)
            part = {name: _time_slice(x, start, stop) for name, x in full.items()}
            out = {name: _time_slice(buf, start, stop) for name, buf in buffers.items()}
            decay = [part[j] for j in range(len(operands))]
            if ctx.product:
                decay = _formed_once(LogProduct(*decay), part["i"], part["e"], states[n])
            hs = _memories(part["i"], part["e"], decay, states[n])
            di, de, ds, d_operands, dM = scan_chunk_backward(
                part["i"], part["e"], part["s"], decay, states[n], hs, dy[:, :, start:stop], dM, out
            )
            for name, grad in zip(full, (di, de, ds, *d_operands), strict=False):
                if buffers[name] is None:
                    sums[name] = grad if sums[name] is None else sums[name] + grad
        grads = [sums[name] if buffers[name] is None else buffers[name] for name in full]
        dg = grads[3:] + [None] * (2 - len(operands))
        dm0 = None if m0 is None else _grad_for(m0, dM)
        return (*grads[:3], *dg, dm0, None, None)


# ----------------------------------------------------------------------------- traced form


def traced_elementwise(
    i: Tensor, e: Tensor, s: Tensor, log_o: Tensor | None, m0: Tensor | None, C: int
) -> tuple[Tensor, Tensor]:
    """The elementwise kernel's y [B, H, T, D] and m_T [B, H, K, D] under torch.compile, where
    its loop over steps (one operation per step, written into views by ``out=``) would fix T in
    the graph and the tracer refuses ``out=`` into views. i [B, H, T, D], e and s
    [B|1, H, T|1, K, D|1], log_o [B|1, H, T|1, K|1, D|1] (None: o = 1; a separable pair or a
    product given as the sum or product of its parts), m0 [B, H, K, D] or None.

    Chunks of C steps (one all-padding chunk more than needed, as in ``chunk_matmul._chunked``, so
    that the chunk count is not 1 for short sequences: padding steps have no input and decay 1):
    within each chunk the recurrence m_t = o_t * m_{t-1} + e_t (x) i_t composes associatively, so
    ceil(log2 C) doubling steps give every step's memory from a zero chunk start and the decay
    since it; across chunks ``chunk_matmul._doubling_states`` carries the chunk-start memories.
    Exact (sums of the same products in another order); differentiated by autograd, which keeps
    the [B, H, T, K, D] memories of every level, so this serves graphs that must compile whole,
    not long sequences."""
    from .chunk_matmul import _doubling_states, traced_chunk_count

    B, H, T, D = i.shape
    K = e.shape[-2]
    N = traced_chunk_count(T, C)
    x = e * i.unsqueeze(-2)  # [B, H, T, K, D]
    a = torch.ones_like(x) if log_o is None else log_o.exp().expand(B, H, T, K, D)
    dt = torch.promote_types(x.dtype, a.dtype)
    pad = (0, 0, 0, 0, 0, N * C - T)
    x = torch.nn.functional.pad(x.to(dt), pad).reshape(B, H, N, C, K, D)
    a = torch.nn.functional.pad(a.to(dt), pad, value=1.0).reshape(B, H, N, C, K, D)
    step = torch.arange(C, device=i.device).view(C, 1, 1)
    by = 1
    while by < C:  # C is a Python int: ceil(log2 C) levels
        b_prev = torch.where(step >= by, x.roll(by, 3), 0.0)
        a_prev = torch.where(step >= by, a.roll(by, 3), 1.0)
        x, a = x + a * b_prev, a * a_prev
        by *= 2
    M = x.new_zeros(B, H, K, D) if m0 is None else m0.to(dt)
    starts, m_T = _doubling_states(x[:, :, :, -1], a[:, :, :, -1], M)
    h = x + a * starts.unsqueeze(3)  # [B, H, N, C, K, D]
    if s.shape[2] == 1:
        s_c = s.unsqueeze(3)
    else:
        s_c = torch.nn.functional.pad(s, (0, 0, 0, 0, 0, N * C - T)).reshape(*s.shape[:2], N, C, *s.shape[-2:])
    y = (s_c * h).sum(-2).reshape(B, H, N * C, D)[:, :, :T]
    return y, m_T
