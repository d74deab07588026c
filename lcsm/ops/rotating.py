"""A rotating oscillation computed as a real EOS problem in the rotating frame.

Linear attention with a relative rotation (LRPE, cosFormer, RetNet's xPos, LCSM o code 11) is
the complex EOS system

    m_t = exp(log_o_t + i theta) * m_{t-1} + e_t (x) i_t,    y_t = Re(sum_k s_t[k] m_t[k, :])

with real log_o (a real decay, possibly none), a time-invariant angle theta per head and row, a
real input i and read-out Re(y). Writing m_t = exp(i t theta) n_t turns it into

    n_t = exp(log_o_t) * n_{t-1} + (e_t exp(-i t theta)) (x) i_t,   n_0 = m_0
    y_t = Re(sum_k s_t[k] exp(i t theta_k) n_t[k, :])

and with N = [Re n; -Im n] (2K real rows) into a real EOS problem,

    e'_t = [Re(e_t exp(-i t theta)); -Im(e_t exp(-i t theta))]
    s'_t = [Re(s_t exp(+i t theta));  Im(s_t exp(+i t theta))]
    log_o'_t = log_o_t with its K rows repeated, N_0 = [Re m_0; -Im m_0],
    m_T = exp(i T theta) (N_T[:K] - i N_T[K:]),

since Re(a n) = Re(a) Re(n) - Im(a) Im(n). The real problem runs in lcsm's real kernels (the
matmul kernel's K-wide matmuls become 2K wide, where the complex kernel pays complex arithmetic
on every product), the state is the complex memory of ``eos`` (interchangeable with it, no
position counter: t counts from the first token of the call), and the gradients of theta reach
it through the rotations. This is the official real form of LRPE and LCSM's code 11 ([e cos,
e sin]), made exact for carried states and decays. Angles t * theta are formed in float64: in
float32 an angle near t = 65536 would be off by about 0.004 rad.
"""

from __future__ import annotations

import torch

from lcsm._checks import check_bool

from ._inputs import check_cu_seqlens, check_floating, check_packed, shape_str
from .eos import LogO, eos
from .packed import Documents

Tensor = torch.Tensor

ROTATING_MODES = ("auto", "recurrent", "parallel", "chunk")


def _check_real(name: str, x: Tensor | None, why: str) -> None:
    if x is not None and x.is_complex():
        raise TypeError(
            f"{name}: eos_rotating takes a real {name} ({why}), got dtype {x.dtype} with shape {shape_str(x)}"
        )


def _rows_twice(name: str, log_o: Tensor, K: int) -> Tensor:
    """A real log oscillation for the 2K rows of the rotating frame: its K rows repeated (a decay
    shared by the rows, K-dim 1, stays as it is). log_o has its ``eos`` shape, rows at dim -2."""
    if log_o.dim() < 3 or log_o.shape[-2] not in (1, K):
        raise ValueError(
            f"{name}: expected the rows of a log oscillation at dim -2, K = {K} or 1, as eos takes it "
            f"([B, T, H, K|1, D|1] or [H, K|1, D|1]), got {shape_str(log_o)}"
        )
    return torch.cat([log_o, log_o], -2) if log_o.shape[-2] == K > 1 else log_o


def _expand_vector(name: str, x: Tensor, B: int, T: int, H: int) -> Tensor:
    """e or s as [B|1, T, H, K] (a data-independent K-vector [H, K] broadcast over B and T)."""
    if x.dim() == 4 and tuple(x.shape[:3]) == (B, T, H):
        return x
    if x.dim() == 2 and x.shape[0] == H:
        return x[None, None].expand(1, T, H, x.shape[-1])
    why = f" (a K x D {name} has no rotating-frame form; use eos with a complex log_o)" if x.dim() == 3 else ""
    raise ValueError(
        f"{name}: eos_rotating takes a K-vector {name}, [B, T, H, K] = [{B}, {T}, {H}, K] or "
        f"[H, K] = [{H}, K], got {shape_str(x)}{why}"
    )


