"""``log_sigmoid_product`` (lcsm/ops/decay.py) against its plain twin: outputs and the gradients of
both factors under random cotangents, in float64 and float32, for the LCSM codes' factor shapes,
odd lengths and blocks of time steps that do not divide them, logits far beyond logsigmoid's
linear range, and clear errors for inputs it cannot serve."""

import pytest
import torch

from lcsm.ops import _blocks
from lcsm.ops.decay import log_sigmoid_product, log_sigmoid_product_reference
from lcsm.testing import assert_close, gradients

B, K, D = 2, 3, 5
# (a, b) per case; T is filled in. Codes 6-9 as the layer passes them, then both factors per-step
# and a factor shared over time but not over the batch.
SHAPES = {
    "code 6": ((B, "T", K, 1), (K, D)),
    "code 7": ((B, "T", 1, D), (K, D)),
    "code 8": ((K, 1), (B, "T", 1, D)),
    "code 9": ((B, "T", K, 1), (D,)),
    "both per-step": ((B, "T", K, D), (B, "T", 1, D)),
    "batch-shared over time": ((B, 1, K, D), (1, "T", K, 1)),
}


def factors(case, T, dtype, spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (spread * torch.randn(*(T if n == "T" else n for n in shape), generator=g, dtype=torch.float64))
        .to(dtype)
        .requires_grad_()
        for shape in SHAPES[case]
    ]


def compare(case, T, dtype, spread=1.0, tau=16.0):
    a, b = factors(case, T, dtype, spread)
    wrt = {"a": a, "b": b}
    fused = gradients({"log_o": log_sigmoid_product(a, b, tau)}, wrt)
    plain = gradients({"log_o": log_sigmoid_product_reference(a, b, tau)}, wrt)
    assert_close(fused, plain, dtype=dtype, context=f"{case}, T={T}, {dtype}")


@pytest.fixture(params=[1, 3, None], ids=["blocks of 1 step", "blocks of 3 steps", "one block"])
def block_steps(request, monkeypatch):
    """The time block of ``log_sigmoid_product`` (``_blocks.block_steps``, from BLOCK_BYTES): one
    step, three (not dividing the odd lengths) or the whole sequence."""
    if request.param is not None:
        row = B * K * D * 8  # one float64 step; a float32 block holds twice the steps
        monkeypatch.setattr(_blocks, "BLOCK_BYTES", request.param * row)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 13])
@pytest.mark.parametrize("case", SHAPES)
def test_equals_the_plain_expressions(case, T, dtype, block_steps):
    compare(case, T, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_logits_stay_finite_and_exact(dtype):
    """Logits of standard deviation 40: exp(-z) overflows float32 beyond 88, so a naive
    -log(1 + exp(-z)) would give inf where logsigmoid(z) is -z."""
    a, b = factors("code 8", 11, dtype, spread=40.0)
    assert (a.detach() * b.detach()).abs().max() > 100
    compare("code 8", 11, dtype, spread=40.0, tau=1.0)


def test_dtype_is_promoted_and_the_shape_is_the_broadcast():
    a = torch.randn(4, 6, 3, 1, dtype=torch.float32)
    b = torch.randn(3, 2, dtype=torch.float64)
    out = log_sigmoid_product(a, b, 2.0)
    assert out.shape == (4, 6, 3, 2) and out.dtype == torch.float64


def test_only_the_factors_that_need_it_get_a_gradient():
    a, b = factors("code 6", 5, torch.float64)
    b.requires_grad_(False)
    (da,) = torch.autograd.grad(log_sigmoid_product(a, b, 4.0).sum(), [a])
    (ref,) = torch.autograd.grad(log_sigmoid_product_reference(a, b, 4.0).sum(), [a])
    assert_close({"da": da}, {"da": ref})


@pytest.mark.parametrize(
    "a,b,tau,error,match",
    [
        (
            torch.randn(2, 3, 4, 1),
            torch.randn(5, 6),
            16.0,
            ValueError,
            r"a, b: .*broadcast to \[B, T, K, D\].*\[2, 3, 4, 1\].*\[5, 6\]",
        ),
        (torch.randn(3, 4, 1), torch.randn(4, 5), 16.0, ValueError, r"4-dim \[B, T, K, D\].*broadcast \[3, 4, 5\]"),
        (torch.randn(1, 2, 3, 4, 1), torch.randn(5), 16.0, ValueError, r"4-dim"),
        (
            torch.randn(2, 3, 4, 1, dtype=torch.complex64),
            torch.randn(4, 5),
            16.0,
            TypeError,
            r"a: .*real floating-point.*complex64",
        ),
        (
            torch.randn(2, 3, 4, 1),
            torch.ones(4, 5, dtype=torch.int64),
            16.0,
            TypeError,
            r"b: .*int64 with shape \[4, 5\]",
        ),
        (torch.randn(2, 3, 4, 1), torch.randn(4, 5), 0.0, ValueError, r"tau: expected a positive number.*0\.0"),
        (torch.randn(2, 3, 4, 1), torch.randn(4, 5), True, ValueError, r"tau: .*True"),
    ],
)
def test_clear_errors(a, b, tau, error, match):
    with pytest.raises(error, match=match):
        log_sigmoid_product(a, b, tau)
