"""The LCSM ablation family (LCSM paper sections 2.4-2.5, Tables 2-5): one mixer, ``lcsm``, whose
model code ``"e-o-s-a"`` chooses how the Expand, Oscillation and Shrink states are computed.

    i_t = W_i x_t                                            (input state, Linear(d, d), no bias)
    m_t = o_t * m_{t-1} + e_t (x) i_t                        (LCSM eq. 2 and 6, psi = elementwise)
    y_t = m_t^T s_t                                          (eq. 3)
    out_t = W_out LayerNorm(y_t)                             (official ``EOS`` layer; no output gate)

Model code (section 2.5): ``e`` and ``s`` are 0 (data-independent, a learned K x D matrix used
elementwise) or 1 (data-dependent, Linear(d -> K)(x_t)); ``o`` (0-11) picks the oscillation
construction of Table 3 (read from the official code, GitHub ``Doraemonzzz/Lcsm``
``mnet_pytorch/modules/lcsm.py`` class ``EOS``, because the paper's colour legend for data
dependence was lost); ``a`` (0-7) is the activation of Table 2,
applied to both e and s. ``param="ssm"`` is the paper's separate code "0" (Table 5): a Mamba-like
parameterisation without convolution or gate, which fixes e, o and s and takes no code. Its
Delta starts in [1e-3, 1e-1] through a bias, as Mamba's (``delta_bias``; the official code has
no bias, see docs/zoo/lcsm_family.md).

Every data-dependent decay is ``sigmoid(z)^(1/tau)``, computed in log space as
``log_o = logsigmoid(z) / tau`` (section 2.4, "Data Dependency"). See docs/zoo/lcsm_family.md for
the full code table and every departure from the official code.

Packed sequences (``cu_seqlens``): one EOS call (rotating or not) over the row, the memory restarting
per document; every other step is per token.

Shape glossary: B batch, T time, H = 1 head (the official layer has one), K = ``expand`` (memory
rows; code 11 keeps K complex rows), D = d_model (memory columns), d = d_model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool
from ..ops import LogO, LogProduct, eos, eos_rotating, log_sigmoid_product
from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor

DEFAULT_CODE = "1-9-1-0"  # the best code of the paper's O-types test (Table 4, WikiText-103)
SSM_RANK = 16  # the official ``ssm_dim``: delta = softplus(Linear(16 -> d)(Linear(d -> 16)(x)))
# Mamba's Delta init range (mamba_simple.Mamba dt_min, dt_max, dt_init_floor), used by delta_bias.
SSM_DT_MIN, SSM_DT_MAX, SSM_DT_FLOOR = 1e-3, 1e-1, 1e-4

E_MEANING = {0: "data-independent K x D matrix", 1: "data-dependent Linear(d -> K)(x_t)"}
S_MEANING = E_MEANING
A_MEANING = {
    0: "x",
    1: "relu(x)",
    2: "sigmoid(x)",
    3: "1 + elu(x)",
    4: "silu(x)",
    5: "elu(x)",
    6: "relu(x)^2",
    7: "x^2",
}
# Table 3, with data dependence read from the official code (Doraemonzzz/Lcsm, class EOS).
O_MEANING = {
    0: "k d: learned K x D decay (data-independent)",
    1: "k_t, d_t -> k d: outer product of two data-dependent decays",
    2: "d_t broadcast to k d: data-dependent column decay",
    3: "k_t broadcast to k d: data-dependent row decay (GLA-like)",
    4: "k broadcast to k d: learned row decay (data-independent)",
    5: "d broadcast to k d: learned column decay (data-independent)",
    6: "k_t, k d -> k d: data-dependent k times learned K x D, inside the sigmoid",
    7: "d_t, k d -> k d: data-dependent d times learned K x D, inside the sigmoid",
    8: "d_t, k -> k d: data-dependent d times learned k, inside the sigmoid",
    9: "k_t, d -> k d: data-dependent k times learned d, inside the sigmoid",
    10: "J (all ones): no decay, linear attention",
    11: "exp(i Theta) 1^T: fixed rotation, theta_j = 10000^(-2j/d)",
}
O_DATA_DEPENDENT = frozenset({1, 2, 3, 6, 7, 8, 9})
O_ALIBI = frozenset({0, 4, 5})
_CODE_RE = re.compile(r"^\s*(-?\d+)\s*-\s*(-?\d+)\s*-\s*(-?\d+)\s*-\s*(-?\d+)\s*$")

_ACTIVATIONS = {
    0: lambda x: x,
    1: F.relu,
    2: torch.sigmoid,
    3: lambda x: 1 + F.elu(x),
    4: F.silu,
    5: F.elu,
    6: lambda x: F.relu(x) ** 2,
    7: lambda x: x**2,
}


def _table(meanings: dict[int, str]) -> str:
    return "; ".join(f"{k} = {v}" for k, v in meanings.items())


def parse_code(code: str) -> tuple[int, int, int, int]:
    """``"e-o-s-a"`` -> (e, o, s, a), each field range-checked (LCSM section 2.5)."""
    if not isinstance(code, str):
        raise ValueError(
            f"code: expected a model code string 'e-o-s-a' such as {DEFAULT_CODE!r}, got {type(code).__name__} {code!r}"
        )
    match = _CODE_RE.match(code)
    if match is None:
        raise ValueError(
            f"code: expected 'e-o-s-a' (four integers joined by '-', e.g. {DEFAULT_CODE!r}), got {code!r}. "
            f"e, s in 0-1 ({_table(E_MEANING)}); o in 0-11 (Table 3); a in 0-7 (Table 2: {_table(A_MEANING)})"
        )
    e, o, s, a = (int(g) for g in match.groups())
    checks = (
        ("e (expand type)", e, E_MEANING),
        ("o (oscillation type)", o, O_MEANING),
        ("s (shrink type)", s, S_MEANING),
        ("a (activation type)", a, A_MEANING),
    )
    for field, value, meanings in checks:
        if value not in meanings:
            raise ValueError(
                f"code: field {field} of {code!r} must be in {min(meanings)}-{max(meanings)}, got {value}. "
                f"Valid values: {_table(meanings)}"
            )
    return e, o, s, a


def alibi_slopes(n: int) -> list[float]:
    """ALiBi head slopes (Press et al. 2022) for n "heads", as the official LCSM code builds them.

    For n a power of two: start = 2^(-8/n) and slope_i = start^(i+1), i = 0..n-1. Otherwise the
    ALiBi workaround: the slopes of the largest power of two p < n, then every other slope of 2p.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive integer, got {n!r}")

    def power_of_two(m: int) -> list[float]:
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]

    if n & (n - 1) == 0:
        return power_of_two(n)
    p = 2 ** int(math.floor(math.log2(n)))
    return power_of_two(p) + alibi_slopes(2 * p)[0::2][: n - p]


