"""Delta-rule mixers: the matrix-oscillation rows of LCSM Table 7 (appendix 5.2).

    m_t = o_t m_{t-1} + e_t v_t^T,   y_t = m_t^T q_t

    fwp / deltanet  o_t = I - beta_t k_t k_t^T,   e_t = beta_t k_t   (Schlag et al. 2021, LCSM eq. 13)
    m1              o_t = I - k_t k_t^T,          e_t = k_t
    m2              o_t = I - k_t kbar_t^T,       e_t = k_t
    m3              o_t = I - Diag{k_t},          e_t = k_t           (diagonal: psi = elementwise)

fwp, m1 and m2 run on :func:`lcsm.ops.eos_delta` (a dense K x K oscillation the elementwise EOS op
cannot express); m3 is diagonal and runs on :func:`lcsm.ops.eos`. See docs/zoo/delta_rule.md.

Shape glossary: B batch, T time, H heads, K key width per head (memory rows), D value width per
head (memory columns) = d_model / H, d_model model width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import eos, eos_delta
from ..ops.delta import DELTA_MODES
from .base import EOSRow, Mixer, State, no_weight_decay, register

Tensor = torch.Tensor

# fla's l2norm epsilon: keeps the normalisation finite when a projection is exactly zero.
_L2_EPS = 1e-6
_EOS_MODES = ("auto", "recurrent", "parallel", "chunk")


@dataclass
class DeltaState(State):
    """memory: the fast weight matrix m_t (W_t of Schlag et al.) [B, H, K, D]."""

    memory: Tensor


def _l2norm(x: Tensor) -> Tensor:
    return F.normalize(x, dim=-1, eps=_L2_EPS)


class _DeltaBase(Mixer):
    """Shared layout: q, k, v projections into H heads, a K x D memory per head, a per-head
    RMSNorm on the read-out and an output projection.

    The output RMSNorm (weight over D, shared by the heads) follows DeltaNet (Yang et al. 2024;
    fla's ``RMSNorm(head_v_dim)``): the delta rule keeps ||m|| bounded but not at a fixed scale, and
    the norm makes the layer's output scale independent of how full the memory is.
    """

    modes = DELTA_MODES

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__(d_model)
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or d_model % heads:
            raise ValueError(f"heads: expected a positive integer dividing d_model={d_model}, got {heads!r}")
        numeric = isinstance(expand_k, (int, float)) and not isinstance(expand_k, bool)
        key_total = d_model * expand_k if numeric else 0
        if not numeric or expand_k <= 0 or key_total != int(key_total) or int(key_total) % heads:
            raise ValueError(
                f"expand_k: expected a positive number with d_model * expand_k divisible by heads={heads} "
                f"(d_model={d_model}), got {expand_k!r}"
            )
        if not isinstance(output_norm, bool):
            raise ValueError(f"output_norm: expected True or False, got {output_norm!r}")
        if mode not in self.modes:
            raise ValueError(f"mode: expected one of {', '.join(self.modes)}, got {mode!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
        self.heads, self.mode, self.chunk_size = heads, mode, chunk_size
        self.head_k = int(key_total) // heads
        self.head_v = d_model // heads
        # No biases, as in fla's DeltaNet projections.
        self.q_proj = nn.Linear(d_model, heads * self.head_k, bias=False)
        self.k_proj = nn.Linear(d_model, heads * self.head_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_norm = no_weight_decay(nn.Parameter(torch.ones(self.head_v))) if output_norm else None

    # -- helpers ---------------------------------------------------------------------------------
    def _heads(self, x: Tensor, width: int) -> Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, width)

    def _readout(self, y: Tensor) -> Tensor:
        """y [B, T, H, D] -> [B, T, d_model]."""
        if self.o_norm is not None:
            y = F.rms_norm(y, (self.head_v,), self.o_norm, eps=1e-5)
        return self.o_proj(y.reshape(y.shape[0], y.shape[1], self.d_model))

    def _initial(self, state: DeltaState | None, batch: int) -> Tensor | None:
        if state is None:
            return None
        if not isinstance(state, DeltaState):
            raise ValueError(f"state: expected a DeltaState from this mixer, got {type(state).__name__}")
        want = (batch, self.heads, self.head_k, self.head_v)
        if tuple(state.memory.shape) != want:
            raise ValueError(f"state: memory must be [B, H, K, D] = {list(want)}, got {list(state.memory.shape)}")
        return state.memory

    def init_state(self, batch_size: int) -> DeltaState:
        p = self._param_like()
        return DeltaState(
            memory=p.new_zeros(batch_size, self.heads, self.head_k, self.head_v, dtype=self._memory_dtype())
        )

    def _memory_str(self) -> str:
        return f"K x D = {self.head_k} x {self.head_v} per head, {self.heads} heads"

    # -- the recurrence ----------------------------------------------------------------------------
    def _qkv(self, x: Tensor):
        """q, k [B, T, H, K] (SiLU then L2-normalised per head, as in DeltaNet) and v [B, T, H, D]."""
        q = _l2norm(F.silu(self._heads(self.q_proj(x), self.head_k)))
        k = _l2norm(F.silu(self._heads(self.k_proj(x), self.head_k)))
        return q, k, self._heads(self.v_proj(x), self.head_v)

    def _delta_states(self, x: Tensor):
        """Returns (e, s, a, b) [B, T, H, K] and i [B, T, H, D] of eos_delta."""
        raise NotImplementedError

    def _mix(self, x: Tensor, m0: Tensor | None, return_state: bool):
        """x [B, T, d_model] -> (y [B, T, H, D], m_T [B, H, K, D] or None)."""
        e, s, a, b, i = self._delta_states(x)
        return eos_delta(
            i, e, s, a, b, mode=self.mode, initial_state=m0, output_final_state=return_state, chunk_size=self.chunk_size
        )

    def forward(self, x: Tensor, state: DeltaState | None = None, return_state: bool = False):
        self.check_input(x)
        y, m = self._mix(x, self._initial(state, x.shape[0]), return_state)
        # A carried float32 state (a half-precision layer's) promotes the operator's output.
        y = self._readout(y.to(x.dtype))
        return (y, DeltaState(memory=m)) if return_state else y


@register("fwp", "deltanet")
class FastWeightProgrammer(_DeltaBase):
    """Fast weight programmer with the delta rule (Schlag et al. 2021 sec. 4.2, eq. 13 of LCSM; DeltaNet,
    Yang et al. 2024)::

        W_t = W_{t-1} + beta_t k_t (v_t - W_{t-1}^T k_t)^T = (I - beta_t k_t k_t^T) W_{t-1} + beta_t k_t v_t^T
        y_t = W_t^T q_t

    i.e. eos_delta with a = e = beta k, b = k, s = q. beta_t = sigmoid(Linear(x)) per head (one
    learning rate per head and token). q and k are SiLU then L2-normalised per head (Yang et al.
    2024; fla's qk_activation='silu', qk_norm='l2'). With ||k|| = 1 and beta in (0, 1),
    I - beta k k^T has eigenvalues 1 and 1 - beta: the update is non-expansive and the memory
    stays bounded. (Schlag et al. sum-normalise positive DPFP features, which also gives
    ||k||_2 <= 1; Yang et al. found SiLU + L2 to train better.) The query is then scaled by K^-1/2
    as fla's kernels do (fla/ops/delta_rule ``chunk_delta_rule``, scale None -> K^-0.5): the output
    RMSNorm removes the factor only up to its eps, and without it the layer's output moves by
    1.2-3.2 % relative RMS at init (docs/zoo/delta_rule.md).
    """

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__(d_model, heads, expand_k, output_norm, mode, chunk_size)
        self.beta_proj = nn.Linear(d_model, heads, bias=False)

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        beta = torch.sigmoid(self.beta_proj(x)).unsqueeze(-1)
        bk = beta * k
        return bk, q * self.head_k**-0.5, bk, k, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="FWP / DeltaNet",
            input="v_t",
            expand="beta_t k_t",
            oscillation="I_k - beta_t k_t k_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="Schlag et al. 2021 (Linear Transformers Are Secretly Fast Weight Programmers); "
            "Yang et al. 2024 (DeltaNet, parallel delta rule); LCSM Table 7, eq. 13",
        )


@register("m1")
class DeltaM1(_DeltaBase):
    """LCSM Table 7 row M1: o_t = I - k_t k_t^T, e_t = k_t, s_t = q_t.

    k is L2-normalised (after SiLU, as in fwp): then I - k k^T is the orthogonal projector that
    erases the memory along k before k v^T is written there, so every factor is non-expansive
    (eigenvalues 0 and 1). Without the normalisation ||k|| > sqrt(2) makes it expansive and the
    product over T diverges. M1 is DeltaNet with beta fixed to 1 (pure overwrite).
    """

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        return k, q, k, k, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M1",
            input="v_t",
            expand="k_t",
            oscillation="I_k - k_t k_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )


@register("m2")
class DeltaM2(_DeltaBase):
    """LCSM Table 7 row M2: o_t = I - k_t kbar_t^T with a second key kbar_t, e_t = k_t, s_t = q_t.

    The paper leaves kbar open. Independent unit k and kbar make the product of the oscillations
    grow geometrically (measured: ||prod|| ~ 1e25 after 2048 random steps at K = 16), because
    I - k kbar^T is far from normal when k and kbar are far apart. So kbar is a bounded tilt of k:

        k_hat = L2norm(k),  delta = Linear(x),  kbar = L2norm(k_hat + delta / (1 + ||delta||)).

    ||delta / (1 + ||delta||)|| < 1 keeps kbar within 90 degrees of k (k_hat . kbar > 0), so the
    rank-one eigenvalue 1 - k_hat . kbar of each factor lies in [0, 1): the memory is erased (not
    amplified) along k as in M1, and kbar only tilts which component of the memory is read out.
    """

    def __init__(
        self,
        d_model: int,
        heads: int = 4,
        expand_k: float = 1.0,
        output_norm: bool = True,
        mode: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__(d_model, heads, expand_k, output_norm, mode, chunk_size)
        self.kbar_proj = nn.Linear(d_model, heads * self.head_k, bias=False)

    def _delta_states(self, x):
        q, k, v = self._qkv(x)
        delta = self._heads(self.kbar_proj(x), self.head_k)
        kbar = _l2norm(k + delta / (1 + delta.norm(dim=-1, keepdim=True)))
        return k, q, k, kbar, v

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M2",
            input="v_t",
            expand="k_t",
            oscillation="I_k - k_t kbar_t^T",
            shrink="q_t",
            memory=self._memory_str(),
            psi="matrix",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )


@register("m3")
class DeltaM3(_DeltaBase):
    """LCSM Table 7 row M3: o_t = I - Diag{k_t}, e_t = k_t, s_t = q_t.

    A diagonal oscillation is psi = elementwise, so this runs on :func:`lcsm.ops.eos` with the row
    decay log o_t = log(1 - k_t):  m_t[r] = (1 - k_t[r]) m_{t-1}[r] + k_t[r] v_t.

    k_t = sigmoid(Linear(x)) so k_t in (0, 1): the decay 1 - k_t is in (0, 1) (stable, its log is
    defined, computed as logsigmoid(-z) without cancellation) and each memory row becomes a convex
    combination of its past and v_t, an input-dependent exponential moving average whose forget
    and input gates are tied (as in a GRU update gate or HGRN). q is a plain projection.
    """

    modes = _EOS_MODES

    def _mix(self, x: Tensor, m0: Tensor | None, return_state: bool):
        z = self._heads(self.k_proj(x), self.head_k)
        k = torch.sigmoid(z)
        log_o = F.logsigmoid(-z).unsqueeze(-1)  # log(1 - k) [B, T, H, K, 1]
        q = self._heads(self.q_proj(x), self.head_k)
        v = self._heads(self.v_proj(x), self.head_v)
        return eos(
            v,
            k,
            q,
            log_o,
            mode=self.mode,
            initial_state=m0,
            output_final_state=return_state,
            chunk_size=self.chunk_size,
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="M3",
            input="v_t",
            expand="k_t",
            oscillation="I_k - Diag{k_t}",
            shrink="q_t",
            memory=self._memory_str(),
            psi="elementwise",
            input_dd=True,
            expand_dd=True,
            oscillation_dd=True,
            shrink_dd=True,
            paper="LCSM (Qin et al. 2024), appendix 5.2, Table 7 (proposed, untested in the paper)",
        )