def _halves(x: Tensor, cos: Tensor, sin: Tensor, conj: bool) -> Tensor:
    """The 2K real rows of a rotated K-vector: [Re z, Im z] of z = x exp(i t theta) (s'), or
    [Re z, -Im z] of z = x exp(-i t theta) (conj, e'); both are [x cos, x sin] for a real x."""
    if not x.is_complex():
        return torch.cat([x * cos, x * sin], -1)
    a, b = x.real, x.imag
    if conj:
        return torch.cat([a * cos + b * sin, a * sin - b * cos], -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def eos_rotating(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    theta: Tensor,
    log_o: LogO = None,
    *,
    mode: str = "auto",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Re(y) of the EOS system with oscillation exp(log_o_t + i theta), by the rotating frame.

    The same result (up to rounding) as ``eos(i, e, s, log_o + 1j * theta[..., None],
    initial_state=..., real_output=True)``, which the tests check in every mode, for outputs,
    final states and every gradient.

    Args:
        i: input [B, T, H, D], real.
        e, s: K-vectors [B, T, H, K] or [H, K], real or complex.
        theta: angles [H, K] (one per head and memory row) or [H, 1] (one per head), real,
            time-invariant.
        log_o: a real decay as ``eos`` takes it (None, a tensor or a separable pair), or None.
        mode: how the real problem is computed, as in ``eos``: "auto", "recurrent", "parallel" or
            "chunk". "fft" is not offered: the rotating frame makes e and s time-dependent (a
            time-invariant rotation is a job for ``eos(..., mode="fft")`` with a complex log_o).
        initial_state: m_0 [B, H, K, D], complex (or real: zero imaginary part); zeros when None.
        output_final_state: also return m_T [B, H, K, D], complex.
        chunk_size: C of the chunk mode.
        cu_seqlens: packed sequences, as ``eos`` takes them ([N + 1], B = 1): t then counts from
            each document's first token, initial and final states are [N, H, K, D].

    Returns:
        Re(y) [B, T, H, D] and m_T (or None).
    """
    if mode not in ROTATING_MODES:
        raise ValueError(
            f"mode: eos_rotating expects one of {', '.join(ROTATING_MODES)}, got {mode!r}"
            + (
                "; the rotating frame is time-dependent, use eos(..., mode='fft') with a complex "
                "log_o for a time-invariant rotation"
                if mode == "fft"
                else ""
            )
        )
    output_final_state = check_bool("output_final_state", output_final_state)
    for name, x in (("i", i), ("e", e), ("s", s), ("theta", theta)):
        check_floating(name, x)
    _check_real("i", i, "the read-out is Re(y)")
    _check_real("theta", theta, "angles")
    pair = isinstance(log_o, (tuple, list))
    for n, part in enumerate(log_o if pair else [log_o]):
        if isinstance(part, Tensor):
            _check_real(f"log_o[{n}]" if pair else "log_o", part, "the decay; the rotation goes in theta")
    if i.dim() != 4:
        raise ValueError(f"i: expected [B, T, H, D], got {i.dim()}-d tensor {shape_str(i)}")
    B, T, H, D = i.shape
    e, s = _expand_vector("e", e, B, T, H), _expand_vector("s", s, B, T, H)
    K = e.shape[-1]
    if s.shape[-1] != K:
        raise ValueError(f"s: expected K = {K} rows as e has (e {shape_str(e)}), got s {shape_str(s)}")
    if theta.dim() != 2 or theta.shape[0] != H or theta.shape[1] not in (1, K):
        raise ValueError(f"theta: expected [H, K] = [{H}, {K}] or [H, 1] = [{H}, 1], got {shape_str(theta)}")

    real = torch.promote_types(torch.promote_types(i.dtype, e.real.dtype), s.real.dtype)
    if real in (torch.float16, torch.bfloat16):
        real = torch.float32
    steps = torch.arange(1, T + 1, dtype=torch.float64, device=i.device)
    states, lengths = B, torch.tensor([T], dtype=torch.float64, device=i.device)
    if cu_seqlens is not None:
        bounds = check_cu_seqlens(cu_seqlens)
        check_packed(bounds, B, T)
        # Each document's frame turns from its own first token, as when it runs alone.
        docs = Documents.of(bounds, i.device)
        steps = steps - docs.starts.index_select(0, docs.doc).to(torch.float64)
        states, lengths = docs.N, (docs.ends - docs.starts).to(torch.float64)
    angle = steps[:, None, None] * theta.to(torch.float64).expand(H, K)  # [T, H, K]
    cos, sin = angle.cos().to(real), angle.sin().to(real)
    e2 = _halves(e, cos, sin, conj=True).expand(B, T, H, 2 * K)
    s2 = _halves(s, cos, sin, conj=False).expand(B, T, H, 2 * K)
    if pair and len(log_o) == 2:
        log_o2 = (_rows_twice("log_o[0]", log_o[0], K), log_o[1])
    else:
        log_o2 = _rows_twice("log_o", log_o, K) if isinstance(log_o, Tensor) else log_o
    m0 = None
    if initial_state is not None:
        check_floating("initial_state", initial_state)
        if tuple(initial_state.shape) != (states, H, K, D):
            lead = "B" if cu_seqlens is None else "N"
            raise ValueError(
                f"initial_state: expected [{lead}, H, K, D] = [{states}, {H}, {K}, {D}], got {shape_str(initial_state)}"
            )
        m0 = (
            torch.cat([initial_state.real, -initial_state.imag], -2)
            if initial_state.is_complex()
            else torch.cat([initial_state, torch.zeros_like(initial_state)], -2)
        )
    y, n_T = eos(
        i,
        e2,
        s2,
        log_o2,
        mode=mode,
        initial_state=m0,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
    )
    if not output_final_state:
        return y, None
    turn = lengths[:, None, None] * theta.to(torch.float64).expand(H, K)  # [B|N, H, K]
    rot_T = torch.complex(turn.cos(), turn.sin())[..., None].to(torch.promote_types(n_T.dtype, torch.complex64))
    return y, rot_T * torch.complex(n_T[:, :, :K], -n_T[:, :, K:])
