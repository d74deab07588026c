"""TNN: the Toeplitz neural network's gated Toeplitz unit, run as a diagonal SSM (LCSM Table 1 row TNN).

TNN (Qin et al., ICLR 2023, section 3) mixes tokens with a causal Toeplitz matrix per channel,
y_t = sum_{j=0}^{t} k_j v_{t-j}, whose coefficients come from a relative position encoder (RPE: a
small MLP of the lag j) times an exponential decay, k_j = gamma^j RPE(j) (k_0 = RPE(0)).
Qin & Zhong (EMNLP 2023, "Accelerating Toeplitz Neural Network with Constant-time Inference
Complexity", ETSC) convert such a kernel of length n *exactly* into a diagonal SSM: pad the kernel
with t_n = -sum_{j<n} t_j so that its (n+1)-point DFT has no constant term, then the inverse DFT

    t_j = sum_{k=1}^{n} b_k w^(jk),  w = exp(-2 pi i / (n+1)),  b_k = (1/(n+1)) sum_{j=0}^{n} t_j w^(-jk)

writes the RPE kernel as n complex exponentials (a Vandermonde system solved in closed form); the
decay is put on the eigenvalues, lambda_k = gamma w^k, so that k_j = sum_k b_k lambda_k^j for
j = 0 .. n-1. That is LCSM's row (section 2.3): input x_t (here the GTU's v_t), B = the ETSC
coefficients b (n x d), A = Diag(lambda_1 .. lambda_n), C = J (all ones),
m_t = A m_{t-1} + B (1 v_t^T) elementwise, y_t = m_t^T 1 per channel.

EOS mapping, literally Table 1's row: one head (H = 1), K = n = l_max, D = d1 = expand_ratio * d_model;
i_t = v_t, e = B [1, n, d1] (a K x D expand matrix, complex), log_o = log lambda [1, n, 1] (a row
oscillation shared by the channels), s = 1_n; the real part is kept (b and lambda come in
conjugate pairs, so the imaginary part is zero up to rounding; ETSC keeps all n modes and so do
we). ``lcsm.ops.eos`` mode "auto" then takes the FFT path for any T > 1 and the O(n d1)
recurrence per token for decoding (ETSC's point). This one-head layout is also faster in the
op's chunk kernel than one head per channel with n modes each (one head's matmuls instead of d1
small ones).

Packed sequences (``cu_seqlens``): the FFT form once on the documents as padded rows
(``_ssm.PaddedDocuments``; the cost of N rows of the longest document, twice with final states).

The kernel is exact for lags j < l_max; for longer inputs the SSM continues with the periodic
ETSC extension gamma^j t_(j mod (n+1)) (t_n being the pad), not TNN's RPE extrapolation: l_max
should be the training length n, as in ETSC.

The mixer is TNN's GTU (official ``Gtu``): u = SiLU(W_u x), v = SiLU(W_v x), o = u * Toeplitz(v),
out = W_o o, with the RPE of the official ``Rpe``: Linear(1, r), ``rpe_layers`` x
(SimpleRMSNorm, ReLU, Linear(r, r)), then (SimpleRMSNorm, ReLU, Linear(r, d1)), evaluated at
the integer lags j (``par_type=1``). gamma is the official fixed decay (``use_decay``, 0.99, not
trained). Departure: ``rpe_dim`` defaults to 64 instead of the official constructor's 512, to keep
the RPE cheap at small widths (an option).

Shape glossary: B batch, T time, d = d_model, d1 = expand_ratio * d, n = l_max (SSM modes), r = rpe_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lcsm._checks import check_choice, check_int
from lcsm.ops import MODES, autocast_off

from ._ssm import SSMState, time_invariant_eos
from .base import EOSRow, Mixer, register

Tensor = torch.Tensor


def simple_rms_norm(x: Tensor, eps: float = 1e-8) -> Tensor:
    """TNN's SimpleRMSNorm (no weight): x / (||x|| / sqrt(dim) + eps)."""
    return x / (x.norm(dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + eps)


class RPE(nn.Module):
    """Relative position encoder: lag j (a float) -> kernel coefficients [d1]."""

    def __init__(self, dim: int, out_dim: int, layers: int):
        super().__init__()
        self.pos_proj = nn.Linear(1, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.out = nn.Linear(dim, out_dim)

    def forward(self, index: Tensor) -> Tensor:
        x = self.pos_proj(index.unsqueeze(-1))
        for layer in self.layers:
            x = layer(F.relu(simple_rms_norm(x)))
        return self.out(F.relu(simple_rms_norm(x)))


def etsc(t: Tensor, gamma: float):
    """ETSC (Qin & Zhong 2023, Algorithm 1): kernel t [n, C] -> (b [n, C], log lambda [n]) with
    sum_k b[k, c] lambda_k^j = gamma^j t[j, c] for j < n."""
    n = t.shape[0]
    m = n + 1
    padded = torch.cat([t, -t.sum(0, keepdim=True)], dim=0)  # the DFT's k = 0 term is 0
    b = torch.fft.ifft(padded, dim=0)[1:]  # [n, C]
    k = torch.arange(1, m, dtype=t.dtype, device=t.device)
    log_lam = torch.complex(torch.full_like(k, math.log(gamma)), -2 * math.pi * k / m)
    return b, log_lam


@register("tnn")
class TNN(Mixer):
    """TNN's gated Toeplitz unit with its Toeplitz operator realised as the ETSC diagonal SSM.

    Args:
        d_model: width d.
        expand_ratio: d1 = expand_ratio * d_model channels of u, v (official default 3).
        rpe_dim: width r of the RPE MLP.
        rpe_layers: hidden layers of the RPE (official 3).
        gamma: fixed exponential decay of the kernel, in (0, 1] (official 0.99).
        l_max: n, the kernel length converted exactly (= the number of SSM modes).
        mode: the ``lcsm.ops.eos`` mode.
    """

    float32_parameters = ("rpe.",)

    def __init__(
        self,
        d_model: int,
        expand_ratio: int = 3,
        rpe_dim: int = 64,
        rpe_layers: int = 3,
        gamma: float = 0.99,
        l_max: int = 512,
        mode: str = "auto",
    ):
        super().__init__(d_model)
        self.expand_ratio = check_int("expand_ratio", expand_ratio, 1)
        self.rpe_dim = check_int("rpe_dim", rpe_dim, 1)
        self.rpe_layers = check_int("rpe_layers", rpe_layers, 0)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise ValueError(f"gamma: expected a decay in (0, 1], got {gamma!r}")
        self.gamma = float(gamma)
        self.l_max = check_int("l_max", l_max, 1)
        self.mode = check_choice("mode", mode, MODES)
        d1 = self.d_inner = expand_ratio * d_model
        self.u_proj = nn.Linear(d_model, d1)
        self.v_proj = nn.Linear(d_model, d1)
        self.o = nn.Linear(d1, d_model)
        self.rpe = RPE(rpe_dim, d1, rpe_layers)

    def toeplitz_kernel(self) -> Tensor:
        """The RPE kernel without decay, t_j = RPE(j) for j < l_max: [l_max, d1]."""
        w = self.rpe.out.weight
        index = torch.arange(self.l_max, dtype=w.dtype, device=w.device)
        return self.rpe(index)

    def eos_parameters(self):
        """(e = B [1, n, d1], s = 1 [1, n], log_o = log lambda [1, n, 1]) for ``lcsm.ops.eos``."""
        b, log_lam = etsc(self.toeplitz_kernel(), self.gamma)  # [n, d1], [n]
        ones = torch.ones(1, self.l_max, dtype=b.real.dtype, device=b.device)
        return b.unsqueeze(0), ones, log_lam.view(1, -1, 1)

    def forward(
        self,
        x: Tensor,
        state: SSMState | None = None,
        return_state: bool = False,
        cu_seqlens: Tensor | None = None,
    ):
        """x [B, T, d] -> y [B, T, d] (and the final SSMState when asked)."""
        cu_seqlens = self.check_call(x, cu_seqlens)
        memory = state.memory if state is not None else None
        u = F.silu(self.u_proj(x))
        v = F.silu(self.v_proj(x))
        # The kernel outside autocast: the ETSC conversion is an FFT of the RPE's output, which
        # has no bfloat16 form (and would lose the kernel's tail to its rounding).
        with autocast_off(x.device):
            e, s, log_o = self.eos_parameters()
        y, m = time_invariant_eos(
            v.unsqueeze(2),
            e,
            s,
            log_o,
            mode=self.mode,
            initial_state=memory,
            output_final_state=return_state,
            real_output=True,
            cu_seqlens=cu_seqlens,
        )
        out = self.o(u * y.squeeze(2).to(u.dtype))
        return (out, SSMState(memory=m)) if return_state else out

    def init_state(self, batch_size: int) -> SSMState:
        return SSMState(
            memory=torch.zeros(
                batch_size, 1, self.l_max, self.d_inner, dtype=self._memory_dtype(True), device=self.o.weight.device
            )
        )

    def describe(self) -> EOSRow:
        return EOSRow(
            name="TNN (GTU, ETSC SSM form)",
            input="x_t (the GTU's v_t = SiLU(W_v x_t))",
            expand="B = ETSC coefficients of the RPE kernel (n x d1, complex)",
            oscillation="A = Diag(lambda), lambda_k = gamma exp(-2 pi i k / (n + 1))",
            shrink="C = J (ones), Re(.) kept",
            memory=f"K x D = {self.l_max} x {self.d_inner} complex (n = l_max modes, d1 channels)",
            psi="elementwise",
            input_dd=True,
            expand_dd=False,
            oscillation_dd=False,
            shrink_dd=False,
            paper="TNN (Qin et al., 2023a) section 3; ETSC (Qin & Zhong, 2023); LCSM section 2.3, Table 1 row TNN",
        )
