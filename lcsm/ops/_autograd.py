"""``first_order``: the mark of a hand-written backward pass that gives first-order gradients only."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def first_order(backward: Callable) -> Callable:
    """``backward`` (of a ``torch.autograd.Function``) refusing to run under ``create_graph=True``.

    The operators' backward passes are written by hand: C kernels, and products of tensors the
    forward formed, which autograd never saw. A graph of such a backward would leave out the
    second-order terms, and torch's ``once_differentiable`` only hangs an error node on its outputs
    that ``torch.autograd.grad(..., inputs=...)`` never reaches: a Hessian-vector product came out
    silently wrong (1.1 relative error through the chunk form). So differentiating a gradient
    (Hessian-vector products, gradient penalties) through one of them is an error, raised where it
    is asked for."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{backward.__qualname__.split('.')[0].lstrip('_')}: second-order gradients (a backward pass "
                "with create_graph=True) are not supported by this kernel's hand-written backward; the "
                "operators' modes 'recurrent' and 'parallel' are plain autograd and support them (with "
                "LCSM_NATIVE=0 for the layers' native kernels)"
            )
        return backward(ctx, *grads)

    wrapper.first_order = True
    return wrapper
