"""CES: the complex exponential smoothing module of ETSMLP (Chu, 2024), section 3.1.

Per channel c (no mixing across channels), with lambda^alpha written e^q:

    m_t = e^q m_{t-1} + (1 - e^q) x_t,     y_t = Re(e^beta m_t) + omega x_t          (eq. 7, 10, 13)

i.e. the long convolution y = k * x + omega x with k_j = Re(e^beta (1 - e^q) e^{j q}) (eq. 9-10).
As an EOS recurrence (LCSM eq. 2-3) each channel is a head with K = D = 1: input x_t, expand
1 - e^q, oscillation e^q (complex, data-independent), shrink e^beta. ``lcsm.ops.eos`` evaluates it:
by FFT (mode auto picks it for a time-invariant system whenever T > 1), the same kernel as the
official ``complex_kernal``; by the recurrence when decoding one token. On the CPU, eager, the
causal complex mixer runs the recurrence in a native C kernel instead (``CES._native``).

Parameterisation (section 3.1 and the official ``CETS``, version "normal"), all per channel and
stored as real pairs (re, im):
  * ``log_delta`` = lambda' = log(log lambda) (exponential parameterisation, Proposition 1);
  * ``alpha`` = (a0, a1), the damping exponent alpha = e^{a0} + i e^{a1} (log dt);
  * q = exp(lambda') * alpha = alpha log lambda = log(lambda^alpha);
  * constraint (eq. 12): if |e^q| > max_lambda, Re q is lowered so that |e^q| = max_lambda;
  * ``beta`` complex, output scale e^beta; ``omega`` real skip weight.
Init ("ring", LRU style): lambda uniform on the ring r_min <= |lambda| <= r_max with phase in
[0, max_phase]; a0 = a1 = log dt, dt ~ logUniform[dt_min, dt_max]; beta ~ N(0, 0.2^2) per part;
omega ~ N(0, 1). "fixed" (the paper's "Stable(r, i)" of Table 4): lambda = fixed_point for every
channel, the rest as in ring.

Departures, and why:
  * Skip: y + omega x as in the official code; the paper's eq. 13 writes sigmoid(omega) x. The
    code produced the reported numbers, so we follow it.
  * field="real" keeps eq. 7 with lambda in (0, 1), alpha = e^a > 0 and e^beta real, under the
    same exponential parameterisation (lambda' = log(-log lambda) is then real). The official
    real branch instead uses decay 1 - sigmoid(delta) sigmoid(alpha) and scale sigmoid(delta) beta
    with N(1, 0.2) inits, which changes the parameterisation along with the field; we keep the
    ablation to the field alone.
  * Weight decay: the official recipe (fairseq Adam, wd 0.01) decays every parameter; following
    this library's convention for decay rates and skips (and S4/LRU practice) all four CES
    parameters are tagged ``no_weight_decay``.
  * Bidirectional (section 3.1, eq. 14, official "dss method"): the official code convolves with
    K = pad(k1, (0, L)) + pad(flip(k2), (L, 0)) on length 2L, i.e.
    y_t = sum_{s<=t} k1_{t-s} x_s + sum_{s>t} k2_{s-t-1} x_s. We evaluate the same sum as two
    causal EOS problems in one call: channels [x, shift(flip(x))] with kernels [k1, k2].

Packed sequences (``cu_seqlens``, causal mode): the FFT form once on the documents as padded rows
(``_ssm.PaddedDocuments``; the cost of N rows of the longest document, twice with final states).
The bidirectional mode takes right-padded rows with ``lengths`` instead.

Shape glossary: B batch, T time, d = d_model channels, C kernel channels (d, or 2d when
bidirectional).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_bool, check_choice, check_float
from lcsm.ops import eos, native_diag_scan, native_serves

from ._ssm import time_invariant_eos
from .base import EOSRow, Mixer, State, no_weight_decay, register
from .packing import documents

Tensor = torch.Tensor

FIELDS = ("complex", "real")
INITS = ("ring", "fixed")


@dataclass
class CESState(State):
    """memory: the smoothed value m_t of every channel [B, d, 1, 1] (complex for field="complex")."""

    memory: Tensor


@register("ces", "etsmlp_ces")
class CES(Mixer):
    """ETSMLP's complex exponential smoothing token mixer (the CES module only, no MLP).

    Args:
        d_model: number of channels d.
        field: "complex" (the paper) or "real" (Table 3 ablation "Real").
        use_alpha, use_beta, use_omega: keep the damped factor alpha, the output scale e^beta and
            the skip omega x (Table 3 ablations "No alpha / No beta / No omega" set them False).
        init: "ring" or "fixed" (Table 4).
        r_min, r_max, max_phase: the ring of the "ring" init (defaults: the ListOps config).
        fixed_point: (re, im) of lambda for the "fixed" init (Table 4's best "Stable(0.5, 0)").
        dt_min, dt_max: range of the log-uniform dt that initialises alpha.
        max_lambda: bound of |lambda^alpha| enforced by the constraint function (eq. 12).
        bidirectional: two-sided kernel (non-causal; no recurrent state or decoding); a model sets
            it from its own ``bidirectional`` field.
    """

    float32_parameters = ("log_delta", "alpha", "beta")
    # ETSMLP eq. 14: one two-sided kernel rather than two causal maps.
    native_bidirectional = True
    model_owned_options = ("bidirectional",)

    def __init__(
        self,
        d_model: int,
        field: str = "complex",
        use_alpha: bool = True,
        use_beta: bool = True,
        use_omega: bool = True,
        init: str = "ring",
        r_min: float = 0.6,
        r_max: float = 0.9,
        max_phase: float = 2 * math.pi,
        fixed_point: tuple[float, float] = (0.5, 0.0),
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        max_lambda: float = 0.9999,
        bidirectional: bool = False,
    ):
        super().__init__(d_model)
        self.field = check_choice("field", field, FIELDS)
        self.complex = field == "complex"
        self.use_alpha = check_bool("use_alpha", use_alpha)
        self.use_beta = check_bool("use_beta", use_beta)
        self.use_omega = check_bool("use_omega", use_omega)
        self.bidirectional = check_bool("bidirectional", bidirectional)
        self.init = check_choice("init", init, INITS)
        r_min = check_float("r_min", r_min, 0, 1, low_open=True)
        r_max = check_float("r_max", r_max, 0, 1, low_open=True)
        if r_min > r_max:
            raise ValueError(f"r_min: expected r_min <= r_max, got r_min={r_min}, r_max={r_max}")
        max_phase = check_float("max_phase", max_phase, 0, 2 * math.pi)
        dt_min = check_float("dt_min", dt_min, 0, low_open=True)
        dt_max = check_float("dt_max", dt_max, 0, low_open=True)
        if dt_min > dt_max:
            raise ValueError(f"dt_min: expected dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
        self.max_lambda = check_float("max_lambda", max_lambda, 0, 1, low_open=True)
        if (
            not isinstance(fixed_point, (tuple, list))
            or len(fixed_point) != 2
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in fixed_point)
        ):
            raise ValueError(f"fixed_point: expected (re, im) of lambda, got {fixed_point!r}")
        fixed = complex(fixed_point[0], fixed_point[1])
        if init == "fixed" and not 0 < abs(fixed) < 1:
            raise ValueError(f"fixed_point: lambda must lie inside the unit disc without 0, got {fixed_point!r}")
        if init == "fixed" and not self.complex and (fixed.imag != 0 or fixed.real <= 0):
            raise ValueError(f"fixed_point: field='real' needs a real lambda in (0, 1), got {fixed_point!r}")

        C = 2 * d_model if self.bidirectional else d_model
        self.kernel_channels = C
        pair = (C, 2) if self.complex else (C,)
        with torch.no_grad():
            log_lambda = self._init_log_lambda(C, r_min, r_max, max_phase, fixed)  # complex [C]
            # complex: lambda' = log(log lambda) on the principal branch, as the official code stores
            # it; real: log(-log lambda)
            log_delta = torch.view_as_real(log_lambda.log()) if self.complex else (-log_lambda.real).log()
            self.log_delta = no_weight_decay(nn.Parameter(log_delta.to(torch.get_default_dtype()).contiguous()))
            if self.use_alpha:
                log_dt = math.log(dt_min) + torch.rand(C) * (math.log(dt_max) - math.log(dt_min))
                # alpha = e^{a0} + i e^{a1} with a0 = a1 = log dt (official: log dt tiled over the pair).
                alpha = log_dt.unsqueeze(-1).repeat(1, 2) if self.complex else log_dt
                self.alpha = no_weight_decay(nn.Parameter(alpha.contiguous()))
            if self.use_beta:
                self.beta = no_weight_decay(nn.Parameter(torch.randn(pair) * 0.2))
            if self.use_omega:
                self.omega = no_weight_decay(nn.Parameter(torch.randn(d_model)))

    def _init_log_lambda(self, C: int, r_min: float, r_max: float, max_phase: float, fixed: complex) -> Tensor:
        """log lambda [C] (complex128) for the chosen init."""
        if self.init == "fixed":
            return torch.full((C,), fixed, dtype=torch.complex128).log()
        u1 = torch.rand(C, dtype=torch.float64)
        u2 = torch.rand(C, dtype=torch.float64)
        # |lambda|^2 uniform on [r_min^2, r_max^2]: uniform over the ring's area (LRU, lemma 3.2).
        log_r = 0.5 * torch.log(u1 * (r_max**2 - r_min**2) + r_min**2)
        theta = max_phase * u2 if self.complex else torch.zeros_like(u2)
        return torch.complex(log_r, theta)

    # ------------------------------------------------------------------ kernel

    def log_decay(self) -> Tensor:
        """q = log(lambda^alpha) per kernel channel [C] after the max-lambda constraint (eq. 12);
        complex for field="complex", real (negative) for field="real"."""
        if self.complex:
            q = torch.view_as_complex(self.log_delta).exp()
            if self.use_alpha:
                q = q * torch.view_as_complex(self.alpha.exp())
            bound = math.log(self.max_lambda)
            # |e^q| = e^{Re q}: rescaling lambda^alpha onto |.| = max_lambda lowers Re q to log(max).
            return torch.complex(torch.clamp(q.real, max=bound), q.imag)
        q = -self.log_delta.exp()
        if self.use_alpha:
            q = q * self.alpha.exp()
        return torch.clamp(q, max=math.log(self.max_lambda))

    def scale(self) -> Tensor | None:
        """e^beta per kernel channel [C] (None without beta)."""
        if not self.use_beta:
            return None
        return torch.view_as_complex(self.beta).exp() if self.complex else self.beta.exp()

    def eos_parameters(self) -> tuple[Tensor, Tensor, Tensor]:
        """(e [C, 1], s [C, 1], log_o [C, 1, 1]) for ``lcsm.ops.eos`` with one head per kernel channel,
        so that the EOS kernel sum_k s o^j e is k_j = e^beta (1 - e^q) e^{j q} (before Re)."""
        q = self.log_decay()
        e = -torch.expm1(q)  # 1 - e^q
        s = self.scale()
        if s is None:
            s = torch.ones_like(e)
        return e.unsqueeze(-1), s.unsqueeze(-1), q.view(-1, 1, 1)

    def kernel(self, length: int) -> Tensor:
        """The convolution kernel k_j = Re(e^beta (1 - e^q) e^{j q}), j < length, as [C, length]."""
        q = self.log_decay()
        j = torch.arange(length, dtype=self.log_delta.dtype, device=self.log_delta.device)
        k = -torch.expm1(q).unsqueeze(-1) * (q.unsqueeze(-1) * j).exp()
        s = self.scale()
        if s is not None:
            k = s.unsqueeze(-1) * k
        return k.real if k.is_complex() else k

    # ------------------------------------------------------------------ interface

    def _no_state(self, what: str):
        raise ValueError(
            f"{what}: CES with bidirectional=True is non-causal (each output reads future inputs), so it "
            "has no recurrent state and cannot decode step by step; use bidirectional=False"
        )

    def forward(
        self,
        x: Tensor,
        state: CESState | None = None,
        return_state: bool = False,
        lengths: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, d] -> y [B, T, d] (and the final CESState when asked; causal mode only).
        ``lengths`` [B]: right-padded sequences; the positions past each length enter the kernel
        as zeros, as the official ``CETS`` masks its input before the FFT, so that the backward
        direction carries no padding into a valid position (the outputs at padded positions
        are not meaningful). ``cu_seqlens``: packed documents (causal mode only)."""
        self.check_input(x)
        if self.bidirectional and (state is not None or return_state):
            self._no_state("state")
        memory = state.memory if state is not None else None
        if cu_seqlens is not None:
            if self.bidirectional:
                raise ValueError(
                    "cu_seqlens: CES with bidirectional=True reads each document's future, which the "
                    "packed form does not serve; pass right-padded rows with lengths instead"
                )
            if lengths is not None:
                raise ValueError("lengths: right-padded rows and cu_seqlens (packed documents) exclude each other")
            cu_seqlens = documents(x, cu_seqlens)
        e, s, log_o = self.eos_parameters()
        u = x
        if lengths is not None:
            if lengths.shape != (x.shape[0],):
                raise ValueError(f"lengths: expected [B] = [{x.shape[0]}], got {list(lengths.shape)}")
            valid = torch.arange(x.shape[1], device=x.device) < lengths.to(x.device)[:, None]  # [B, T]
            u = x * valid.unsqueeze(-1).to(x.dtype)
        if self.bidirectional:
            # Backward direction: y_t += sum_{s>t} k2_{s-t-1} x_s is a causal convolution of the
            # time-reversed input delayed by one step.
            back = F.pad(u.flip(1), (0, 0, 1, 0))[:, : u.shape[1]]
            i = torch.cat([u, back], dim=2).unsqueeze(-1)  # [B, T, 2d, 1]
            y, _ = eos(i, e, s, log_o, real_output=True)
            d = self.d_model
            y = y[:, :, :d, 0] + y[:, :, d:, 0].flip(1)
            memory = None
        elif self._native(u, cu_seqlens):
            initial = None if memory is None else memory.reshape(memory.shape[0], -1)
            y, last = native_diag_scan(u, log_o.reshape(-1).exp(), e.reshape(-1), s.reshape(-1), initial)
            memory = last.reshape(*last.shape, 1, 1) if return_state else None
        else:
            y, memory = time_invariant_eos(
                u.unsqueeze(-1),
                e,
                s,
                log_o,
                mode="auto",
                initial_state=memory,
                output_final_state=return_state,
                real_output=True,
                cu_seqlens=cu_seqlens,
            )
            y = y.squeeze(-1)
        if self.use_omega:
            y = y + self.omega * x
        y = y.to(x.dtype)
        if return_state:
            return y, CESState(memory=memory)
        return y

    def _native(self, u: Tensor, cu_seqlens: Tensor | None) -> bool:
        """Whether the causal recurrence runs in the native CPU kernel (``lcsm.ops.native_diag_scan``,
        C source lcsm/ops/_native/diag.h: a pass over time per block of channels): complex
        field, unpacked float32/float64 CPU rows, eager, and the kernel built (not with
        ``LCSM_NATIVE=0`` or without a C compiler); otherwise ``eos`` takes it (by FFT)."""
        return self.complex and cu_seqlens is None and native_serves(u)

    def step(self, x_t: Tensor, state: CESState):
        if self.bidirectional:
            self._no_state("step")
        return super().step(x_t, state)

    def init_state(self, batch_size: int) -> CESState:
        if self.bidirectional:
            self._no_state("init_state")
        return CESState(
            memory=torch.zeros(
                batch_size, self.d_model, 1, 1, dtype=self._memory_dtype(self.complex), device=self.log_delta.device
            )
        )

    def state_size(self, seq_len: int) -> int:
        if self.bidirectional:
            self._no_state("state_size")
        return super().state_size(seq_len)

    def describe(self) -> EOSRow:
        field = "complex" if self.complex else "real"
        return EOSRow(
            name="CES (ETSMLP)" + (", bidirectional (non-causal)" if self.bidirectional else ""),
            input="x_t",
            expand="1 - lambda^alpha",
            oscillation=f"lambda^alpha ({field}, per channel)",
            shrink="exp(beta), real part kept" if self.use_beta else "1, real part kept",
            memory=f"K x D = 1 x 1 per channel, {self.d_model} channels ({field})",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="ETSMLP (Chu, 2024), section 3.1 eq. 7-14",
        )
