"""Validation and canonical form of the EOS operator's arguments.

Every mode of :func:`lcsm.ops.eos` works on one canonical, head-major description of the problem
so that the modes differ only in how they evaluate the recurrence, never in how they read inputs.

Shape glossary (used throughout ``lcsm.ops``)::

    B  batch            T  sequence length        H  heads
    K  expand (memory rows)                        D  input / output width (memory columns)
    C  chunk size       N  number of chunks = ceil(T / C)

Canonical, head-major tensors (a size-1 dim means "broadcast"):

    v  [B, H, T, D]            the input state i
    e  [B|1, H, T|1, K, D|1]   expand state: a K-vector (last dim 1) or a K x D matrix
    s  [B|1, H, T|1, K, D|1]   shrink state, same convention
    g  [B|1, H, T|1, K|1, D|1] log oscillation (None: o = 1)
    m0 [B, H, K, D]            initial memory (None: zeros)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

Tensor = torch.Tensor

MODES = ("auto", "recurrent", "parallel", "chunk", "fft")


def shape_str(x: Tensor) -> str:
    return "[" + ", ".join(str(n) for n in x.shape) + "]"


def check_floating(name: str, x: Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(
            f"{name}: expected a floating-point or complex tensor, got dtype {x.dtype} "
            f"with shape {shape_str(x)}"
        )


def check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
    return chunk_size


def check_same_device(named: dict) -> torch.device:
    devices = {name: t.device for name, t in named.items() if t is not None}
    first = next(iter(devices.values()))
    for name, dev in devices.items():
        if dev != first:
            listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"{name}: all inputs must be on one device, got {listing}")
    return first


def compute_dtype(tensors) -> torch.dtype:
    """Common dtype of the inputs; half precisions are computed in float32 (states stay float32,
    as in fla) and the output is cast back by the caller."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.complex32:
        return torch.complex64
    return dtype


@dataclass
class EOSProblem:
    """Canonical head-major form of one call of :func:`lcsm.ops.eos` (see the module glossary)."""

    v: Tensor
    e: Tensor
    s: Tensor
    g: Optional[Tensor]
    m0: Optional[Tensor]
    B: int
    T: int
    H: int
    K: int
    D: int
    out_dtype: torch.dtype
    e_dd: bool
    s_dd: bool
    g_dd: bool

    @property
    def e_is_vector(self) -> bool:
        return self.e.shape[-1] == 1

    @property
    def s_is_vector(self) -> bool:
        return self.s.shape[-1] == 1

    @property
    def data_independent(self) -> bool:
        """True when e, s and log_o do not vary with t (the time-invariant, convolutional case)."""
        return not (self.e_dd or self.s_dd or self.g_dd)

    @property
    def decay_kind(self) -> str:
        """'none', 'scalar', 'row' (varies over K), 'col' (varies over D) or 'full' (K x D)."""
        if self.g is None:
            return "none"
        kg, dg = self.g.shape[-2], self.g.shape[-1]
        if kg == 1 and dg == 1:
            return "scalar"
        if dg == 1:
            return "row" if self.K > 1 else "scalar"
        if kg == 1:
            return "col" if self.D > 1 else "scalar"
        return "full"


def _state_shape(i: Tensor, name: str, x: Tensor, K: int, D: int):
    """Canonicalise an expand or shrink state to [B|1, H, T|1, K, D|1]; returns (tensor, is_dd)."""
    B, T, H, _ = i.shape
    if x.dim() == 4:
        if x.shape[0] != B or x.shape[1] != T or x.shape[2] != H:
            raise ValueError(
                f"{name}: data-dependent {name} must be [B, T, H, K] = [{B}, {T}, {H}, K] to match "
                f"i {shape_str(i)}, got {shape_str(x)}"
            )
        return x.permute(0, 2, 1, 3).unsqueeze(-1), True
    if x.dim() == 2:
        if x.shape[0] != H:
            raise ValueError(f"{name}: data-independent {name} must be [H, K] with H = {H}, got {shape_str(x)}")
        return x[None, :, None, :, None], False
    if x.dim() == 3:
        if x.shape[0] != H or x.shape[2] != D:
            raise ValueError(
                f"{name}: data-independent matrix {name} must be [H, K, D] = [{H}, K, {D}], got {shape_str(x)}"
            )
        return x[None, :, None, :, :], False
    raise ValueError(
        f"{name}: expected [B, T, H, K] (data-dependent), [H, K] or [H, K, D] (data-independent), "
        f"got {x.dim()}-d tensor {shape_str(x)}"
    )


