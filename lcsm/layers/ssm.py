"""Linear time-invariant state-space mixers: S4 (NPLR), S4D, S5 and DSS (LCSM Table 1, section 2.3).

Each is a continuous SSM x'(t) = A x(t) + B u(t), y = C x + D u, discretised with step Delta and
run as the discrete recurrence x_t = A_bar x_{t-1} + B_bar u_t, y_t = C x_t + D u_t. Because the
system does not depend on the input, the same map is the causal long convolution y = K * u + D u
with K_j = C A_bar^j B_bar, which is how the papers train them.

The diagonal ones (S4D, S5, DSS) are EOS recurrences with a complex, data-independent oscillation
and are evaluated by ``lcsm.ops.eos``: mode "auto" takes the FFT path for any T > 1 and the
recurrence for one token (decoding). S4 proper keeps the dense (diagonal plus low-rank) A of
HiPPO-LegS; its bilinear A_bar is a dense N x N matrix, a psi = "x" (matrix) oscillation that the
elementwise EOS operator cannot express, so this module implements both of its forms itself: the
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

from lcsm.ops import eos
from lcsm.ops._inputs import MODES, autocast_off

from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor

S4D_INITS = ("lin", "inv", "real")
S4_MODES = ("auto", "fft", "recurrent")


@dataclass
class SSMState(State):
    """memory: the complex EOS memory [B, H, K, D] of a diagonal SSM (its modes' states)."""

    memory: Tensor


@dataclass
class S4State(State):
    """x: one half of the conjugate-symmetric S4 state [B, H, N/2] (complex); the other half is its
    conjugate, so these N real scalars per channel are the whole state."""

    x: Tensor


# ----------------------------------------------------------------------------- option checks


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def _check_even(name: str, value) -> int:
    _check_int(name, value, 2)
    if value % 2:
        raise ValueError(f"{name}: expected an even integer (modes come in conjugate pairs), got {value!r}")
    return value


def _check_dt(dt_min, dt_max) -> tuple[float, float]:
    for name, v in (("dt_min", dt_min), ("dt_max", dt_max)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{name}: expected a positive number, got {v!r}")
    if dt_min > dt_max:
        raise ValueError(f"dt_min: expected dt_min <= dt_max, got dt_min={dt_min}, dt_max={dt_max}")
    return float(dt_min), float(dt_max)


def _check_mode(value, allowed) -> str:
    if value not in allowed:
        raise ValueError(f"mode: expected one of {', '.join(allowed)}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- shared pieces


def log_dt_init(shape, dt_min: float, dt_max: float) -> Tensor:
    """log Delta ~ Uniform[log dt_min, log dt_max] (S4, S4D, DSS, S5 all use this)."""
    return math.log(dt_min) + torch.rand(shape, dtype=torch.float64) * (math.log(dt_max) - math.log(dt_min))


def _dtype() -> torch.dtype:
    """Parameters are built in float64 and stored in the default dtype (as nn.Linear is)."""
    return torch.get_default_dtype()


def complex_param(z: Tensor) -> nn.Parameter:
    """A complex tensor stored as real (re, im) pairs [..., 2] in the default dtype, as the official
    codes do (Adam's moments are then per real component)."""
    return nn.Parameter(torch.view_as_real(z.to(torch.promote_types(_dtype(), torch.complex64))).contiguous())


def as_complex(p: Tensor) -> Tensor:
    return torch.view_as_complex(p)


def hippo_legs(N: int) -> tuple[Tensor, Tensor, Tensor]:
    """HiPPO-LegS (S4 paper eq. 2, sign included) in float64: A [N, N], B [N], and the rank-1
    correction P [N] with A + P P^T normal (S4 section 3.3, Theorem 1).

        A_nk = -sqrt(2n+1) sqrt(2k+1) (n > k),  -(n+1) (n = k),  0 (n < k);  B_n = sqrt(2n+1);
        P_n = sqrt(n + 1/2).
    """
    n = torch.arange(N, dtype=torch.float64)
    r = (2 * n + 1).sqrt()
    A = -(r[:, None] * r[None, :]).tril(-1) - torch.diag(n + 1)
    return A, r.clone(), (n + 0.5).sqrt()


def hippo_normal_eig(N: int) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of the normal part S = A + P P^T of HiPPO-LegS ("HiPPO-N", S5 section 4.1):
    S = -1/2 I + K with K skew-symmetric, so S = V diag(Lambda) V^* with Lambda = -1/2 + i omega and V
    unitary. Returns (Lambda [N] complex128, V [N, N]) ordered by ascending omega, so that the
    first N/2 columns hold one eigenvector of every conjugate pair (omega < 0 for even N)."""
    A, _, P = hippo_legs(N)
    S = A + P[:, None] * P[None, :]
    K = S - torch.diag(torch.diagonal(S))
    omega, V = torch.linalg.eigh(-1j * K.to(torch.complex128))  # -iK is Hermitian: K v = i omega v
    Lam = torch.complex(torch.diagonal(S).mean().expand(N), omega)
    return Lam, V


def _gelu_glu(y: Tensor, linear: nn.Linear) -> Tensor:
    """The S4 layer's output: GELU, then a position-wise Linear(H, 2H) and a GLU."""
    return F.glu(linear(F.gelu(y)), dim=-1)


class _DiagonalSISO(Mixer):
    """A bank of H single-input single-output diagonal SSMs on EOS: one head per channel
    (H = d_model heads, D = 1, K = ``self.modes`` complex modes). Subclasses give e (= B_bar),
    s (= C) and log_o (= log A_bar) per head and the factor on the real part."""

    real_factor = 2.0

    def eos_parameters(self) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def ssm(self, u: Tensor, memory: Tensor | None = None, return_state: bool = False):
        """The SSM convolution with the D skip: u [B, T, H] -> (y [B, T, H], memory [B, H, K, 1] or None)."""
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
        )
        return (self.real_factor * y[..., 0] + self.D * u).to(u.dtype), m

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, self.d_model, self.modes, 1, dtype=self._memory_dtype(True), device=self.log_dt.device
            )
        )

    def _run(self, x: Tensor, state: SSMState | None, return_state: bool):
        self.check_input(x)
        return self.ssm(x, state.memory if state is not None else None, return_state)


