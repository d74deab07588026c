"""Full K x D log decays built from two broadcast factors: ``log_o = logsigmoid(a * b) / tau``.

LCSM o codes 6-9 (Table 3, "inside the sigmoid") multiply a data-dependent vector by a learned
factor and take ``sigmoid(.)^(1/tau)`` of the product (section 2.4, "Data Dependency"):

    code 6   a = k_t [B, T, K, 1]          b = learned K x D [1, 1, K, D]
    code 7   a = d_t [B, T, 1, D]          b = learned K x D [1, 1, K, D]
    code 8   a = learned k [1, 1, K, 1]    b = d_t [B, T, 1, D]
    code 9   a = k_t [B, T, K, 1]          b = learned d [1, 1, 1, D]

The result is a [B, T, K, D] tensor, the elementwise kernel's full decay. Written as tensor
expressions (``log_sigmoid_product_reference``) the forward writes four tensors of that size (the
product, logsigmoid's output and its saved buffer, the quotient) and the backward as many again,
each a round trip to main memory (537 MB each in float32 at B 64, T 256, K 64, D 128, the LCSM
MQAR cell of 256 tokens at d_model 128). ``log_sigmoid_product`` computes the same numbers in
blocks of time steps that fit in the cache (the elementwise kernel's blocks,
``_blocks.block_steps``), writes only the output, saves only a and b, and recomputes the product
in the backward. bench/ops_bench.py, case ``decay``, times it against the expressions, alone and
in one layer (measurements: bench/results/eos_kernels.md).

Shape glossary: B batch, T time, K memory rows, D memory columns; a size-1 dim broadcasts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._autograd import first_order
from ._blocks import block_steps
from ._inputs import shape_str

Tensor = torch.Tensor


def log_sigmoid_product_reference(a: Tensor, b: Tensor, tau: float) -> Tensor:
    """``logsigmoid(a * b) / tau`` as plain tensor expressions (the twin the tests hold
    ``log_sigmoid_product`` to)."""
    return F.logsigmoid(a * b) / tau


def _check(a: Tensor, b: Tensor, tau: float) -> None:
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"{name}: expected a real floating-point tensor, got dtype {x.dtype} with shape {shape_str(x)}"
            )
    if a.device != b.device:
        raise ValueError(f"a, b: expected one device, got a on {a.device} and b on {b.device}")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau: expected a positive number (log_o = logsigmoid(a * b) / tau), got {tau!r}")
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ValueError(
            f"a, b: expected shapes that broadcast to [B, T, K, D], got a {shape_str(a)} and b {shape_str(b)}"
        ) from None
    if len(shape) != 4:
        raise ValueError(
            f"a, b: expected shapes that broadcast to a 4-dim [B, T, K, D], got a {shape_str(a)} "
            f"and b {shape_str(b)} (broadcast [{', '.join(map(str, shape))}])"
        )


def _four_dim(x: Tensor) -> Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def _steps(x: Tensor, start: int, stop: int) -> Tensor:
    """Time steps start..stop of a [B|1, T|1, K|1, D|1] factor (a time-shared one serves all)."""
    return x if x.shape[1] == 1 else x[:, start:stop]


class _LogSigmoidProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, tau: float) -> Tensor:
        shape = torch.broadcast_shapes(a.shape, b.shape)
        B, T, K, D = shape
        dtype = torch.promote_types(a.dtype, b.dtype)
        n = block_steps(B, 1, K, D, dtype, a.device, T)
        out = torch.empty(shape, dtype=dtype, device=a.device)
        work = torch.empty((B, n, K, D), dtype=dtype, device=a.device)
        for start in range(0, T, n):
            stop = min(start + n, T)
            z, y = work[:, : stop - start], out[:, start:stop]
            torch.mul(_steps(a, start, stop), _steps(b, start, stop), out=z)
            # logsigmoid(z) = min(z, 0) - log1p(exp(-|z|)): exp never overflows
            torch.clamp(z, max=0, out=y)
            y.sub_(z.abs_().neg_().exp_().log1p_()).div_(tau)
        ctx.save_for_backward(a, b)
        ctx.tau = tau
        return out

    @staticmethod
    @first_order
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        B, T, K, D = grad.shape
        n = block_steps(B, 1, K, D, grad.dtype, grad.device, T)
        dz = grad.new_empty(B, n, K, D)
        term = grad.new_empty(B, n, K, D)
        factors = (a, b)
        # a time-shared factor's gradient sums over the blocks; a per-step one is written block by block
        grads = [
            None if not ctx.needs_input_grad[j] else x.new_zeros(x.shape) if x.shape[1] == 1 else torch.empty_like(x)
            for j, x in enumerate(factors)
        ]
        for start in range(0, T, n):
            stop = min(start + n, T)
            g = dz[:, : stop - start]
            torch.mul(_steps(a, start, stop), _steps(b, start, stop), out=g)
            # d logsigmoid(z) / dz = sigmoid(-z)
            torch.sigmoid(g.neg_(), out=g).mul_(grad[:, start:stop]).div_(ctx.tau)
            for j, x in enumerate(factors):
                if grads[j] is None:
                    continue
                t = term[:, : stop - start]
                torch.mul(g, _steps(factors[1 - j], start, stop), out=t)
                part = t.sum_to_size(_steps(x, start, stop).shape)
                if x.shape[1] == 1:
                    grads[j].add_(part)
                else:
                    grads[j][:, start:stop].copy_(part)
        return grads[0], grads[1], None


def log_sigmoid_product(a: Tensor, b: Tensor, tau: float) -> Tensor:
    """``logsigmoid(a * b) / tau`` [B, T, K, D] for factors a, b that broadcast to it (up to 4 dims
    each, leading dims added as needed; time is dim 1), computed in cache-sized blocks of time steps
    with a backward that recomputes the product (module docstring). Equal to
    ``log_sigmoid_product_reference`` up to rounding; dtype: a's and b's promoted."""
    _check(a, b, tau)
    if torch.compiler.is_compiling():
        # traced: the plain form, differentiated by autograd (the blocked loop over time steps
        # would fix T in the graph, and the tracer refuses its ``out=`` writes into views)
        return log_sigmoid_product_reference(_four_dim(a), _four_dim(b), float(tau))
    return _LogSigmoidProduct.apply(_four_dim(a), _four_dim(b), float(tau))