def canonicalize(i, e, s, log_o=None, initial_state=None) -> EOSProblem:
    """Validate the arguments of :func:`lcsm.ops.eos` and return the canonical problem."""
    check_floating("i", i)
    check_floating("e", e)
    check_floating("s", s)
    if log_o is not None:
        check_floating("log_o", log_o)
    if initial_state is not None:
        check_floating("initial_state", initial_state)
    check_same_device({"i": i, "e": e, "s": s, "log_o": log_o, "initial_state": initial_state})
    if i.dim() != 4:
        raise ValueError(f"i: expected [B, T, H, D], got {i.dim()}-d tensor {shape_str(i)}")
    B, T, H, D = i.shape
    K = e.shape[-1] if e.dim() in (2, 4) else (e.shape[1] if e.dim() == 3 else None)
    if K is None:
        raise ValueError(
            f"e: expected [B, T, H, K], [H, K] or [H, K, D], got {e.dim()}-d tensor {shape_str(e)}"
        )
    ec, e_dd = _state_shape(i, "e", e, K, D)
    sc, s_dd = _state_shape(i, "s", s, K, D)
    if sc.shape[3] != K:
        raise ValueError(f"s: expand dimension K of s is {sc.shape[3]} but e has K = {K} (e {shape_str(e)}, s {shape_str(s)})")

    gc, g_dd = None, False
    if log_o is not None:
        if log_o.dim() == 5:
            if tuple(log_o.shape[:3]) != (B, T, H):
                raise ValueError(
                    f"log_o: data-dependent log_o must start with [B, T, H] = [{B}, {T}, {H}], got {shape_str(log_o)}"
                )
            gc, g_dd = log_o.permute(0, 2, 1, 3, 4), True
        elif log_o.dim() == 3:
            if log_o.shape[0] != H:
                raise ValueError(f"log_o: data-independent log_o must be [H, K|1, D|1] with H = {H}, got {shape_str(log_o)}")
            gc = log_o[None, :, None]
        else:
            raise ValueError(
                "log_o: expected [B, T, H, K|1, D|1] (data-dependent) or [H, K|1, D|1] "
                f"(data-independent), got {log_o.dim()}-d tensor {shape_str(log_o)}"
            )
        if gc.shape[-2] not in (1, K) or gc.shape[-1] not in (1, D):
            raise ValueError(
                f"log_o: last two dims must be (K or 1, D or 1) = ({K} or 1, {D} or 1), got {shape_str(log_o)}"
            )

    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, D):
        raise ValueError(
            f"initial_state: expected [B, H, K, D] = [{B}, {H}, {K}, {D}], got {shape_str(initial_state)}"
        )

    out_dtype = torch.promote_types(
        torch.promote_types(torch.promote_types(i.dtype, e.dtype), s.dtype),
        log_o.dtype if log_o is not None else i.dtype,
    )
    if initial_state is not None:
        out_dtype = torch.promote_types(out_dtype, initial_state.dtype)
    dtype = compute_dtype([i, e, s, log_o, initial_state])

    v = i.permute(0, 2, 1, 3).to(dtype)
    p = EOSProblem(
        v=v,
        e=ec.to(dtype),
        s=sc.to(dtype),
        g=gc.to(dtype) if gc is not None else None,
        m0=initial_state.to(dtype) if initial_state is not None else None,
        B=B, T=T, H=H, K=K, D=D,
        out_dtype=out_dtype,
        e_dd=e_dd, s_dd=s_dd, g_dd=g_dd,
    )
    return p


def finish(p: EOSProblem, y_bhtd: Tensor, m_T: Optional[Tensor], output_final_state: bool):
    """Back to the public layout [B, T, H, D] and dtype; final state only when asked for."""
    y = y_bhtd.permute(0, 2, 1, 3).to(p.out_dtype)
    if not output_final_state:
        return y, None
    state_dtype = p.v.dtype if p.out_dtype in (torch.float16, torch.bfloat16) else p.out_dtype
    return y, m_T.to(state_dtype)