# ----------------------------------------------------------------------------- S4D


@register("s4d")
class S4D(_DiagonalSISO):
    """S4D (Gu, Gupta, Goel & Re 2022, "On the Parameterization and Initialization of Diagonal
    State Space Models"): a bank of d_model SISO diagonal SSMs, ZOH discretisation (section 3.1):

        A_bar = exp(Delta A),   B_bar = (exp(Delta A) - 1) / A * B,   K_j = 2 Re sum_n C_n A_bar_n^j B_bar_n

    EOS mapping (one head per channel, H = d_model, K = N/2 complex modes, D = 1):
    i = u_t, e = B_bar [H, K], log_o = Delta A [H, K, 1] (complex), s = C [H, K];
    y = 2 Re(EOS output) + D u (one mode per conjugate pair, as the official ``s4d.py``).

    Init (section 4): A = -1/2 + i pi n ("lin", S4D-Lin, default, the official standalone's init),
    -1/2 + i (N/pi)(N/(2n+1) - 1) ("inv", S4D-Inv) or -(n+1) ("real", S4D-Real); B = 1;
    C ~ complex normal (variance 1); D ~ N(0, 1); log Delta ~ U[log dt_min, log dt_max].
    Re A is stored as log(-Re A) so it stays negative (official). Output: GELU -> Linear(H, 2H) -> GLU.

    Args:
        d_model: channels H.
        d_state: N (even); N/2 complex modes per channel. Default 64 (the paper's N).
        init: "lin", "inv" or "real".
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: the ``lcsm.ops.eos`` mode ("auto" picks fft for T > 1, recurrent for T = 1).
    """

    float32_parameters = ("log_dt", "log_A_real", "A_imag", "B", "C")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        init: str = "lin",
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = _check_even("d_state", d_state)
        self.modes = d_state // 2
        if init not in S4D_INITS:
            raise ValueError(f"init: expected one of {', '.join(S4D_INITS)}, got {init!r}")
        self.init = init
        dt_min, dt_max = _check_dt(dt_min, dt_max)
        self.mode = _check_mode(mode, MODES)
        H, N, N2 = d_model, d_state, d_state // 2
        n = torch.arange(N2, dtype=torch.float64).expand(H, N2)
        if init == "lin":
            re, im = torch.full_like(n, 0.5), math.pi * n
        elif init == "inv":
            re, im = torch.full_like(n, 0.5), (N / math.pi) * (N / (2 * n + 1) - 1)
        else:
            re, im = n + 1, torch.zeros_like(n)
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(H, dt_min, dt_max).to(_dtype())))
        self.log_A_real = no_weight_decay(nn.Parameter(re.log().to(_dtype()).contiguous()))
        self.A_imag = no_weight_decay(nn.Parameter(im.to(_dtype()).contiguous()))
        # No weight decay on B, as on A and Delta: the official S4D kernel (state-spaces/s4
        # models/s4/s4.py, SSMKernelDiag.register_params) registers B with wd_dict["B"] = 0.0; C decays.
        self.B = no_weight_decay(complex_param(torch.ones(H, N2, dtype=torch.complex128)))
        self.C = complex_param(torch.randn(H, N2, dtype=torch.complex128))
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, 2 * H)

    def A(self) -> Tensor:
        """Continuous A [H, N/2] (complex, Re < 0)."""
        return torch.complex(-self.log_A_real.exp(), self.A_imag)

    def eos_parameters(self):
        A = self.A()
        dtA = self.log_dt.exp().unsqueeze(-1) * A
        B_bar = as_complex(self.B) * torch.expm1(dtA) / A  # ZOH
        return B_bar, as_complex(self.C), dtA.unsqueeze(-1)

    def forward(self, x: Tensor, state: SSMState | None = None, return_state: bool = False):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        y, m = self._run(x, state, return_state)
        y = _gelu_glu(y, self.output_linear)
        return (y, SSMState(memory=m)) if return_state else y

    def describe(self) -> EOSRow:
        return EOSRow(
            name=f"S4D-{self.init.capitalize()}",
            input="u_t",
            expand="B_bar = (exp(Delta A) - 1) / A * B (ZOH)",
            oscillation="A_bar = exp(Delta A), diagonal complex (one mode per conjugate pair)",
            shrink="C, 2 Re(.) kept",
            memory=f"K x D = {self.d_state // 2} x 1 complex per channel, {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="S4D (Gu et al., 2022), section 3-4; LCSM Table 1 row S4 with a diagonal A (eq. 9)",
        )


