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
recurrence for one token (decoding). S4 proper keeps the dense (diagonal plus low-rank) A of
HiPPO-LegS; its bilinear A_bar is a dense N x N matrix, a psi = "x" (matrix) oscillation that the
elementwise EOS operator cannot express, so ``s4.py`` implements both of its forms itself: the
S4 kernel algorithm (Cauchy kernel + Woodbury identity at roots of unity, then an inverse FFT) and
the dense step loop x_t = A_bar x_{t-1} + B_bar u_t.

What is "the mixer": the official S4/S4D/DSS *layer* (kernel convolution + D skip + activation +
output linear) and S5's SSM + activation/gate. The block around it (norm, residual, dropout) is
the block's job and dropout is left out (a mixer must be deterministic for the contract tests).

Packed sequences (``cu_seqlens``): a convolution with one kernel cannot restart its memory at a
document boundary, so ``PaddedDocuments`` lays the documents out as a batch of padded rows, by
index arithmetic, and the FFT form runs once on it. Right-padded rows give the outputs (the map is
causal: zeros after a document cannot reach its outputs) from each document's initial state;
left-padded rows give the final states (zeros before a document leave a zero state at zero, so
the row ends in the document's own final state from zero), to which the initial state's share,
A_bar^L x_0 for a document of L tokens, is added (exp(L log A_bar) for the diagonal systems,
repeated squaring of the dense A_bar for S4). TNN and CES use the same (``time_invariant_eos``).
The cost is that of one batch of N rows of the longest document's length (two with final
states): at most about one sequence's FFT for documents of similar lengths, up to N times it
when one document holds most of the row. The
one-pass alternative, ``eos``'s chunk form with ``cu_seqlens``, is exact too but far slower for
these systems (S4D layer, d_model 64, T 2048 in 8 equal documents, forward and backward on one
CPU thread: 8.8 s, against 26 ms for the padded batch and 0.30 s for the row as one sequence by
FFT; 83 ms with one document of 1024 tokens and seven of 128); it serves the modes that are not
FFT (``mode`` "chunk", "parallel", "recurrent").

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


# ----------------------------------------------------------------------------- packed sequences


class PaddedDocuments:
    """The N documents of a packed row of T tokens as N padded rows of the longest length L, by index
    arithmetic (``cu_seqlens`` int64 [N + 1], as ``packing.documents`` returns it)."""

    def __init__(self, cu_seqlens: Tensor, T: int):
        self.lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [N]
        j = torch.arange(int(self.lengths.max()), device=cu_seqlens.device)
        starts, lengths = cu_seqlens[:-1, None], self.lengths[:, None]
        self.valid = j < lengths  # [N, L]: the slots of a right-padded row that hold a token
        # Token of each slot, T (a zero row appended to the table) for padding.
        self.right_index = torch.where(self.valid, starts + j, T)
        pad = j.numel() - lengths
        self.left_index = torch.where(j >= pad, starts + j - pad, T)

    @staticmethod
    def _gather(u: Tensor, index: Tensor) -> Tensor:
        return torch.cat([u[0], u.new_zeros(1, *u.shape[2:])])[index]

    def right(self, u: Tensor) -> Tensor:
        """u [1, T, ...] -> [N, L, ...], each document first in its row, zeros after it."""
        return self._gather(u, self.right_index)

    def left(self, u: Tensor) -> Tensor:
        """u [1, T, ...] -> [N, L, ...], each document last in its row, zeros before it."""
        return self._gather(u, self.left_index)

    def unpad(self, y: Tensor) -> Tensor:
        """Outputs of right-padded rows [N, L, ...] -> the packed row [1, T, ...]."""
        return y[self.valid].unsqueeze(0)


def time_invariant_eos(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    log_o: Tensor,
    *,
    mode: str,
    initial_state: Tensor | None,
    output_final_state: bool,
    real_output: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``lcsm.ops.eos`` of a time-invariant system (data-independent e, s and log_o [H, K|1, D|1]).
    A packed row i [1, T, H, D] (``cu_seqlens`` int64 [N + 1]) in modes "auto" and "fft" runs
    through ``PaddedDocuments`` (see the module docstring); everything else is ``eos`` itself.
    Returns (y [B, T, H, D], final states [B or N, H, K, D] or None)."""
    if cu_seqlens is None or mode not in ("auto", "fft"):
        return eos(
            i,
            e,
            s,
            log_o,
            mode=mode,
            initial_state=initial_state,
            output_final_state=output_final_state,
            real_output=real_output,
            cu_seqlens=cu_seqlens,
        )
    docs = PaddedDocuments(cu_seqlens, i.shape[1])
    y, _ = eos(docs.right(i), e, s, log_o, mode=mode, initial_state=initial_state, real_output=real_output)
    m = None
    if output_final_state:
        _, m = eos(docs.left(i), e, s, log_o, mode=mode, output_final_state=True, real_output=real_output)
        if initial_state is not None:
            steps = docs.lengths.to(log_o.real.dtype).view(-1, 1, 1, 1)
            m = m + (steps * log_o).exp() * initial_state
    return docs.unpad(y), m


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
        y, m = time_invariant_eos(
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
        # squeeze, not y[..., 0]: its backward is a view, where select's fills a zero tensor of y's size
        return (self.real_factor * y.squeeze(-1) + self.D * u).to(u.dtype), m

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, self.d_model, self.modes, 1, dtype=self._memory_dtype(True), device=self.log_dt.device
            )
        )

    def _run(self, x: Tensor, state: SSMState | None, return_state: bool, cu_seqlens: Tensor | None):
        cu_seqlens = self.check_call(x, cu_seqlens)
        memory = state.memory if state is not None else None
        return self.ssm(x, memory, return_state, cu_seqlens)
