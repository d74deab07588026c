"""``causal_fft_conv``, the FFT form's long convolution: its real operands' backward
(``CausalRealFFTConv``: real transforms only) against the convolution's definition, a sum over
lags, in values and every gradient; complex operands take autograd's."""

import pytest
import torch

from lcsm.ops import causal_fft_conv
from lcsm.ops.fft import CausalRealFFTConv, conv_length, fft_length
from lcsm.testing import assert_close, gradients


def direct(kernel: torch.Tensor, i: torch.Tensor, dim: int) -> torch.Tensor:
    """y_t = sum_{j <= t} kernel_j i_(t - j), one lag at a time."""
    T = i.shape[dim]
    y = kernel.narrow(dim, 0, 1) * i
    for j in range(1, T):
        shifted = torch.cat([torch.zeros_like(i.narrow(dim, 0, j)), i.narrow(dim, 0, T - j)], dim)
        y = y + kernel.narrow(dim, j, 1) * shifted
    return y


# (kernel's shape, input's shape, dim): a kernel shared by the batch (S4's [H, T] against
# [B, H, T]), one per row, a kernel broadcast along a channel dim after time and an input
# broadcast along it (the FFT form's [1, H, T, D] against [B, H, T, 1]), a single step
CASES = [
    ((3, 13), (2, 3, 13), -1),
    ((2, 3, 13), (2, 3, 13), -1),
    ((1, 3, 17, 2), (2, 3, 17, 1), 2),
    ((1, 1), (2, 1, 1), -1),
]


def outputs_and_gradients(fn, kernel: torch.Tensor, i: torch.Tensor, dim: int) -> dict:
    wrt = {"kernel": kernel.detach().requires_grad_(), "i": i.detach().requires_grad_()}
    return gradients({"y": fn(wrt["kernel"], wrt["i"], dim)}, wrt)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex128])
@pytest.mark.parametrize("kernel_shape,input_shape,dim", CASES)
def test_matches_the_definition(kernel_shape, input_shape, dim, dtype):
    g = torch.Generator().manual_seed(0)
    kernel = torch.randn(kernel_shape, generator=g, dtype=dtype)
    i = torch.randn(input_shape, generator=g, dtype=dtype)
    assert_close(
        outputs_and_gradients(causal_fft_conv, kernel, i, dim),
        outputs_and_gradients(direct, kernel, i, dim),
        dtype,
        context=f"kernel {kernel_shape}, input {input_shape}, dim {dim}",
    )


def test_real_operands_take_the_real_backward():
    kernel, i = torch.randn(3, 9, requires_grad=True), torch.randn(2, 3, 9, requires_grad=True)
    assert type(causal_fft_conv(kernel, i, -1).grad_fn).__name__ == f"{CausalRealFFTConv.__name__}Backward"
    complex_kernel = torch.randn(3, 9, dtype=torch.complex64, requires_grad=True)
    assert "CausalRealFFTConv" not in type(causal_fft_conv(complex_kernel, i.to(torch.complex64), -1).grad_fn).__name__


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    kernel = torch.randn(1, 2, 7, 1, generator=g, dtype=torch.float64, requires_grad=True)
    i = torch.randn(3, 2, 7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda k, x: causal_fft_conv(k, x, 2), (kernel, i))


def _smooth(m: int) -> bool:
    """No prime factor above 11, by trial division."""
    for p in range(2, 12):
        while m % p == 0:
            m //= p
    return m == 1


def test_fft_length_is_the_smallest_fast_length():
    """fft_length(n): >= n, 11-smooth (pocketfft's radices) and the smallest such length; the
    convolution's length is 2T for a power of two and a fast length >= 2T otherwise."""
    for n in range(1, 400):
        m = fft_length(n)
        assert m >= n and _smooth(m), (n, m)
        assert not any(_smooth(k) for k in range(n, m)), (n, m)
    assert fft_length(16385) == 16464  # 16385 = 5 x 29 x 113; 16464 = 2^4 x 3 x 7^3
    assert [conv_length(T) for T in (512, 1023, 4097)] == [1024, 2048, 8232]