# ----------------------------------------------------------------------------- DSS


@register("dss")
class DSS(_DiagonalSISO):
    """DSS-softmax (Gupta, Gu & Berant 2022, "Diagonal State Spaces are as Effective as Structured
    State Spaces", section 3, Proposition 1(b)): per channel h, with P_{n,j} = Delta Lambda_n j,

        K_j = Re( sum_n W_n / Lambda_n * softmax_j(P_n)_j ),   softmax over j = 0 .. L-1,

    i.e. K_j = Re sum_n W_n / (Lambda_n Z_n) exp(j Delta Lambda_n), Z_n = sum_{j<L} exp(j Delta Lambda_n)
    = (exp(L Delta Lambda_n) - 1) / (exp(Delta Lambda_n) - 1). Lambda [N] is shared by the channels;
    W [H, N] and Delta [H] are per channel; Delta has separate real and imaginary parts (the official
    ``sep_dt_re_im``: Delta Lambda = Delta_re Re Lambda + i Delta_im Im Lambda).

    EOS mapping (H = d_model heads, K = N complex modes, D = 1): i = u_t, e = 1 / (Lambda Z) [H, N],
    log_o = Delta Lambda [H, N, 1], s = W [H, N]; y = Re(EOS output) + D u (no factor 2: DSS keeps
    all N modes, as the official code). Positive Re Lambda is allowed (the softmax keeps the kernel
    bounded); for those modes the official code's shift exp(-(L-1) Delta Lambda) is folded into e.
    Departure: the official code computes that shift under ``no_grad``, so its gradient for such
    modes is not the kernel's; ours differentiates it (the same forward, the kernel's own gradient).

    Departure: the official kernel normalises the softmax over the current input length L, which
    makes the layer's output at time t depend on how long the whole input is: not causal across
    calls and with no recurrent form. We normalise over a fixed ``l_max`` (the paper's L, the
    training length), which makes DSS a true time-invariant SSM: causal, streamable, and identical
    to the official kernel whenever the input length equals l_max.

    Init (official): Lambda = the N eigenvalues with positive imaginary part of the skew-symmetric
    part of HiPPO-LegS of size 2N, minus 1/2 ("hippo_skew_pos_imag"); W ~ complex normal with
    N(0, 1) real and imaginary parts; D ~ N(0, 1); log Delta ~ U[log dt_min, log dt_max] (tiled over
    the re/im pair). ``epsilon`` is the official guard in 1 / (Lambda (exp(L Delta Lambda) - 1)),
    computed as conj(x) / (|x|^2 + epsilon). Output: GELU -> Linear(H, H) (the official default
    output_linear with no post-activation).

    Args:
        d_model: channels H.
        d_state: N complex modes per channel (default 64, the paper's).
        l_max: the softmax normalisation length L (default 1024).
        dt_min, dt_max: range of the log-uniform Delta init.
        epsilon: the reciprocal's guard (official 1e-7; 0 gives the exact formula).
        mode: the ``lcsm.ops.eos`` mode.
    """

    real_factor = 1.0
    float32_parameters = ("Lambda", "log_dt", "W")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        l_max: int = 1024,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        epsilon: float = 1e-7,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = self.modes = _check_int("d_state", d_state, 1)
        self.l_max = _check_int("l_max", l_max, 1)
        dt_min, dt_max = _check_dt(dt_min, dt_max)
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or epsilon < 0:
            raise ValueError(f"epsilon: expected a number >= 0, got {epsilon!r}")
        self.epsilon = float(epsilon)
        self.mode = _check_mode(mode, MODES)
        H, N = d_model, d_state
        Lam = hippo_skew_pos_imag(N)
        self.Lambda = no_weight_decay(complex_param(Lam))
        log_dt = log_dt_init(H, dt_min, dt_max).unsqueeze(-1).repeat(1, 2)  # [H, (re, im)]
        self.log_dt = no_weight_decay(nn.Parameter(log_dt.to(_dtype())))
        self.W = no_weight_decay(nn.Parameter(torch.randn(H, N, 2)))  # official: wd 0 on W
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, H)

    def dt_lambda(self) -> Tensor:
        """Delta Lambda [H, N] with separate steps for the real and imaginary parts."""
        return as_complex(self.log_dt.exp().unsqueeze(1) * self.Lambda.unsqueeze(0))

    def eos_parameters(self):
        Lam = as_complex(self.Lambda)
        x = self.dt_lambda()
        L = self.l_max
        positive = Lam.real > 0
        # Official "fast softmax": for Re Lambda > 0 evaluate 1/Z with -x (no overflow of exp(L x))
        # and shift the powers by exp(-(L-1) x), which we fold into e.
        xs = torch.where(positive, -x, x)
        num = torch.expm1(xs)
        den = torch.expm1(L * xs) * Lam
        inv = den.conj() / (den.real**2 + den.imag**2 + self.epsilon)
        shift = torch.where(positive, (-(L - 1) * x).exp(), torch.ones_like(x))
        e = num * inv * shift
        return e, as_complex(self.W), x.unsqueeze(-1)

    def forward(self, x: Tensor, state: SSMState | None = None, return_state: bool = False):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        y, m = self._run(x, state, return_state)
        y = self.output_linear(F.gelu(y))
        return (y, SSMState(memory=m)) if return_state else y

    def describe(self) -> EOSRow:
        return EOSRow(
            name="DSS-softmax",
            input="u_t",
            expand=f"1 / (Lambda Z), Z = sum_(j<{self.l_max}) exp(j Delta Lambda) (softmax normaliser)",
            oscillation="exp(Delta Lambda) (Lambda shared by channels, Delta per channel): a 1_k^T",
            shrink="W, Re(.) kept",
            memory=f"K x D = {self.d_state} x 1 complex per channel, {self.d_model} channels",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="DSS (Gupta et al., 2022), section 3 Prop. 1 (DSS-softmax); LCSM Table 1 row DSS",
        )


