"""Linear time-invariant state-space mixers: S4 (NPLR), S4D, S5 and DSS (LCSM Table 1, section 2.3).

This module holds what they share (the state, the option checks, the dt init, complex parameters,
the diagonal SISO base); each mixer is in the file named by its registry name (``s4.py``,
``s4d.py``, ``s5.py``, ``dss.py``), the HiPPO matrices in ``_hippo.py``.

Each is a continuous SSM x'(t) = A x(t) + B u(t), y = C x + D u, discretised with step Delta and
run as the discrete recurrence x_t = A_bar x_{t-1} + B_bar u_t, y_t = C x_t + D u_t. Because the
system does not depend on the input, the same map is the causal long convolution y = K * u + D u
with K_j = C A_bar^j B_bar, which is how the papers train them.

The diagonal ones (S4D, S5, DSS) are EOS recurrences with a complex, data-independent oscillation
and are evaluated by ``lcsm.ops.eos``: mode "auto" takes the FFT path for any T > 1 and the
recurrence for one token (decoding). Packed sequences (``cu_seqlens``) take ``eos``'s chunk form
instead, one pass over the row with the memory restarted at each document: a convolution with one
kernel cannot restart, and the chunk form costs O(T C K) per channel against the FFT's
O(T log T + T K) (C = the chunk size). S4 proper keeps the dense (diagonal plus low-rank) A of
HiPPO-LegS; its bilinear A_bar is a dense N x N matrix, a psi = "x" (matrix) oscillation that the
elementwise EOS operator cannot express, so ``s4.py`` implements both of its forms itself: the
S4 kernel algorithm (Cauchy kernel + Woodbury identity at roots of unity, then an inverse FFT) and
the dense step loop x_t = A_bar x_{t-1} + B_bar u_t.

What is "the mixer": the official S4/S4D/DSS *layer* (kernel convolution + D skip + activation +
output linear) and S5's SSM + activation/gate. The block around it (norm, residual, dropout) is
the block's job and dropout is left out (a mixer must be deterministic for the contract tests).

Conjugate symmetry: S4, S4D and S5 keep one eigenvalue of each conjugate pair (N/2 complex modes
for a state of size N) and take 2 Re(.) of the output, as their official code does; DSS keeps N
modes and takes Re(.) with no factor 2, as its official code does.

Shape glossary: B batch, T time, H = d_model channels, N = d_state, N2 = N // 2 complex modes,
P = S5 state size (d_state), P2 = P // 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_float, check_int
from lcsm.ops import eos

from .base import Mixer, State
from .packing import check_document_state, documents

Tensor = torch.Tensor


@dataclass
class SSMState(State):
    """memory: the complex EOS memory [B, H, K, D] of a diagonal SSM (its modes' states)."""

    memory: Tensor


# ----------------------------------------------------------------------------- option checks


def check_even(name: str, value) -> int:
    check_int(name, value, 2)
    if value % 2:
        raise ValueError(f"{name}: expected an even integer (modes come in conjugate pairs), got {value!r}")
    return value


def check_dt(dt_min, dt_max) -> tuple[float, float]:
    check_float("dt_min", dt_min, 0, low_open=True)
    check_float("dt_max", dt_max, 0, low_open=True)
    if dt_min > dt_max:
        raise ValueError(f"dt_min: expected dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    return float(dt_min), float(dt_max)


# ----------------------------------------------------------------------------- shared pieces


def log_dt_init(shape, dt_min: float, dt_max: float) -> Tensor:
    """log Delta ~ Uniform[log dt_min, log dt_max] (S4, S4D, DSS, S5 all use this)."""
    return math.log(dt_min) + torch.rand(shape, dtype=torch.float64) * (math.log(dt_max) - math.log(dt_min))


def param_dtype() -> torch.dtype:
    """Parameters are built in float64 and stored in the default dtype (as nn.Linear is)."""
    return torch.get_default_dtype()


def complex_param(z: Tensor) -> nn.Parameter:
    """A complex tensor stored as real (re, im) pairs [..., 2] in the default dtype, as the official
    codes do (Adam's moments are then per real component)."""
    return nn.Parameter(torch.view_as_real(z.to(torch.promote_types(param_dtype(), torch.complex64))).contiguous())


def as_complex(p: Tensor) -> Tensor:
    return torch.view_as_complex(p)


def gelu_glu(y: Tensor, linear: nn.Linear) -> Tensor:
    """The S4 layer's output: GELU, then a position-wise Linear(H, 2H) and a GLU."""
    return F.glu(linear(F.gelu(y)), dim=-1)


class DiagonalSISO(Mixer):
    """A bank of H single-input single-output diagonal SSMs on EOS: one head per channel
    (H = d_model heads, D = 1, K = ``self.modes`` complex modes). Subclasses give e (= B_bar),
    s (= C) and log_o (= log A_bar) per head and the factor on the real part."""

    real_factor = 2.0

    def eos_parameters(self) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def ssm(
        self,
        u: Tensor,
        memory: Tensor | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """The SSM convolution with the D skip: u [B, T, H] -> (y [B, T, H], memory [B, H, K, 1] or
        None; [N, H, K, 1], one row per document, with ``cu_seqlens``)."""
        e, s, log_o = self.eos_parameters()
        y, m = eos(
            u.unsqueeze(-1),
            e,
            s,
            log_o,
            mode=self.mode,
            initial_state=memory,
            output_final_state=return_state,
            real_output=True,
            cu_seqlens=cu_seqlens,
        )
        return (self.real_factor * y[..., 0] + self.D * u).to(u.dtype), m

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, self.d_model, self.modes, 1, dtype=self._memory_dtype(True), device=self.log_dt.device
            )
        )

    def _run(self, x: Tensor, state: SSMState | None, return_state: bool, cu_seqlens: Tensor | None):
        self.check_input(x)
        memory = state.memory if state is not None else None
        if cu_seqlens is not None:
            cu_seqlens = documents(x, cu_seqlens)
            if memory is not None:
                check_document_state("state.memory", memory, cu_seqlens.numel() - 1)
        return self.ssm(x, memory, return_state, cu_seqlens)
