"""FFT form of the EOS operator for time-invariant systems (S4, DSS, TNN, ETSMLP's CES).

When e, s and o do not depend on t, the recurrence is a causal long convolution::

    y_t = sum_{j=0}^{t-1} k_j * i_{t-j} + sum_k s * o^t * m_0,    k_j = sum_k s * o^j * e   [D]

The kernel costs O(T K D) to build; the convolution is O(T log T) per channel by FFT on a length
of at least 2T (zero padding makes the circular convolution causal and exact; ``conv_length``).
"""

from __future__ import annotations

import math

import torch

from ._autograd import first_order
from ._host_heap import prime_host_heap
from ._inputs import EOSProblem, finite_log


def _powers(p: EOSProblem, start: int, stop: int) -> torch.Tensor:
    """o^j for j in [start, stop) as [1, H, L, Kg, Dg] (ones when there is no oscillation).

    o^j = o^(start + a S) o^b with S ~ sqrt(L): two tables of about sqrt(L) exps and one product per
    entry, since an exp (complex above all) costs several times a product; each entry is still
    two exps and a product away from exact, with no power accumulated step by step."""
    n = stop - start
    dtype = p.i.real.dtype if p.i.is_complex() else p.i.dtype
    g = p.g_full  # a separable pair as its [1, H, 1, K, D] sum
    if g is None:
        return torch.ones(1, p.H, n, 1, 1, dtype=p.i.dtype, device=p.i.device)
    g = finite_log(g)  # o = 0 (log_o = -inf) would make o^0 = exp(-inf * 0)
    # Traced, n is symbolic and has no integer square root: one table of n exps, exact as well.
    S = 1 if torch.compiler.is_compiling() else max(1, math.isqrt(n))
    a = torch.arange(-(-n // S), device=p.i.device, dtype=dtype) * S + start
    b = torch.arange(S, device=p.i.device, dtype=dtype)
    coarse = (g * a.view(1, 1, -1, 1, 1)).exp().unsqueeze(3)  # [1, H, A, 1, Kg, Dg]
    fine = (g * b.view(1, 1, -1, 1, 1)).exp().unsqueeze(2)  # [1, H, 1, S, Kg, Dg]
    return (coarse * fine).flatten(2, 3)[:, :, :n]


def _over_k(powers: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_k powers[.., t, k, d] x[.., k, d]: powers [1, H, L, Kg, Dg], x [B|1, H, K, D|1] ->
    [B|1, H, L, D|1]. A decay shared by the columns (Dg = 1) makes it a product over K, so the
    [L, K, D] terms are never formed (TNN's K x D is 512 x 3 d_model)."""
    if powers.shape[-1] == 1:
        if powers.shape[-2] == 1:
            x = x.sum(-2, keepdim=True)
        return torch.einsum("htk,bhkd->bhtd", powers[0, ..., 0], x)
    return (powers * x.unsqueeze(2)).sum(-2)


# The primes of fast FFT lengths (``fft_length``): pocketfft, torch's CPU FFT, has radices for them;
# a length with a larger prime factor takes a slower general algorithm (128 rows, one thread: the
# inverse real FFT of 16385 = 5 x 29 x 113 points 80 ms, of 16807 = 7^5 15 ms, of 16384 3 ms).
_FFT_PRIMES = (2, 3, 5, 7, 11)


def fft_length(n: int) -> int:
    """The smallest length >= n with no prime factor but 2, 3, 5, 7 and 11 (n itself for a power of
    two; at most 3% above n from n = 500)."""
    m = max(1, n)
    while True:
        rest = m
        for p in _FFT_PRIMES:
            while rest % p == 0:
                rest //= p
        if rest == 1:
            return m
        m += 1


def conv_length(T: int) -> int:
    """The FFT length of a causal convolution of T steps: ``fft_length(2T)`` (2T for every power
    of two; any length >= 2T - 1 is exact), and 2T + 2 under torch.compile, where T is symbolic:
    at 2T the real transform's backward takes its bins between the first and the last, T - 1 of
    them, and the tracer guards that count against 1, a second graph for T = 2."""
    return 2 * T + 2 if torch.compiler.is_compiling() else fft_length(2 * T)


def fft_conv(kernel: torch.Tensor, i: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The circular convolution of kernel and i along ``dim`` on length n by FFT (complex if either
    is, else real)."""
    if kernel.is_complex() or i.is_complex():
        return torch.fft.ifft(torch.fft.fft(kernel, n=n, dim=dim) * torch.fft.fft(i, n=n, dim=dim), n=n, dim=dim)
    return torch.fft.irfft(torch.fft.rfft(kernel, n=n, dim=dim) * torch.fft.rfft(i, n=n, dim=dim), n=n, dim=dim)


def causal_fft_conv(kernel: torch.Tensor, i: torch.Tensor, dim: int) -> torch.Tensor:
    """y_t = sum_{j <= t} kernel_j i_(t-j) for t < T along ``dim`` (kernel and i of length T there,
    broadcasting elsewhere), by FFT on length ``conv_length(T)``. Real operands in eager mode take
    ``CausalRealFFTConv``'s backward; complex ones, and every traced call, autograd's. The first
    CPU call primes glibc's heap as ``eos``'s does (``_host_heap``): the long-convolution layers
    (S4, whose kernel's blocks are a few MiB each, S4D, CES, TNN) otherwise map and fault in their
    buffers afresh on every call in a process that keeps glibc's initial thresholds."""
    prime_host_heap(i)
    T = i.shape[dim]
    n = conv_length(T)
    if kernel.is_complex() or i.is_complex() or torch.compiler.is_compiling():
        return fft_conv(kernel, i, n, dim).narrow(dim, 0, T)
    return CausalRealFFTConv.apply(kernel, i, n, dim)


class CausalRealFFTConv(torch.autograd.Function):
    """``causal_fft_conv`` of real operands with a backward of real transforms only. The gradients are
    the correlations dkernel_j = sum_t dy_t i_(t-j) and di_s = sum_t dy_t kernel_(t-s), products of
    spectra the forward already has: one transform of dy and two inverse ones. Autograd's backward
    of ``rfft`` zero-pads each gradient to length n and takes a complex transform of it, twice, where
    this one's are real (a few times the work, and the padded copies' fills)."""

    @staticmethod
    def forward(ctx, kernel: torch.Tensor, i: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        K, X = torch.fft.rfft(kernel, n=n, dim=dim), torch.fft.rfft(i, n=n, dim=dim)
        ctx.save_for_backward(K, X)
        ctx.n, ctx.dim, ctx.lengths = n, dim, (kernel.shape[dim], i.shape[dim])
        return torch.fft.irfft(K * X, n=n, dim=dim).narrow(dim, 0, i.shape[dim])

    @staticmethod
    @first_order
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        K, X = ctx.saved_tensors
        n, dim = ctx.n, ctx.dim
        DY = torch.fft.rfft(dy, n=n, dim=dim)

        def correlation(spectrum: torch.Tensor, like: torch.Tensor, length: int) -> torch.Tensor:
            # summed over the dims ``like`` broadcasts along, in the frequency domain (fewer bins
            # to invert than summing the result)
            product = (spectrum.conj() * DY).sum_to_size(like.shape)
            return torch.fft.irfft(product, n=n, dim=dim).narrow(dim, 0, length)

        d_kernel = correlation(X, K, ctx.lengths[0]) if ctx.needs_input_grad[0] else None
        d_i = correlation(K, X, ctx.lengths[1]) if ctx.needs_input_grad[1] else None
        return d_kernel, d_i, None, None


def eos_fft(
    p: EOSProblem, real_output: bool = False, final_state: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [B, H, T, D] and m_T [B, H, K, D] (None unless final_state). With real_output and a real
    input, y is the real part only, Re(k * i) = Re(k) * i: a real convolution, half the work of the
    complex one."""
    B, H, T, K, D = p.B, p.H, p.T, p.K, p.D
    powers = _powers(p, 0, T)  # [1, H, T, Kg, Dg]
    kernel = _over_k(powers, (p.s * p.e)[:, :, 0]).expand(1, H, T, D)
    i = p.i
    if real_output and p.i_real is not None:
        kernel, i = kernel.real, p.i_real
    if torch.compiler.is_compiling():
        # Traced, the transforms run along the last dimension, time moved there: on a CPU an FFT
        # along another dimension returns (and its backward passes on) strides other than the
        # contiguous ones the tracer assumes, and a view in the traced backward then fails.
        kernel, i = kernel.transpose(2, 3).contiguous(), i.transpose(2, 3).contiguous()
        y = causal_fft_conv(kernel, i, -1).transpose(2, 3)
    else:
        y = causal_fft_conv(kernel, i, 2)
    m_T = None
    if final_state:
        # m_T = o^T m_0 + sum_s o^(T-s) e i_s; the powers o^(T-s) are powers[T-s] reversed.
        back = powers.flip(2)
        if back.shape[-1] == 1:
            m_T = p.e[:, :, 0] * torch.einsum("htk,bhtd->bhkd", back[0, ..., 0], p.i)
        else:
            m_T = (back * p.e * p.i.unsqueeze(-2)).sum(2)
        m_T = m_T.expand(B, H, K, D)
    if p.m0 is not None:
        from_start = _powers(p, 1, T + 1)  # o^t, t = 1..T
        y = y + _over_k(from_start, p.s[:, :, 0] * p.m0)
        if final_state:
            m_T = m_T + from_start[:, :, -1] * p.m0
    return y, m_T
