"""``s4``: S4 (Gu, Goel & Re 2022), HiPPO-LegS in normal plus low-rank form; the Cauchy kernel
algorithm and the dense step loop.

A linear time-invariant state-space mixer: the family's shared pieces and shape glossary are in
``_ssm.py``, the HiPPO matrices in ``_hippo.py``; docs/zoo/ssm.md.

Packed sequences (``cu_seqlens``): S4's own form (kernel FFT, or the step loop) once on the
documents as padded rows (``_ssm.PaddedDocuments``), plus A_bar^L x_0 by repeated squaring for
final states; the cost of N rows of the longest document, twice with final states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_float, check_int
from lcsm.ops import autocast_off, causal_fft_conv, fft_length, first_order, native_s4_kernel, native_serves

from ._hippo import hippo_legs, hippo_normal_eig
from ._ssm import (
    PaddedDocuments,
    as_complex,
    check_dt,
    check_even,
    complex_param,
    gelu_glu,
    log_dt_init,
    param_dtype,
)
from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor

# Bits of a traced matrix power's exponent (``_matrix_power``): lengths below 2^32.
_POWER_BITS = 32


def _matrix_power(A: Tensor, n: int) -> Tensor:
    """A^n for square matrices A [.., N, N]: torch.linalg.matrix_power, which takes n as a Python
    integer; traced by torch.compile, where n derives from the symbolic sequence length and
    matrix_power would fix it in the graph, by repeated squaring over _POWER_BITS bits whose
    selection is a tensor (the same products as matrix_power's binary method, up to rounding)."""
    if not torch.compiler.is_compiling():
        return torch.linalg.matrix_power(A, n)
    torch._check(n < 1 << _POWER_BITS, lambda: f"S4 kernel length below 2^{_POWER_BITS}")
    bits = torch.full((), n, device=A.device)  # a tensor of the symbolic n (torch.as_tensor would fix it)
    result = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    for bit in range(_POWER_BITS):
        result = torch.where(((bits >> bit) & 1).bool(), result @ A, result)
        A = A @ A
    return result


# -2 pi i as one constant: torch.compile (2.13) fails on the product of a complex and a float literal
# (-2j * math.pi) inside a traced function, and traces a constant times a tensor.
_MINUS_TWO_PI_J = -2j * math.pi


S4_MODES = ("auto", "fft", "recurrent")


@dataclass
class S4State(State):
    """x: one half of the conjugate-symmetric S4 state [B, H, N/2] (complex); the other half is its
    conjugate, so these N real scalars per channel are the whole state."""

    x: Tensor


def krylov(v: Tensor, M: Tensor, length: int) -> Tensor:
    """Rows v M^j for j < length by repeated doubling: v [H, N], M [H, N, N] -> [H, length, N]."""
    rows, power = v.unsqueeze(1), M
    while rows.shape[1] < length:
        rows = torch.cat([rows, rows @ power], dim=1)
        power = power @ power
    return rows[:, :length]


# Entries of the [H, N2, columns] matrix that cauchy_conj forms at a time: a few MB, so that a block's
# temporaries stay in cache (S4 kernel, H 128, N 64, 16K tokens, forward and backward on one CPU
# core: 2.7 s at 2^19, 3.2 s at 2^21, 6.4 s at 2^23).
CAUCHY_BLOCK = 2**19


def _row_blocks(g: Tensor, n2: int, *others: Tensor):
    """Blocks of the roots of unity: g [H, M] and others [H, ..., M] split along their last dim."""
    cols = max(1, CAUCHY_BLOCK // (g.shape[0] * n2))
    return zip(*(x.split(cols, dim=-1) for x in (g,) + others), strict=False)


def _parts(g: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The real and imaginary parts of g [H, c] as [H, 1, c] tensors of ``dtype``."""
    return g.real.to(dtype).unsqueeze(1), g.imag.to(dtype).unsqueeze(1)


def _pair_inverse(g: Tensor, a: Tensor, s: Tensor) -> Tensor:
    """The real and imaginary parts of q = 1 / ((g - lam)(g - conj(lam))) = 1 / (g (g - 2 Re lam) +
    |lam|^2): g [H, c] complex, a = Re lam and s = |lam|^2 [H, N2] -> Q [2, H, N2, c] real, Q[0]
    the real part and Q[1] the imaginary. In real arithmetic (torch's complex elementwise
    operations cost several real ones each): with x = Re g - a the denominator is
    D = x^2 + (s - a^2 - (Im g)^2) + 2i x Im g and q = conj(D) / |D|^2. Nine passes over
    [H, N2, c]; Q's two halves are contiguous, so each part is written where the products below
    read it (no join) and the halves go through one batched product, batch 2H. The roots of unity
    run along the last dim: torch's CPU bmm runs [H, c, N2] @ [H, N2, 8] (8 output columns)
    several times slower than its transpose."""
    gr, gi = _parts(g, a.dtype)
    x = gr - a.unsqueeze(-1)
    d_r = ((s - a.square()).unsqueeze(-1) - gi.square()).addcmul_(x, x)
    d_i = x.mul_(gi * -2)
    r = d_r.square().addcmul_(d_i, d_i).reciprocal_()
    Q = a.new_empty(2, *d_r.shape)
    torch.mul(d_r, r, out=Q[0])
    torch.mul(d_i, r, out=Q[1])
    return Q


def _twice(x: Tensor) -> Tensor:
    """x [H, ...] repeated as [2H, ...]: an operand shared by the real and imaginary halves."""
    return x.expand(2, *x.shape).reshape(-1, *x.shape[1:])


def _halves(x: Tensor) -> Tensor:
    """[2, H, ...] as [2H, ...] (a view), the batch of one product over both halves."""
    return x.view(-1, *x.shape[2:])


class _CauchyConj(torch.autograd.Function):
    """S = q @ W with q = 1 / ((g - lam)(g - conj(lam))), computed and differentiated a block of
    roots of unity at a time in real arithmetic, recomputing q in the backward pass: autograd would
    keep several [H, M, N2] complex intermediates (gigabytes at 16K tokens) and spend most of S4's
    step on them. Internally transposed: q is [H, N2, M] and the products give [H, K, M]; the
    real and imaginary halves of each block are one [2, H, ...] tensor (``_pair_inverse``)."""

    @staticmethod
    def forward(ctx, g: Tensor, a: Tensor, s: Tensor, W: Tensor) -> Tensor:
        ctx.save_for_backward(g, a, s, W)
        H, N2, K = W.shape
        Wt = _twice(W.to(a.dtype).transpose(1, 2))  # [2H, K, N2]
        parts = []
        for (gb,) in _row_blocks(g, N2):
            St = torch.bmm(Wt, _halves(_pair_inverse(gb, a, s))).view(2, H, K, -1)
            parts.append(torch.complex(St[0], St[1]))  # W is real: the parts' products are S's parts
        return torch.cat(parts, dim=-1).transpose(1, 2)

    @staticmethod
    @first_order
    def backward(ctx, grad_S: Tensor):
        # Through q = 1 / D: the cotangent of D is t = -grad_q conj(q)^2, with D holomorphic in g
        # (dD/dg = 2 g - 2 a) and real-affine in a (dD/da = -2 g) and s (dD/ds = 1), so
        #   grad_g = 2 (conj(g) sum_n t - sum_n a t),  grad_a = -2 Re sum_m conj(g) t,  grad_s = Re sum_m t.
        # With u + 2i v = q^2 (u = q_r^2 - q_i^2, v = q_r q_i), the block holds T[0] = -Re t =
        # gq_r u + 2 gq_i v and T[1] = Im t / 2 = gq_r v - gq_i u / 2; the sums over n and over m
        # are batched products with [1, a] and [Re g | Im g, 1] (the factors -1, 2 applied to their
        # small results), where summing each product over a dim would be one more pass apiece.
        g, a, s, W = ctx.saved_tensors
        H, N2, K = W.shape
        Wr = _twice(W.to(a.dtype))  # [2H, N2, K]
        over_n = _twice(torch.stack([torch.ones_like(a), a], 1))  # [2H, 2, N2]
        grad_g, grad_a, grad_s, grad_Wt = [], 0, 0, 0
        for gb, Sb in _row_blocks(g, N2, grad_S.transpose(1, 2)):
            Q = _pair_inverse(gb, a, s)
            G = _halves(torch.stack([Sb.real, Sb.imag]).to(a.dtype))  # [2H, K, c]
            grad_Wt = grad_Wt + torch.bmm(G, _halves(Q).transpose(1, 2)).view(2, H, K, N2).sum(0)
            gq = torch.bmm(Wr, G).view(Q.shape)  # the cotangent of q, its two parts
            v = Q[0] * Q[1]
            u = Q[0].square_().addcmul_(Q[1], Q[1], value=-1)
            T = torch.empty_like(Q)
            torch.mul(gq[0], u, out=T[0]).addcmul_(gq[1], v, value=2)
            torch.mul(gq[0], v, out=T[1]).addcmul_(gq[1], u, value=-0.5)
            sums_n = torch.bmm(over_n, _halves(T)).view(2, H, 2, -1)  # [part, H, (1, a), c]
            t0_r, t1_r, t0_i, t1_i = -sums_n[0, :, 0], -sums_n[0, :, 1], 2 * sums_n[1, :, 0], 2 * sums_n[1, :, 1]
            gr, gi = gb.real.to(a.dtype), gb.imag.to(a.dtype)
            grad_g.append(2 * torch.complex(gr * t0_r + gi * t0_i - t1_r, gr * t0_i - gi * t0_r - t1_i))
            ones = torch.ones_like(gr)
            # as [2, c] @ [c, N2] products: with the two columns on the right, T @ [c, 2], torch's
            # CPU bmm ran 5x slower
            over_m = torch.stack([torch.stack([gr, ones], -2), torch.stack([gi, ones], -2)])  # [2, H, 2, c]
            sums_m = torch.bmm(_halves(over_m), _halves(T).transpose(1, 2)).view(2, H, 2, -1)  # [part, H, (g, 1), N2]
            grad_a = grad_a + 2 * sums_m[0, :, 0] - 4 * sums_m[1, :, 0]
            grad_s = grad_s - sums_m[0, :, 1]
        return torch.cat(grad_g, dim=1), grad_a, grad_s, grad_Wt.transpose(1, 2)


def _pole_parts(lam: Tensor) -> tuple[Tensor, Tensor]:
    """(a = Re lam, s = |lam|^2): the poles as the Cauchy sums over conjugate pairs take them."""
    return lam.real, lam.real.square() + lam.imag.square()


def cauchy_conj(W: Tensor, g: Tensor, lam: Tensor) -> Tensor:
    """Cauchy sums over conjugate pairs, S[h, m, k] = sum_n W[h, n, k] / ((g[h, m] - lam[h, n])
    (g[h, m] - conj(lam[h, n]))): W [H, N2, K] real, g [H, M] and lam [H, N2] complex -> [H, M, K],
    in PyTorch (_CauchyConj)."""
    return _CauchyConj.apply(g, *_pole_parts(lam), W)


def kernel_spectrum(W: Tensor, g: Tensor, c: Tensor, lam: Tensor) -> Tensor:
    """S4's kernel at the roots of unity from its four Cauchy sums by the Woodbury identity:
    K[h, m] = c_m (k_0 - k_1 k_2 / (1 + k_3)) with k_j = g S_j - S_(4+j), S = cauchy_conj(W, g, lam):
    W [H, N2, 8] real, g [H, M], c [M] and lam [H, N2] complex -> [H, M] (``S4._kernel`` says what
    each piece is), in PyTorch: the form of other devices and traced graphs (``_spectrum``). Eager
    CPU calls run the same sums and combination in the native kernel (``lcsm.ops.native_s4_kernel``,
    from the parameters; ``lcsm.ops.native_s4_spectrum`` from these operands)."""
    # the two halves of S by unbind, whose backward stacks their gradients, where two slices' would
    # each zero-fill an [H, M, 8] complex tensor (45 ms apiece at 16K)
    S_g, S_1 = cauchy_conj(W, g, lam).unflatten(-1, (2, 4)).unbind(-2)  # [H, M, 4] each
    k0, k1, k2, k3 = (g.unsqueeze(-1) * S_g - S_1).unbind(-1)
    return c * (k0 - k1 * k2 / (1 + k3))


def _spectrum(lam: Tensor, P: Tensor, B: Tensor, C: Tensor, dt: Tensor, r: Tensor, c: Tensor, even: bool) -> Tensor:
    """S4's kernel spectrum K_hat [H, M (+ 1 with even)] in PyTorch operations (``S4._kernel`` says
    what each piece is): lam, P, B, C [H, N/2] complex (C is C~), dt [H, 1], r = (1 - z) / (1 + z) and
    c = 2 / (1 + z) at the roots z, even: whether z = -1 is a root (its term appended). The twin of
    ``lcsm.ops.native_s4_kernel`` (tests/layers/test_native_twins.py), which eager CPU calls take."""
    g = (2 / dt) * r  # [H, M]
    # The four Cauchy sums sum_n a_n b_n / (g - Lambda_n) run over conjugate pairs (the official
    # cauchy_conj): v / (g - lam) + conj(v) / (g - conj(lam)) = (2 Re(v) g - 2 Re(v conj(lam)))
    # / ((g - lam)(g - conj(lam))), so one [H, M, N/2] matrix serves all four sums.
    v = torch.stack([C * B, C * P, P.conj() * B, P.conj() * P], dim=-1)  # [H, N/2, 4]
    W = 2 * torch.cat([v.real, (v * lam.conj().unsqueeze(-1)).real], dim=-1)  # [H, N/2, 8]
    # k_j = g S_j - S_(4+j) are the four sums over the resolvent of the diagonal part, combined by
    # the Woodbury identity into (g - Lambda + P P^*)^-1's
    K_hat = kernel_spectrum(W, g, c, lam)
    if even:  # z = -1: Delta Re(sum_n C~_n B_n)
        K_hat = torch.cat([K_hat, (dt * v[..., 0].sum(-1, keepdim=True).real).to(K_hat.dtype)], -1)
    return K_hat


@register("s4")
class S4(Mixer):
    """S4 (Gu, Goel & Re 2022, "Efficiently Modeling Long Sequences with Structured State Spaces"):
    a bank of d_model SISO SSMs whose A is HiPPO-LegS in normal plus low-rank (NPLR/DPLR) form,

        A = Lambda - P P^*  (diagonal Lambda, rank 1, in the eigenbasis of the normal part),
        A_bar = (I - Delta/2 A)^-1 (I + Delta/2 A),  B_bar = (I - Delta/2 A)^-1 Delta B   (bilinear, eq. 3)

    A_bar is dense, so S4 is LCSM's psi = "x" system (eq. 7): o = A_bar multiplies the memory as a
    matrix, which ``lcsm.ops.eos`` (psi = elementwise) cannot express. Both forms live here:

    * kernel (mode "fft"): the S4 algorithm (section 3.3, Algorithm 1). The truncated generating
      function sum_{j<M} K_j z^j = C~ (I - A_bar z)^-1 B_bar with C~ = C (I - A_bar^M) is evaluated at
      the M-th roots of unity z = exp(-2 pi i k / M), k <= M / 2 (K is real, so the others give their
      conjugates) as 2/(1+z) C~ (g(z) - A)^-1 B, g(z) = 2/Delta (1-z)/(1+z) (Lemma C.3),
      by the Woodbury identity over the diagonal Lambda (four Cauchy sums, Lemma C.2, each taken
      over conjugate pairs by ``cauchy_conj``), then an inverse real FFT gives K. M is l_max with
      ``l_max`` (the official's), else the smallest length >= T with prime factors 2, 3, 5, 7 and
      11 only (``fft_length``: T for a power of two). At even M, z = -1 is a root: there g is
      infinite and 2/(1+z) has its pole, and the product's limit is Delta Re(sum_n C~_n B_n) (its
      terms are O(1/g)). y = K * u by FFT (``causal_fft_conv``).
    * recurrence (mode "recurrent"): x_t = A_bar x_{t-1} + B_bar u_t, y_t = C x_t + D u_t with the
      dense A_bar, one step at a time.

    Conjugate symmetry (official convention): parameters hold one mode of each conjugate pair
    (N/2 of Lambda, P, B, C); the full N-dim system uses [v, conj(v)] for each, which keeps
    A similar to the real HiPPO matrix, K real and the state [x, conj(x)]. The state carried is the
    half x [B, H, N/2]; y = Re(C_full x_full) = 2 Re(C x).

    Init (official "legs"): Lambda, P, B from HiPPO-LegS: Lambda_n = -1/2 + i omega_n, P = V^* sqrt(n+1/2),
    B = V^* sqrt(2n+1) with V the eigenvectors of the normal part, then Im B clipped to
    [-b_clip, b_clip] (state-spaces/s4 ``models/s4/s4.py``, ``nplr(..., B_clip=2.0)``: "can help with
    stability"; at N = 64 it changes 11 of the 32 modes, at N = 8 one of 4); one copy per channel;
    C ~ complex normal (variance 1); D ~ N(0, 1); log Delta ~ U[log dt_min, log dt_max]. Re Lambda is
    stored as log(-Re Lambda). Output: GELU -> Linear(H, 2H) -> GLU (official layer's "glu"
    post-activation). The clip is symmetric, so it touches the same modes whatever phase the
    eigensolver gives each eigenvector (ours and the official's differ by signs).

    C or C~ (``l_max``): by default the parameter is C and C~ is formed for the length at hand (a
    matrix power of A_bar per call, half of the training step at T = 512), so the model has no
    maximum length and its recurrence is exact at any T: a departure from the official code. With
    ``l_max`` = L, the official parametrization: the parameter holds C~ = C (I - A_bar^M) for
    M = L (initialised from the random C, as the official's first call does),
    the kernel is M long and cut to T <= L, and the true C, needed only for states and stepping,
    is solved from C~ (the official converts it the same way). The official doubles L in place when
    a longer T arrives; here T > L is an error.

    Args:
        d_model: channels H.
        d_state: N (even); N/2 parameters per conjugate pair. Default 64 (the paper's).
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: "auto" (recurrent when T = 1, else fft), "fft" or "recurrent".
        b_clip: bound on |Im B| at init (official 2.0); None keeps the exact HiPPO-LegS B.
        l_max: None (default: the parameter is C, any T) or the longest T (the parameter is C~,
            as the official code's ``l_max``).
    """

    # 2: Im B clipped to [-2, 2] at init, as the official nplr; 3: with l_max, C~ is held for M =
    # l_max, as the official's, no longer l_max rounded up to odd (without l_max, C~ is formed for
    # the M at hand and the kernel is the same function)
    revision = 3

    @classmethod
    def revision_for(cls, options) -> int:
        return cls.revision if options.get("l_max") is not None else 2

    # The contract tests run up to T = 150: the official parametrization, kernels cut from 161 steps.
    option_variants = ({"l_max": 160},)

    float32_parameters = ("log_A_real", "A_imag", "P", "B", "C", "log_dt")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
        b_clip: float | None = 2.0,
        l_max: int | None = None,
    ):
        super().__init__(d_model)
        self.d_state = check_even("d_state", d_state)
        dt_min, dt_max = check_dt(dt_min, dt_max)
        check_float("b_clip", b_clip, 0, low_open=True, allow_none=True)
        self.mode = check_choice("mode", mode, S4_MODES)
        self.l_max = check_int("l_max", l_max, 1, allow_none=True)
        H, N, N2 = d_model, d_state, d_state // 2
        Lam, V = hippo_normal_eig(N)
        # Columns with omega > 0: one of each pair; the others are their conjugates.
        Lam, V = Lam[N2:], V[:, N2:]
        _, B, P = hippo_legs(N)
        Vh = V.conj().t()
        B = Vh @ B.to(torch.complex128)
        if b_clip is not None:
            B = torch.complex(B.real, B.imag.clamp(-b_clip, b_clip))
        self.log_A_real = no_weight_decay(nn.Parameter((-Lam.real).log().expand(H, N2).to(param_dtype()).contiguous()))
        self.A_imag = no_weight_decay(nn.Parameter(Lam.imag.expand(H, N2).to(param_dtype()).contiguous()))
        self.P = no_weight_decay(complex_param((Vh @ P.to(torch.complex128)).expand(H, N2)))
        self.B = no_weight_decay(complex_param(B.expand(H, N2)))
        self.C = complex_param(torch.randn(H, N2, dtype=torch.complex128))
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(H, dt_min, dt_max).to(param_dtype())))
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, 2 * H)
        self._cache = {}
        if self.l_max is not None:
            with torch.no_grad():
                C_t = self._truncated_C(as_complex(self.C), self._discretize()[0], self._kernel_size(self.l_max))
                self.C.copy_(torch.view_as_real(C_t))

    # -- the system

    def _half_params(self) -> tuple[Tensor, Tensor, Tensor]:
        """(Lambda, P, B), one mode of each conjugate pair, each [H, N/2] complex."""
        Lam = torch.complex(-self.log_A_real.exp(), self.A_imag)
        return Lam, as_complex(self.P), as_complex(self.B)

    def half_system(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(Lambda, P, B, C), one mode of each conjugate pair, each [H, N/2] complex; C is the
        system's own (solved from the parameter C~ with ``l_max``)."""
        return *self._half_params(), self.output_C()

    def full_system(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(Lambda, P, B, C) of the full conjugate-symmetric system, each [H, N] complex."""
        return tuple(torch.cat([v, v.conj()], dim=-1) for v in self.half_system())

    def continuous_A(self) -> Tensor:
        """A = diag(Lambda) - P P^* [H, N, N] (complex)."""
        Lam, P, _ = (torch.cat([v, v.conj()], dim=-1) for v in self._half_params())
        return torch.diag_embed(Lam) - P.unsqueeze(-1) * P.conj().unsqueeze(-2)

    def _kept(self, name: str, params: tuple[Tensor, ...], compute):
        """compute(), kept without autograd (decoding, evaluation) until a parameter in params changes
        (in place, as an optimizer step does, or by a new dtype, device or tensor): decoding steps
        one token at a time, and forming the N x N A_bar costs more than the step itself."""
        if torch.is_grad_enabled():
            return compute()
        cached = self._cache.get(name)
        # The key holds each parameter's storage, so a pointer seen again is the same storage.
        if cached is None or not all(
            d.data_ptr() == p.data_ptr() and d.dtype == p.dtype and d.device == p.device and v == p._version
            for (d, v), p in zip(cached[0], params, strict=True)
        ):
            cached = self._cache[name] = ([(p.data, p._version) for p in params], compute())
        return cached[1]

    def discretize(self) -> tuple[Tensor, Tensor]:
        """Bilinear: (A_bar [H, N, N], B_bar [H, N]) of the full system (kept without autograd)."""
        params = (self.log_A_real, self.A_imag, self.P, self.B, self.log_dt)
        return self._kept("discretized", params, self._discretize)

    def output_C(self, A_bar: Tensor | None = None) -> Tensor:
        """The system's C [H, N/2]: the parameter, or with ``l_max`` the solution of C (I - A_bar^M) =
        C~ (kept without autograd); A_bar: ``discretize()``'s, when the caller has it already."""
        if self.l_max is None:
            return as_complex(self.C)
        params = (self.log_A_real, self.A_imag, self.P, self.B, self.log_dt, self.C)
        return self._kept("output_C", params, lambda: self._untruncated_C(A_bar))

    def _untruncated_C(self, A_bar: Tensor | None) -> Tensor:
        r_t = self._real_row(as_complex(self.C))
        A_bar = self.discretize()[0] if A_bar is None else A_bar
        A_M = self._real_power(A_bar, self._kernel_size(self.l_max))
        eye = torch.eye(A_M.shape[-1], dtype=A_M.dtype, device=A_M.device)
        r = torch.linalg.solve(eye - A_M.transpose(-1, -2), r_t.unsqueeze(-1)).squeeze(-1)
        return self._from_real_row(r)

    def _discretize(self) -> tuple[Tensor, Tensor]:
        # I - Delta/2 A = diag(d) + c P P^* (c = Delta/2, d = 1 - c Lambda) is diagonal plus rank
        # one, so Sherman-Morrison inverts it in O(N^2) (an N x N solve per channel was a third of
        # S4's training step at T = 512). With u = P / d, v = conj(P) / d and s = sum P conj(P) / d:
        #   A_bar = diag((1 + c Lambda) / d) - 2c / (1 + c s) u v^T
        #   B_bar = 2c (B / d - c / (1 + c s) u (v . B))
        Lam, P, B = (torch.cat([v, v.conj()], dim=-1) for v in self._half_params())
        c = (self.log_dt.exp() / 2).to(Lam.dtype).unsqueeze(-1)  # [H, 1]
        d = 1 - c * Lam
        u, v = P / d, P.conj() / d
        k = c / (1 + c * (P * v).sum(-1, keepdim=True))  # [H, 1]
        A_bar = torch.diag_embed((1 + c * Lam) / d) - (2 * k).unsqueeze(-1) * u.unsqueeze(-1) * v.unsqueeze(-2)
        B_bar = 2 * c * (B / d - k * u * (v * B).sum(-1, keepdim=True))
        return A_bar, B_bar

    def kernel(self, length: int) -> Tensor:
        """K_j = Re(C A_bar^j B_bar), j < length, by the S4 algorithm (Cauchy + Woodbury): [H, length]."""
        return self._kernel(length, None if self.l_max is not None else self.discretize()[0])

    def _kernel_size(self, length: int) -> int:
        """M: the number of roots of unity: with ``l_max``, l_max itself (the official's, for which
        the parameter holds C~); without, ``fft_length(length)``, a fast FFT length >= T (any M >= T
        gives the same kernel: C~ is formed for it)."""
        if self.l_max is not None:
            if length > self.l_max:
                raise ValueError(
                    f"l_max: this S4 holds C~ for sequences of at most l_max = {self.l_max} steps, got "
                    f"T = {length} (the step loop, mode='recurrent', takes any T)"
                )
            return self.l_max
        if torch.compiler.is_compiling():
            # Traced, T is symbolic: odd (no z = -1 term for the graph to branch on) and above T
            # for every T (T + 2 or T + 3), so that the kernel's slice to T steps is never the
            # whole of it; an M chosen by T's factors would fix T in the graph.
            return 2 * (length // 2) + 3
        return fft_length(length)

    @staticmethod
    def _real_power(A_bar: Tensor, M: int) -> Tensor:
        """A_bar^M in the real coordinates [Re x, Im x] of the state [x, conj(x)], where A_bar is a real
        N x N matrix: a quarter of the complex cost."""
        N2 = A_bar.shape[-1] // 2
        A11, A12 = A_bar[:, :N2, :N2], A_bar[:, :N2, N2:]
        S, D = A11 + A12, A11 - A12  # x' = S Re x + i D Im x
        A_real = torch.cat([torch.cat([S.real, -D.imag], -1), torch.cat([S.imag, D.real], -1)], -2)
        return _matrix_power(A_real, M)

    # C x + conj(C x) = [Re C, -Im C] . 2 [Re x, Im x]: C acts on the real coordinates as this row.
    @staticmethod
    def _real_row(C: Tensor) -> Tensor:
        return torch.cat([C.real, -C.imag], -1)

    @staticmethod
    def _from_real_row(r: Tensor) -> Tensor:
        N2 = r.shape[-1] // 2
        return torch.complex(r[:, :N2], -r[:, N2:])

    def _truncated_C(self, C: Tensor, A_bar: Tensor, M: int) -> Tensor:
        """C~ = C (I - A_bar^M) for one mode of each conjugate pair (C~ is conjugate-symmetric, as C
        is): C [H, N/2] -> [H, N/2]. At short lengths this power and its gradient are most of S4's
        kernel (``l_max`` avoids them)."""
        rho = torch.einsum("hn,hnm->hm", self._real_row(C), self._real_power(A_bar, M))
        return C - self._from_real_row(rho)

    def _kernel(self, length: int, A_bar: Tensor | None) -> Tensor:
        """The kernel from the parameters; A_bar (for C~) only without ``l_max``."""
        M = self._kernel_size(length)
        dt = self.log_dt.exp().unsqueeze(-1)  # [H, 1]
        C_t = as_complex(self.C) if A_bar is None else self._truncated_C(as_complex(self.C), A_bar, M)
        # K is real, so its transform at conj(z) is the conjugate of that at z: the frequencies
        # k <= M / 2 determine it (an inverse real FFT), half the Cauchy sums of all M.
        # At even M the last root is z = -1, where 2 / (1 + z) has its pole and g(z) is infinite:
        # its value is the limit Delta Re(sum_n C~_n B_n) (class docstring), the other roots the
        # Cauchy sums'.
        even = isinstance(M, int) and M % 2 == 0  # traced, M is symbolic and odd (``_kernel_size``)
        k = torch.arange(M // 2 + (not even), device=dt.device, dtype=dt.dtype)
        z = torch.exp(_MINUS_TWO_PI_J * k / M)  # [M // 2 + 1], less z = -1
        r, c = (1 - z) / (1 + z), 2 / (1 + z)  # on [M] alone: g = (2 / Delta) r
        if native_serves(dt):
            C_parts = self.C if A_bar is None else torch.view_as_real(C_t)
            params = (self.log_A_real, self.A_imag, self.P, self.B, C_parts, self.log_dt)
            K_hat = native_s4_kernel(*params, r, c, even)
        else:
            K_hat = _spectrum(*self._half_params(), C_t, dt, r, c, even)
        return torch.fft.irfft(K_hat, n=M, dim=-1)[..., :length]

    # -- the two forms

    def _fft(self, u: Tensor, x0: Tensor | None, return_state: bool):
        T = u.shape[1]
        K = self.kernel(T)  # [H, T]
        y = causal_fft_conv(K, u.transpose(1, 2), -1).transpose(1, 2)
        if x0 is None and not return_state:
            return y, None
        N2 = self.d_state // 2
        A_bar, B_bar = self.discretize()
        x_full = torch.cat([x0, x0.conj()], dim=-1) if x0 is not None else None
        # The state terms in chunks of L steps: L Krylov rows and one step by A_bar^L per chunk, not
        # T rows ([H, T, N], gigabytes at 16K tokens); L ~ sqrt(B T) balances the two costs.
        Bsz, H = u.shape[0], u.shape[2]
        L = min(T, math.isqrt(Bsz * T))
        n = -(-T // L)
        A_L = torch.linalg.matrix_power(A_bar, L)

        def advance(x):
            return torch.einsum("hnm,bhm->bhn", A_L, x)

        if x_full is not None:
            # y_t += Re(C A_bar^(t+1) x_0) with t = c L + j: rows C A_bar^(j+1) times A_bar^(c L) x_0.
            C = self.output_C(A_bar)
            C = torch.cat([C, C.conj()], dim=-1)
            rows = krylov(torch.einsum("hn,hnm->hm", C, A_bar), A_bar, L)  # [H, L, N]
            starts = [x_full]
            for _ in range(n - 1):
                starts.append(advance(starts[-1]))
            y0 = torch.einsum("hjn,cbhn->bcjh", rows, torch.stack(starts)).real
            y = y + y0.reshape(Bsz, n * L, H)[:, :T]
        x_T = None
        if return_state:
            # x_T = sum_j A_bar^j B_bar u_(T-1-j) + A_bar^T x_0 with j = c L + i: the chunk sums
            # s_c = sum_i A_bar^i B_bar u_(T-1-cL-i) (columns A_bar^i B_bar as rows of the
            # transpose), then sum_c A_L^c s_c by Horner's rule.
            cols = krylov(B_bar, A_bar.transpose(-1, -2), L)  # [H, L, N]
            u_back = F.pad(u.flip(1), (0, 0, 0, n * L - T)).view(Bsz, n, L, H)
            sums = torch.einsum("hin,bcih->cbhn", cols, u_back.to(cols.dtype))
            x_T = sums[-1]
            for c in range(n - 2, -1, -1):
                x_T = advance(x_T) + sums[c]
            if x_full is not None:
                x_T = x_T + torch.einsum("hnm,bhm->bhn", torch.linalg.matrix_power(A_bar, T), x_full)
            x_T = x_T[..., :N2]
        return y, x_T

    def _recurrent(self, u: Tensor, x0: Tensor | None):
        A_bar, B_bar = self.discretize()
        N2 = self.d_state // 2
        # The half state evolves as x' = A11 x + A12 conj(x) + B_bar_h u: the top rows of A_bar
        # acting on [x, conj(x)].
        A11, A12, Bh = A_bar[:, :N2, :N2], A_bar[:, :N2, N2:], B_bar[:, :N2]
        C = self.output_C(A_bar)
        x = x0 if x0 is not None else u.new_zeros(u.shape[0], u.shape[2], N2, dtype=A_bar.dtype)
        ys = []
        for u_t in u.unbind(1):
            x = (
                torch.einsum("hnm,bhm->bhn", A11, x)
                + torch.einsum("hnm,bhm->bhn", A12, x.conj())
                + Bh * u_t.unsqueeze(-1)
            )
            ys.append(2 * (x * C).sum(-1).real)
        return torch.stack(ys, 1), x

    def ssm(self, u: Tensor, state: Tensor | None = None, return_state: bool = False):
        """The SSM with the D skip: u [B, T, H] -> (y [B, T, H], half state [B, H, N/2] or None).
        The system runs in its parameters' precision, outside autocast (whose bfloat16 matmuls
        would round A_bar's powers and the Cauchy sums)."""
        mode = self.mode
        if mode == "auto":
            mode = "recurrent" if u.shape[1] <= 1 else "fft"
        with autocast_off(u.device):
            v = u.to(torch.promote_types(u.dtype, self.log_dt.dtype))
            if mode == "fft":
                y, x = self._fft(v, state, return_state)
            else:
                y, x = self._recurrent(v, state)
        return (y + self.D * v).to(u.dtype), (x if return_state else None)

    def advance(self, x0: Tensor, steps: Tensor) -> Tensor:
        """A_bar^(steps_b) x0_b, the zero-input evolution of half states x0 [B, H, N/2] over steps [B]
        (int64) steps each, by repeated squaring: O(log max(steps)) N x N products."""
        A_bar, _ = self.discretize()
        N2 = self.d_state // 2
        with autocast_off(x0.device):
            x = torch.cat([x0, x0.conj()], dim=-1).to(A_bar.dtype)
            power = A_bar
            for bit in range(int(steps.max()).bit_length()):
                if bit:
                    power = power @ power
                take = ((steps >> bit) & 1).bool().view(-1, 1, 1)
                x = torch.where(take, torch.einsum("hnm,bhm->bhn", power, x), x)
        return x[..., :N2]

    def packed_ssm(self, u: Tensor, x0: Tensor | None, return_state: bool, cu_seqlens: Tensor):
        """``ssm`` on a packed row u [1, T, H] of N documents: outputs from right-padded rows (the map
        is causal), final half states [N, H, N/2] from left-padded ones (zeros before a document
        keep a zero state at zero) plus each initial state's own evolution."""
        docs = PaddedDocuments(cu_seqlens, u.shape[1])
        y, _ = self.ssm(docs.right(u), x0, False)
        x_T = None
        if return_state:
            _, x_T = self.ssm(docs.left(u), None, True)
            if x0 is not None:
                x_T = x_T + self.advance(x0, docs.lengths)
        return docs.unpad(y), x_T

    def forward(
        self,
        x: Tensor,
        state: S4State | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, H] -> y [B, T, H] (and the final S4State when asked)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        x0 = state.x if state is not None else None
        if cu_seqlens is None:
            y, s = self.ssm(x, x0, return_state)
        else:
            y, s = self.packed_ssm(x, x0, return_state, cu_seqlens)
        y = gelu_glu(y, self.output_linear)
        return (y, S4State(x=s)) if return_state else y

    def init_state(self, batch_size: int) -> S4State:
        return S4State(
            x=torch.zeros(
                batch_size, self.d_model, self.d_state // 2, dtype=self._memory_dtype(True), device=self.log_dt.device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="S4 (HiPPO-LegS NPLR)",
            input="u_t",
            expand="B_bar = (I - Delta/2 A)^-1 Delta B (bilinear)",
            oscillation="A_bar = (I - Delta/2 A)^-1 (I + Delta/2 A), A = Lambda - P P^* (dense N x N)",
            shrink="C (y = 2 Re(C x_t) + D u_t)",
            memory=f"K x D = {self.d_state} x 1 per channel (real; stored as {self.d_state // 2} complex), "
            f"{self.d_model} channels",
            psi="matrix",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="S4 (Gu et al., 2022a), section 3.3 Algorithm 1, eq. 3; LCSM Table 1 row S4 (psi = x, eq. 7)",
        )