def hippo_skew_pos_imag(N: int) -> Tensor:
    """DSS init: eigenvalues of the skew-symmetric part of HiPPO-LegS of size 2N with positive
    imaginary part (largest first), minus 1/2; complex128 [N]."""
    A, _, _ = hippo_legs(2 * N)
    skew = (A - A.t()) / 2
    ev = torch.linalg.eigvals(skew)
    ev = ev[ev.imag.argsort(descending=True)][:N]
    return torch.complex(torch.full_like(ev.real, -0.5), ev.imag)


# ----------------------------------------------------------------------------- S5


def _lecun_trunc_normal(shape, fan_in: int) -> Tensor:
    """JAX's lecun_normal: truncated normal on [-2, 2] std units, rescaled to variance 1/fan_in."""
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978
    return nn.init.trunc_normal_(torch.empty(shape, dtype=torch.float64), std=std, a=-2 * std, b=2 * std)


@register("s5")
class S5(Mixer):
    """S5 (Smith, Warrington & Linderman 2023, "Simplified State Space Layers for Sequence
    Modeling"): one MIMO SSM with a complex diagonal state matrix, ZOH discretisation (section 3):

        x_t = Lambda_bar x_{t-1} + B_bar u_t,   y_t = 2 Re(C~ x_t) + D u_t,
        Lambda_bar = exp(Lambda Delta),   B_bar = (Lambda_bar - 1) / Lambda * B~   (Delta per state).

    EOS mapping: MIMO B_bar u_t mixes channels, which the EOS expand (an outer product e_t i_t^T)
    cannot; so the input state is the linear projection i_t = B_bar u_t [P/2] (LCSM: "u_t from x_t
    through linear projection"), with H = 1, K = 1, D = P/2, e = s = 1 and log_o = Lambda Delta
    as a column oscillation [1, 1, P/2]. The EOS memory is then exactly the S5 state x_t and the
    output projection C~ follows the shrink. One mode per conjugate pair and 2 Re(.) (official
    ``conj_sym=True``).

    Init (section 4.1 and the official code): Lambda, V from HiPPO-N, the diagonalised normal part
    of HiPPO-LegS, for each of ``blocks`` blocks of size P/blocks (block-diagonal V);
    B~ = V^-1 B with B lecun-normal [P, H]; C~ = C V with C's real and imaginary parts lecun-normal
    [H, P] ("trunc_standard_normal"); D ~ N(0, 1); log Delta [P/2] ~ U[log dt_min, log dt_max].
    Output ("half_glu1", the official default activation): g = GELU(y), g * sigmoid(Linear(g)), with
    flax's ``nn.gelu`` as the official ``s5/layers.py`` (SequenceLayer) calls it: its default is the
    tanh approximation (``approximate=True``), which differs from the exact GELU by up to 4.7e-4.

    Args:
        d_model: channels H.
        d_state: P, the (real) state size; P/2 complex modes are kept. Default 64.
        blocks: J, number of HiPPO-N blocks of the init (P/J must be even).
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: the ``lcsm.ops.eos`` mode.
    """

    float32_parameters = ("Lambda_re", "Lambda_im", "log_dt", "B", "C")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        blocks: int = 1,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.d_state = _check_even("d_state", d_state)
        self.blocks = _check_int("blocks", blocks, 1)
        if d_state % blocks or (d_state // blocks) % 2:
            raise ValueError(
                f"blocks: d_state / blocks must be an even integer, got d_state={d_state}, blocks={blocks!r}"
            )
        dt_min, dt_max = _check_dt(dt_min, dt_max)
        self.mode = _check_mode(mode, MODES)
        H, P = d_model, d_state
        size = P // blocks
        Lam, V = hippo_normal_eig(size)
        Lam, V = Lam[: size // 2], V[:, : size // 2]
        Lam = Lam.repeat(blocks)  # [P/2]
        V = torch.block_diag(*([V] * blocks))  # [P, P/2]
        B = _lecun_trunc_normal((P, H), fan_in=P).to(torch.complex128)
        C = torch.complex(_lecun_trunc_normal((H, P), fan_in=P), _lecun_trunc_normal((H, P), fan_in=P))
        self.Lambda_re = no_weight_decay(nn.Parameter(Lam.real.to(_dtype()).contiguous()))
        self.Lambda_im = no_weight_decay(nn.Parameter(Lam.imag.to(_dtype()).contiguous()))
        self.B = no_weight_decay(complex_param(V.conj().t() @ B))  # [P/2, H]
        self.C = complex_param(C @ V)  # [H, P/2]
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(P // 2, dt_min, dt_max).to(_dtype())))
        self.out2 = nn.Linear(H, H)

    def discretize(self) -> tuple[Tensor, Tensor]:
        """ZOH: (Lambda Delta [P/2] complex, B_bar [P/2, H] complex)."""
        Lam = torch.complex(self.Lambda_re, self.Lambda_im)
        dtL = Lam * self.log_dt.exp()
        return dtL, (torch.expm1(dtL) / Lam).unsqueeze(-1) * as_complex(self.B)

    def ssm(self, u: Tensor, memory: Tensor | None = None, return_state: bool = False):
        """u [B, T, H] -> (2 Re(C~ x_t) + D u_t [B, T, H], state memory [B, 1, 1, P/2] or None)."""
        dtL, B_bar = self.discretize()
        i = torch.einsum("bth,ph->btp", u.to(B_bar.dtype), B_bar).unsqueeze(2)  # [B, T, 1, P/2]
        ones = torch.ones(1, 1, dtype=u.dtype, device=u.device)
        x, m = eos(
            i, ones, ones, dtL.view(1, 1, -1), mode=self.mode, initial_state=memory, output_final_state=return_state
        )
        y = 2 * torch.einsum("btp,hp->bth", x[:, :, 0], as_complex(self.C)).real
        return (y + self.D * u).to(u.dtype), m

    def forward(self, x: Tensor, state: SSMState | None = None, return_state: bool = False):
        """x [B, T, H] -> y [B, T, H] (and the final SSMState when asked)."""
        self.check_input(x)
        y, m = self.ssm(x, state.memory if state is not None else None, return_state)
        g = F.gelu(y, approximate="tanh")  # flax nn.gelu's default (the official s5/layers.py)
        y = g * torch.sigmoid(self.out2(g))
        return (y, SSMState(memory=m)) if return_state else y

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, 1, 1, self.d_state // 2, dtype=self._memory_dtype(True), device=self.Lambda_re.device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="S5",
            input="B_bar u_t (MIMO projection, P/2 complex)",
            expand="1 (B_bar moved into the input projection)",
            oscillation="Lambda_bar = exp(Lambda Delta), diagonal complex (HiPPO-N init)",
            shrink="1, then y_t = 2 Re(C~ m_t) + D u_t",
            memory=f"K x D = 1 x {self.d_state // 2} complex (the MIMO state)",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="S5 (Smith et al., 2023), section 3-4; LCSM Table 1 row S5 with a diagonal A (eq. 9)",
        )


# ----------------------------------------------------------------------------- S4 (NPLR)


def krylov(v: Tensor, M: Tensor, length: int) -> Tensor:
    """Rows v M^j for j < length by repeated doubling: v [H, N], M [H, N, N] -> [H, length, N]."""
    rows, power = v.unsqueeze(1), M
    while rows.shape[1] < length:
        rows = torch.cat([rows, rows @ power], dim=1)
        power = power @ power
    return rows[:, :length]


# Entries of the [H, rows, N2] matrix that cauchy_conj forms at a time: a few MB, so that a block's
# temporaries stay in cache (S4 kernel, H 128, N 64, 16K tokens, forward and backward on one CPU
# core: 2.7 s at 2^19, 3.2 s at 2^21, 6.4 s at 2^23).
CAUCHY_BLOCK = 2**19


def _row_blocks(g: Tensor, n2: int, *others: Tensor):
    rows = max(1, CAUCHY_BLOCK // (g.shape[0] * n2))
    return zip(*(x.split(rows, dim=1) for x in (g,) + others), strict=False)


def _pair_inverse(g: Tensor, a: Tensor, s: Tensor) -> Tensor:
    """1 / ((g - lam)(g - conj(lam))) = 1 / (g (g - 2 Re lam) + |lam|^2): g [H, M], a = Re lam and
    s = |lam|^2 [H, N2] -> [H, M, N2]."""
    g = g.unsqueeze(-1)
    return 1 / (g * (g - 2 * a.unsqueeze(1)) + s.unsqueeze(1))


class _CauchyConj(torch.autograd.Function):
    """S = q @ W with q = _pair_inverse(g, a, s), computed and differentiated a block of rows (roots
    of unity) at a time, recomputing q in the backward pass: autograd would keep several [H, M, N2]
    complex intermediates (gigabytes at 16K tokens) and spend most of S4's step on them."""

    @staticmethod
    def forward(ctx, g: Tensor, a: Tensor, s: Tensor, W: Tensor) -> Tensor:
        ctx.save_for_backward(g, a, s, W)
        Wc = W.to(g.dtype)
        return torch.cat([_pair_inverse(gb, a, s) @ Wc for (gb,) in _row_blocks(g, a.shape[1])], dim=1)

    @staticmethod
    def backward(ctx, grad_S: Tensor):
        g, a, s, W = ctx.saved_tensors
        Wc = W.to(g.dtype)
        ones_a = torch.stack([torch.ones_like(a), a], dim=-1).to(g.dtype)  # [H, N2, 2]
        grad_g, grad_as, grad_W = [], 0, 0
        for gb, Sb in _row_blocks(g, a.shape[1], grad_S):
            q = _pair_inverse(gb, a, s)
            grad_W = grad_W + (q.conj().transpose(1, 2) @ Sb).real
            # Through q = 1 / D: the cotangent of D is -grad_q conj(q)^2, with D holomorphic in g
            # (dD/dg = 2 g - 2 a) and real-affine in a (dD/da = -2 g) and s (dD/ds = 1).
            t = -(Sb @ Wc.transpose(1, 2)) * q.conj().square()  # [H, c, N2]
            u = t @ ones_a  # [H, c, 2]
            grad_g.append(2 * (gb.conj() * u[..., 0] - u[..., 1]))
            lhs = torch.stack([-2 * gb.conj(), torch.ones_like(gb)], dim=1)  # [H, 2, c]
            grad_as = grad_as + (lhs @ t).real  # [H, 2, N2]
        return torch.cat(grad_g, dim=1), grad_as[:, 0], grad_as[:, 1], grad_W


def cauchy_conj(W: Tensor, g: Tensor, lam: Tensor) -> Tensor:
    """Cauchy sums over conjugate pairs, S[h, m, k] = sum_n W[h, n, k] / ((g[h, m] - lam[h, n])
    (g[h, m] - conj(lam[h, n]))): W [H, N2, K] real, g [H, M] and lam [H, N2] complex -> [H, M, K]."""
    return _CauchyConj.apply(g, lam.real, lam.real.square() + lam.imag.square(), W)


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
      the M-th roots of unity as 2/(1+z) C~ (g(z) - A)^-1 B, g(z) = 2/Delta (1-z)/(1+z) (Lemma C.3),
      by the Woodbury identity over the diagonal Lambda (four Cauchy sums, Lemma C.2, each taken
      over conjugate pairs by ``cauchy_conj``), then an inverse FFT gives K. M = T rounded up to an
      odd number so that z = -1 (a pole of 2/(1+z)) is never a root of unity. y = K * u by FFT on
      length 2T.
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

    Departure: the official code stores C~ = C (I - A_bar^L) for a fixed L as the parameter (saving
    A_bar^L per call) and converts it back to C for stepping. We store C and form C~ for the length
    at hand, so the model does not depend on a maximum length and its recurrence is exact at any T.

    Args:
        d_model: channels H.
        d_state: N (even); N/2 parameters per conjugate pair. Default 64 (the paper's).
        dt_min, dt_max: range of the log-uniform Delta init.
        mode: "auto" (recurrent when T = 1, else fft), "fft" or "recurrent".
        b_clip: bound on |Im B| at init (official 2.0); None keeps the exact HiPPO-LegS B.
    """

    float32_parameters = ("log_A_real", "A_imag", "P", "B", "C", "log_dt")

    def __init__(
        self,
        d_model: int,
        d_state: int = 64,
        dt_min: float = 1e-3,
        dt_max: float = 1e-1,
        mode: str = "auto",
        b_clip: float | None = 2.0,
    ):
        super().__init__(d_model)
        self.d_state = _check_even("d_state", d_state)
        dt_min, dt_max = _check_dt(dt_min, dt_max)
        if b_clip is not None and (isinstance(b_clip, bool) or not isinstance(b_clip, (int, float)) or not b_clip > 0):
            raise ValueError(f"b_clip: expected a positive number or None (no clipping), got {b_clip!r}")
        self.mode = _check_mode(mode, S4_MODES)
        H, N, N2 = d_model, d_state, d_state // 2
        Lam, V = hippo_normal_eig(N)
        # Columns with omega > 0: one of each pair; the others are their conjugates.
        Lam, V = Lam[N2:], V[:, N2:]
        _, B, P = hippo_legs(N)
        Vh = V.conj().t()
        B = Vh @ B.to(torch.complex128)
        if b_clip is not None:
            B = torch.complex(B.real, B.imag.clamp(-b_clip, b_clip))
        self.log_A_real = no_weight_decay(nn.Parameter((-Lam.real).log().expand(H, N2).to(_dtype()).contiguous()))
        self.A_imag = no_weight_decay(nn.Parameter(Lam.imag.expand(H, N2).to(_dtype()).contiguous()))
        self.P = no_weight_decay(complex_param((Vh @ P.to(torch.complex128)).expand(H, N2)))
        self.B = no_weight_decay(complex_param(B.expand(H, N2)))
        self.C = complex_param(torch.randn(H, N2, dtype=torch.complex128))
        self.log_dt = no_weight_decay(nn.Parameter(log_dt_init(H, dt_min, dt_max).to(_dtype())))
        self.D = no_weight_decay(nn.Parameter(torch.randn(H)))
        self.output_linear = nn.Linear(H, 2 * H)
        self._discretized = None

    # -- the system

    def half_system(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(Lambda, P, B, C), one mode of each conjugate pair, each [H, N/2] complex."""
        Lam = torch.complex(-self.log_A_real.exp(), self.A_imag)
        return Lam, as_complex(self.P), as_complex(self.B), as_complex(self.C)

    def full_system(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(Lambda, P, B, C) of the full conjugate-symmetric system, each [H, N] complex."""
        return tuple(torch.cat([v, v.conj()], dim=-1) for v in self.half_system())

    def continuous_A(self) -> Tensor:
        """A = diag(Lambda) - P P^* [H, N, N] (complex)."""
        Lam, P, _, _ = self.full_system()
        return torch.diag_embed(Lam) - P.unsqueeze(-1) * P.conj().unsqueeze(-2)

    def discretize(self) -> tuple[Tensor, Tensor]:
        """Bilinear: (A_bar [H, N, N], B_bar [H, N]) of the full system.

        With autograd off (decoding, evaluation) the result is kept until a parameter it depends on
        changes (in place, as an optimizer step does, or by a new dtype, device or tensor): decoding
        steps one token at a time, and the N x N solve costs more than the step itself."""
        if torch.is_grad_enabled():
            return self._discretize()
        params = (self.log_A_real, self.A_imag, self.P, self.B, self.log_dt)
        cached = self._discretized
        # The key holds each parameter's storage, so a pointer seen again is the same storage.
        if cached is None or not all(
            d.data_ptr() == p.data_ptr() and d.dtype == p.dtype and d.device == p.device and v == p._version
            for (d, v), p in zip(cached[0], params, strict=False)
        ):
            cached = self._discretized = ([(p.data, p._version) for p in params], self._discretize())
        return cached[1]

    def _discretize(self) -> tuple[Tensor, Tensor]:
        _, _, B, _ = self.full_system()
        A = self.continuous_A()
        dt = self.log_dt.exp().to(A.dtype).view(-1, 1, 1)
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        # One solve for both right-hand sides [I + Delta/2 A | Delta B].
        X = torch.linalg.solve(eye - dt / 2 * A, torch.cat([eye + dt / 2 * A, dt * B.unsqueeze(-1)], dim=-1))
        return X[..., :-1], X[..., -1]

    def kernel(self, length: int) -> Tensor:
        """K_j = Re(C A_bar^j B_bar), j < length, by the S4 algorithm (Cauchy + Woodbury): [H, length]."""
        return self._kernel(length, self.discretize()[0])

    def _truncated_C(self, C: Tensor, A_bar: Tensor, M: int) -> Tensor:
        """C~ = C (I - A_bar^M) for one mode of each conjugate pair (C~ is conjugate-symmetric, as C
        is): C [H, N/2] -> [H, N/2]. The power is taken in the real coordinates [Re x, Im x] of the
        state [x, conj(x)], where A_bar is a real N x N matrix, at a quarter of the complex cost;
        at short lengths this power and its gradient are most of S4's kernel."""
        N2 = C.shape[-1]
        A11, A12 = A_bar[:, :N2, :N2], A_bar[:, :N2, N2:]
        S, D = A11 + A12, A11 - A12  # x' = S Re x + i D Im x
        A_real = torch.cat([torch.cat([S.real, -D.imag], -1), torch.cat([S.imag, D.real], -1)], -2)
        # C x + conj(C x) = [Re C, -Im C] . 2 [Re x, Im x], so C A_bar^M has halves (rho_1 - i rho_2).
        rho = torch.einsum("hn,hnm->hm", torch.cat([C.real, -C.imag], -1), torch.linalg.matrix_power(A_real, M))
        return C - torch.complex(rho[:, :N2], -rho[:, N2:])

    def _kernel(self, length: int, A_bar: Tensor) -> Tensor:
        lam, Ph, Bh, C = self.half_system()
        M = length if length % 2 else length + 1
        dt = self.log_dt.exp().unsqueeze(-1)  # [H, 1]
        C_t = self._truncated_C(C, A_bar, M)
        k = torch.arange(M, device=lam.device, dtype=dt.dtype)
        z = torch.exp(-2j * math.pi * k / M)  # [M]
        g = (2 / dt) * (1 - z) / (1 + z)  # [H, M]
        # The four Cauchy sums sum_n a_n b_n / (g - Lambda_n) run over conjugate pairs (the official
        # cauchy_conj): v / (g - lam) + conj(v) / (g - conj(lam)) = (2 Re(v) g - 2 Re(v conj(lam)))
        # / ((g - lam)(g - conj(lam))), so one [H, M, N/2] matrix serves all four sums.
        v = torch.stack([C_t * Bh, C_t * Ph, Ph.conj() * Bh, Ph.conj() * Ph], dim=-1)  # [H, N/2, 4]
        W = 2 * torch.cat([v.real, (v * lam.conj().unsqueeze(-1)).real], dim=-1)  # [H, N/2, 8]
        S = cauchy_conj(W, g, lam)  # [H, M, 8]
        k00, k01, k10, k11 = (g.unsqueeze(-1) * S[..., :4] - S[..., 4:]).unbind(-1)
        K_hat = 2 / (1 + z) * (k00 - k01 * k10 / (1 + k11))  # (g - Lambda + P P^*)^-1
        return torch.fft.ifft(K_hat, n=M, dim=-1)[..., :length].real

    # -- the two forms

    def _fft(self, u: Tensor, x0: Tensor | None, return_state: bool):
        T = u.shape[1]
        A_bar, B_bar = self.discretize()
        K = self._kernel(T, A_bar)  # [H, T]
        n = 2 * T
        uf = torch.fft.rfft(u.transpose(1, 2), n=n)
        y = torch.fft.irfft(uf * torch.fft.rfft(K, n=n), n=n)[..., :T].transpose(1, 2)
        N2 = self.d_state // 2
        _, _, _, C = self.full_system()
        x_full = torch.cat([x0, x0.conj()], dim=-1) if x0 is not None else None
        if x_full is None and not return_state:
            return y, None
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
        C = as_complex(self.C)
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

    def forward(self, x: Tensor, state: S4State | None = None, return_state: bool = False):
        """x [B, T, H] -> y [B, T, H] (and the final S4State when asked)."""
        self.check_input(x)
        y, s = self.ssm(x, state.x if state is not None else None, return_state)
        y = _gelu_glu(y, self.output_linear)
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