def alibi_decay_logits(n: int, tau: float) -> Tensor:
    """Logits z (float64, [n]) with sigmoid(z)^(1/tau) = exp(-slope) for the n ALiBi slopes.

    ALiBi adds the bias -slope * (t - j) to the attention logit of key j at query t; as a
    recurrence that is a per-step decay exp(-slope) in (0, 1), because the product of the decays
    from j+1 to t is exp(-slope * (t - j)). The official code stores the slopes negated and then
    applies exp(-(stored)) = exp(+slope) > 1 for o code 0 (a sign bug); here the decay is
    exp(-slope). The learned decays are parameterised as sigmoid(z)^(1/tau) like every other decay
    of the paper, so z solves sigmoid(z) = exp(-tau * slope):
        z = -log(expm1(tau * slope)) = -(x + log(-expm1(-x))),  x = tau * slope   (stable for all x > 0).
    """
    x = tau * torch.tensor(alibi_slopes(n), dtype=torch.float64)
    return -(x + torch.log(-torch.expm1(-x)))


def rotary_theta(K: int, d_model: int, dtype=None, device=None) -> Tensor:
    """Code 11 frequencies theta_j = 10000^(-2j/d), j = 0..K-1 (official code), [K]."""
    j = torch.arange(K, dtype=torch.float64)
    return (10000.0 ** (-2.0 * j / d_model)).to(dtype=dtype, device=device)


@dataclass
class LCSMState(State):
    """memory m_t [B, 1, K, D]; complex for o code 11 (a rotation), real otherwise."""

    memory: Tensor


@register("lcsm")
class LCSMFamily(Mixer):
    """The LCSM layer for one model code (LCSM sections 2.4-2.5, Tables 2-3; official ``EOS`` layer).

    Args:
        d_model: model width d (= memory columns D).
        code: model code ``"e-o-s-a"`` for the linear parameterisation; None means
            ``"1-9-1-0"`` (the best code of Table 4). Not accepted with ``param="ssm"``, which
            fixes e, o and s itself.
        param: ``"linear"`` (e, o, s from linear projections or learned tensors, per the code)
            or ``"ssm"`` (the paper's code "0", Table 5: Mamba-like, S4D-real A).
        tau: the exponent 1/tau of every sigmoid decay (sigmoid(z)^(1/tau)); default 16 as in the
            paper. Codes 10 and 11 and ``param="ssm"`` have no sigmoid decay.
        expand: K, the memory rows. The paper uses 128 for MQAR; the official MQAR configs use
            128 or 64 depending on the version, the official layer default is 8. Default 64.
        delta_bias: ``param="ssm"`` only. True (default): Delta's second projection has a bias
            initialised as Mamba's (softplus^-1 of Delta ~ LogUniform[1e-3, 1e-1], weight
            U(-16^-1/2, 16^-1/2)), so Delta starts in [1e-3, 1e-1]. False: the official LCSM code
            (no bias, PyTorch's default init): Delta ~ softplus(0) = 0.69 at init, and with
            A = -(1..K) no memory row keeps half its content for one token. Runs made before this
            option existed used False.

    Shapes: x [B, T, d] -> y [B, T, d]; memory [B, 1, K, D] (complex for code 11).

    Code 11 (``exp(i Theta) 1^T``) is realised as a complex data-independent log oscillation
    ``log_o = i theta`` [1, K, 1] and the real part of y. The official code instead doubles e and
    s into ``[e cos(t theta), e sin(t theta)]`` (2K real rows, o = 1, absolute position t); both
    give y_t = sum_{j <= t} sum_k s_t[k] e_j[k] cos((t - j) theta_k) i_j exactly, and the tests
    check it. The complex form is shift-invariant, so a carried state needs no position counter,
    and it is defined for data-independent e and s too, where the official code asserts e and s
    data-dependent. With data-dependent e and s the layer computes it in the rotating frame
    (:func:`lcsm.ops.rotating.eos_rotating`: the official doubling made exact for carried states,
    on real kernels, faster than the complex kernel: ``bench/ops_bench.py`` case ``rotating``); a
    K x D e or s has no rotating-frame form and takes the complex kernel.
    """

    @classmethod
    def revision_for(cls, options: Mapping[str, Any]) -> int:
        # 2: param="ssm" starts Delta in Mamba's range (delta_bias); the linear codes are unchanged.
        ssm = options.get("param") == "ssm" and options.get("delta_bias", True)
        return 2 if ssm else 1

    def __init__(
        self,
        d_model: int,
        code: str | None = None,
        param: str = "linear",
        tau: float = 16.0,
        expand: int = 64,
        delta_bias: bool = True,
    ):
        super().__init__(d_model)
        if param not in ("linear", "ssm"):
            raise ValueError(f"param: expected 'linear' or 'ssm' (LCSM section 2.4, Table 5), got {param!r}")
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau: expected a positive finite number (decay sigmoid(z)^(1/tau)), got {tau!r}")
        if isinstance(expand, bool) or not isinstance(expand, int) or expand < 1:
            raise ValueError(f"expand: expected a positive integer K (memory rows), got {expand!r}")
        check_bool("delta_bias", delta_bias)
        if param == "ssm" and code is not None:
            raise ValueError(
                f"code: param='ssm' (the paper's code '0') fixes e, o and s (data-dependent e, s; "
                f"o = exp(delta A)) and takes no 'e-o-s-a' code, got code={code!r}; "
                "use param='linear' with a code, or param='ssm' alone"
            )
        self.param = param
        self.tau = float(tau)
        self.expand = expand
        K, d = expand, d_model

        self.i_proj = nn.Linear(d, d, bias=False)
        if param == "ssm":
            self.code = None
            self.e_type, self.o_type, self.s_type, self.a_type = 1, None, 1, 0
            self.delta_proj = nn.Sequential(nn.Linear(d, SSM_RANK, bias=False), nn.Linear(SSM_RANK, d, bias=delta_bias))
            if delta_bias:
                self._init_delta_bias(self.delta_proj[1])
            # S4D-real: A[k, :] = -(k + 1), stored as P = log(1..K) repeated over the D columns.
            self.A_log = no_weight_decay(
                nn.Parameter(
                    torch.log(torch.arange(1, K + 1, dtype=torch.float64))
                    .unsqueeze(1)
                    .repeat(1, d)
                    .to(torch.get_default_dtype())
                )
            )
            self.e_proj = nn.Linear(d, K, bias=False)
            self.s_proj = nn.Linear(d, K, bias=False)
        else:
            self.e_type, self.o_type, self.s_type, self.a_type = parse_code(DEFAULT_CODE if code is None else code)
            self.code = f"{self.e_type}-{self.o_type}-{self.s_type}-{self.a_type}"
            if self.e_type == 1:
                self.e_proj = nn.Linear(d, K, bias=False)
            else:
                self.e = nn.Parameter(torch.randn(K, d) * 0.1)
            if self.s_type == 1:
                self.s_proj = nn.Linear(d, K, bias=False)
            else:
                self.s = nn.Parameter(torch.randn(K, d) * 0.1)
            self._build_oscillation(self.o_type, K, d)
        self.norm = nn.LayerNorm(d)
        no_weight_decay(self.norm.weight)
        no_weight_decay(self.norm.bias)
        self.out_proj = nn.Linear(d, d, bias=False)

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _init_delta_bias(proj: nn.Linear) -> None:
        """Mamba's Delta init (state-spaces/mamba ``mamba_ssm/modules/mamba_simple.py``, Mamba.__init__,
        dt_init="random", dt_scale 1): weight ~ U(-R^-1/2, R^-1/2) with R the rank, and the bias
        softplus^-1 of Delta ~ LogUniform[1e-3, 1e-1] floored at 1e-4, so that softplus(bias), Delta
        for a zero input, starts in that range. The official LCSM code has no bias: its Delta starts
        at softplus(~0) = 0.69, which with A = -(1..K) forgets every row within a token."""
        with torch.no_grad():
            bound = SSM_RANK**-0.5
            proj.weight.uniform_(-bound, bound)
            dt = torch.exp(
                torch.rand(proj.out_features, dtype=torch.float64) * (math.log(SSM_DT_MAX) - math.log(SSM_DT_MIN))
                + math.log(SSM_DT_MIN)
            ).clamp(min=SSM_DT_FLOOR)
            # inverse softplus: dt + log(1 - exp(-dt)), written with expm1 for small dt
            proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        no_weight_decay(proj.bias)

    def _build_oscillation(self, o: int, K: int, d: int) -> None:
        """Parameters of oscillation code o (official init: projections default, learned factors
        of the mixed codes 6-9 randn * 0.1; the data-independent decays 0, 4, 5 use ALiBi)."""
        if o in O_ALIBI:
            # One ALiBi slope per decay entry, as the official code builds them (K*D, K or D slopes).
            shape = {0: (K, d), 4: (K,), 5: (d,)}[o]
            logits = alibi_decay_logits(math.prod(shape), self.tau).reshape(shape)
            self.o_logit = no_weight_decay(nn.Parameter(logits.to(torch.get_default_dtype())))
        elif o == 1:
            self.o_d_proj = nn.Linear(d, d, bias=False)
            self.o_k_proj = nn.Linear(d, K, bias=False)
        elif o in (2, 3):
            self.o_proj = nn.Linear(d, d if o == 2 else K, bias=False)
        elif o in (6, 7, 8, 9):
            self.o_proj = nn.Linear(d, K if o in (6, 9) else d, bias=False)
            shape = {6: (K, d), 7: (K, d), 8: (K,), 9: (d,)}[o]
            self.o_factor = no_weight_decay(nn.Parameter(torch.randn(shape) * 0.1))
        # o == 10: o = 1 (no parameters); o == 11: fixed frequencies, computed in eos_inputs.

    @classmethod
    def from_spec(cls, spec: str) -> dict[str, object]:
        """``"lcsm:<e>-<o>-<s>-<a>"`` -> {"code": ...}; ``"lcsm:ssm"`` -> {"param": "ssm"}."""
        if spec.strip() == "ssm":
            return {"param": "ssm"}
        if _CODE_RE.match(spec):
            return {"code": spec.strip()}
        raise ValueError(
            f"mixer 'lcsm': invalid spec {spec!r}. Valid forms: 'lcsm:<e>-<o>-<s>-<a>' (a model code, "
            f"e.g. 'lcsm:{DEFAULT_CODE}'; e, s in 0-1, o in 0-11, a in 0-7) or 'lcsm:ssm' "
            "(the SSM parameterisation, the paper's code '0')"
        )

    # ------------------------------------------------------------------ the EOS states

    def eos_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, LogO]:
        """The EOS states for x [B, T, d], in the shapes of :func:`lcsm.ops.eos` (H = 1):
        i [B, T, 1, D]; e, s data-dependent [B, T, 1, K] or data-independent [1, K, D] (after the
        activation); log_o [B, T, 1, K|1, D|1], [1, K|1, D|1] (complex i*theta for code 11),
        the separable pair ([B, T, 1, K, 1], [B, T, 1, 1, D]) (code 1), None (code 10) or, for the
        SSM, LogProduct(delta [B, T, 1, 1, D], A [1, K, D])."""
        B, T, _ = x.shape
        i = self.i_proj(x)
        if self.param == "ssm":
            delta = F.softplus(self.delta_proj(x))  # [B, T, D]
            i = delta * i  # Mamba's delta * B * u
            # log exp(delta A) as its operands [B, T, 1, 1, D] and [1, K, D], formed by the
            # elementwise kernel a block of steps at a time (LogProduct; Mamba does the same)
            log_o = LogProduct(delta[:, :, None, None, :], -torch.exp(self.A_log).unsqueeze(0))
            e, s = self.e_proj(x), self.s_proj(x)
            return i.unsqueeze(2), e.unsqueeze(2), s.unsqueeze(2), log_o

        act = _ACTIVATIONS[self.a_type]
        e = act(self.e_proj(x)).unsqueeze(2) if self.e_type == 1 else act(self.e).unsqueeze(0)
        s = act(self.s_proj(x)).unsqueeze(2) if self.s_type == 1 else act(self.s).unsqueeze(0)
        return i.unsqueeze(2), e, s, self._log_oscillation(x)

    def _log_oscillation(self, x: Tensor) -> LogO:
        o, tau = self.o_type, self.tau
        if o == 0:
            return F.logsigmoid(self.o_logit).unsqueeze(0) / tau  # [1, K, D]
        if o == 4:
            return F.logsigmoid(self.o_logit)[None, :, None] / tau  # [1, K, 1]
        if o == 5:
            return F.logsigmoid(self.o_logit)[None, None, :] / tau  # [1, 1, D]
        if o == 1:
            # o = a (x) b is passed as its two log factors, not their [B, T, 1, K, D] sum, so that
            # eos applies them along K and along D in its matmul kernel (the same decay; the full
            # K x D form would need the step-by-step elementwise kernel)
            log_k = F.logsigmoid(self.o_k_proj(x)) / tau
            log_d = F.logsigmoid(self.o_d_proj(x)) / tau
            return log_k[:, :, None, :, None], log_d[:, :, None, None, :]  # [B, T, 1, K, 1], [B, T, 1, 1, D]
        if o == 2:
            return (F.logsigmoid(self.o_proj(x)) / tau)[:, :, None, None, :]  # [B, T, 1, 1, D]
        if o == 3:
            return (F.logsigmoid(self.o_proj(x)) / tau)[:, :, None, :, None]  # [B, T, 1, K, 1]
        if o in (6, 7, 8, 9):
            # logsigmoid(a * b) / tau by the fused op: formed as tensor expressions, this [B, T, K, D]
            # decay cost more than the recurrence itself (lcsm/ops/decay.py)
            z = self.o_proj(x)
            if o in (6, 9):  # k_t, k d -> k d; k_t, d -> k d
                a, b = z.unsqueeze(-1), self.o_factor
            elif o == 7:  # d_t, k d -> k d
                a, b = z.unsqueeze(-2), self.o_factor
            else:  # d_t, k -> k d
                a, b = self.o_factor.unsqueeze(-1), z.unsqueeze(-2)
            return log_sigmoid_product(a, b, tau).unsqueeze(2)  # [B, T, 1, K, D]
        if o == 10:
            return None
        # at least float32: there is no complex bfloat16
        theta = rotary_theta(
            self.expand, self.d_model, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device
        )
        return torch.complex(torch.zeros_like(theta), theta)[None, :, None]  # [1, K, 1]

    # ------------------------------------------------------------------ Mixer interface

    @property
    def is_complex(self) -> bool:
        return self.o_type == 11

    def forward(
        self,
        x: Tensor,
        state: LCSMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        cu_seqlens = self.check_call(x, cu_seqlens)
        m0 = state.memory if state is not None else None
        i, e, s, log_o = self.eos_inputs(x)
        if self.is_complex and e.dim() == s.dim() == 4:
            # log_o = i theta exactly (its real part is the constant 0): Re(m_t^T s_t), which the
            # official [cos, sin] realisation computes, by the rotating frame's real kernels.
            y, m_T = eos_rotating(
                i,
                e,
                s,
                log_o.imag[..., 0],
                initial_state=m0,
                output_final_state=return_state,
                cu_seqlens=cu_seqlens,
            )
        else:
            y, m_T = eos(
                i,
                e,
                s,
                log_o,
                initial_state=m0,
                output_final_state=return_state,
                real_output=self.is_complex,
                cu_seqlens=cu_seqlens,
            )
        # A carried float32 state (a half-precision layer's) promotes the operator's output.
        y = self.out_proj(self.norm(y.squeeze(2).to(x.dtype)))
        return (y, LCSMState(memory=m_T)) if return_state else y

    def init_state(self, batch_size: int) -> LCSMState:
        return LCSMState(
            memory=torch.zeros(
                batch_size,
                1,
                self.expand,
                self.d_model,
                dtype=self._memory_dtype(self.is_complex),
                device=self._param_like().device,
            )
        )

    def describe(self) -> EOSRow:
        K, D = self.expand, self.d_model
        memory = f"K x D = {K} x {D}" + (" (complex)" if self.is_complex else "")
        paper = "LCSM (Qin et al. 2024) sec. 2.4-2.5, Tables 2-3, 5; official EOS layer"
        if self.param == "ssm":
            return EOSRow(
                name="LCSM ssm (code 0)",
                input="delta_t * i_t",
                expand="B_t = Linear(x_t)",
                oscillation="exp(delta_t A), A = -exp(P) (S4D-real)",
                shrink="C_t = Linear(x_t)",
                memory=memory,
                psi="elementwise",
                input_dd=True,
                expand_dd=True,
                oscillation_dd=True,
                shrink_dd=True,
                paper=paper,
            )

        def state(name: str, dd: bool) -> str:
            what = f"{name}_t = Linear(x_t) in R^K" if dd else f"{name} in R^(K x D), learned"
            if self.a_type == 0:
                return what
            arg = f"{name}_t" if dd else name
            return f"phi({arg}), {what}, phi(x) = {A_MEANING[self.a_type]}"

        expand, shrink = state("e", self.e_type == 1), state("s", self.s_type == 1)
        return EOSRow(
            name=f"LCSM {self.code}",
            input="i_t",
            expand=expand,
            oscillation=f"o code {self.o_type}: {O_MEANING[self.o_type]}",
            shrink=shrink,
            memory=memory,
            psi="elementwise",
            input_dd=True,
            expand_dd=self.e_type == 1,
            oscillation_dd=self.o_type in O_DATA_DEPENDENT,
            shrink_dd=self.s_type == 1,
            paper=paper,
        )

    def extra_repr(self) -> str:
        what = "param=ssm" if self.param == "ssm" else f"code={self.code!r}"
        return f"d_model={self.d_model}, {what}, tau={self.tau:g}, expand={self.expand}"
