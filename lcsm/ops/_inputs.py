"""Validation and canonical form of the EOS operator's arguments.

Every mode of :func:`lcsm.ops.eos` works on one canonical, head-major description of the problem
so that the modes differ only in how they evaluate the recurrence, never in how they read inputs.

Shape glossary (used throughout ``lcsm.ops``)::

    B  batch            T  sequence length        H  heads
    K  expand (memory rows)                        D  input / output width (memory columns)
    C  chunk size       N  number of chunks = ceil(T / C)

Canonical, head-major tensors (a size-1 dim means "broadcast"):

    i  [B, H, T, D]            the input state
    e  [B|1, H, T|1, K, D|1]   expand state: a K-vector (last dim 1) or a K x D matrix
    s  [B|1, H, T|1, K, D|1]   shrink state, same convention
    g  [B|1, H, T|1, K|1, D|1] log oscillation (None: o = 1, or a separable pair below)
    g_outer  ([B|1, H, T|1, K, 1], [B|1, H, T|1, 1, D]) or None: a separable oscillation
               o = exp(g_row + g_col) = a (x) b, given as the pair (log_o[0], log_o[1])
    g_product  ([B|1, H, T|1, K|1, D|1], [B|1, H, T|1, K|1, D|1]) or None: a full K x D log
               oscillation given as the product of its two operands, log_o = a * b (``LogProduct``)
    m0 [B, H, K, D]            initial memory (None: zeros)

A separable oscillation (LCSM Table 3, o code 1: o_t = a_t (x) b_t) is kept as its two factors
so that the chunk kernel can apply them along K and along D without ever forming the K x D
decay; ``EOSProblem.g_full`` materialises the sum for the plain forms (the recurrent reference,
the parallel map, fft); the elementwise kernel multiplies the two factors out one block of steps at a time.

A log oscillation that is a product of two broadcast operands (Mamba's Delta_t A: a [B, T, 1, D]
step size times a [K, D] matrix) is kept as its operands for the same reason: the elementwise
kernel forms each step's exp(a * b) when the step runs, so the [B, T, K, D] log, its exp and its
gradient are never formed; ``g_full`` materialises the product for the plain forms.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

Tensor = torch.Tensor

MODES = ("auto", "recurrent", "parallel", "chunk", "fft", "triton", "native")

# The least log oscillation the forms built on cumulative logs (parallel, fft, the chunk mode's
# matmul kernel, eos_delta's chunk form) compute with, per real compute dtype. A decay of exactly 0,
# log_o = -inf (log(sigmoid(x)) for x below -88.72 in float32), would make -inf - (-inf) and -inf * 0
# there, NaN from that step on. exp of these values is exactly 0 in their dtype (the smallest
# denormals are e^-103.3 in float32 and e^-744.4 in float64), so raising log_o to them changes no o
# and no gradient (the recurrence's dlog_o = o * ... is 0 there too); they are far from the dtypes'
# most negative floats so that cumulative sums of them lose nothing to their magnitude.
LOG_ZERO = {torch.float32: -128.0, torch.float64: -1024.0}


def constant_result(fn: _Fn) -> _Fn:
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo: that function
    imports dynamo to set one attribute, which made importing lcsm.ops take 1.3 s more (about 40 %
    of the start of every process that runs lcsm: the CLI, a training's workers, the tests' own
    subprocesses). The attribute is the one dynamo's own decorator sets;
    tests/ops/test_compile.py checks that the two still agree."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_result
def log_zero(real: torch.dtype) -> float:
    """LOG_ZERO[real] as a constant of a traced graph. Read directly under
    ``torch.compile(dynamic=True)``, the module-level float becomes a symbolic graph input, lifted
    into the first subgraph that reads it (a torch.cond branch, an autograd.Function's forward);
    a second op of the same graph that reads it again then fails in dynamo
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer")."""
    return LOG_ZERO[real]


@dataclass(frozen=True)
class LogProduct:
    """A log oscillation given as the elementwise product of two operands, ``log_o = a * b``, each
    data-dependent [B, T, H, K|1, D|1] or data-independent [H, K|1, D|1], together broadcasting to
    the full [.., K, D] decay. Mamba's selective SSM is the case it is for (Gu & Dao 2023, section
    3.4 / Algorithm 2: log A-bar_t = Delta_t A, a [B, T, 1, 1, d_inner] step size times the
    [1, N, d_inner] matrix A): the chunk mode's elementwise kernel then forms exp(a * b) one block
    of steps at a time, in cache, and reduces the decay's gradient to a and b there, where the
    materialised [B, T, H, K, D] product would cost three full-size tensors (the log, its exp,
    saved for the backward, and the log's gradient) and autograd's reduction of that gradient.
    A product that does not span both K and D is no full decay: it is formed at once and runs
    as the row, column or scalar decay it is."""

    a: Tensor
    b: Tensor


# log_o as ``eos`` takes it: None (o = 1), one tensor, a separable pair (log_row, log_col) or a
# ``LogProduct(a, b)``.
LogO = None | Tensor | tuple[Tensor, Tensor] | LogProduct
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


# A complex dtype's real counterpart. ``torch.dtype.to_real`` does the same, but torch.compile's
# tracer cannot call it (a graph break), and the ops must trace whole (docs/compile.md).
_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype of ``dtype``'s values: itself for a real dtype, the part's for a complex one."""
    return _REAL.get(dtype, dtype)


def shape_str(x: Tensor) -> str:
    return "[" + ", ".join(str(n) for n in x.shape) + "]"


def check_floating(name: str, x: Tensor, kind: str = "a floating-point or complex") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"{name}: expected {kind} tensor, got dtype {x.dtype} with shape {shape_str(x)}")


def check_real(op: str, name: str, x: Tensor) -> None:
    """A real floating-point tensor: the matrix oscillations (``eos_delta``, ``eos_dplr``) have no
    complex form, whose backward would need conjugate transposes throughout."""
    check_floating(name, x, "a real floating-point")
    if x.is_complex():
        raise TypeError(
            f"{name}: {op} supports real floating-point tensors only, got dtype {x.dtype} "
            f"with shape {shape_str(x)} (complex matrix oscillations are not implemented)"
        )


def promoted_dtype(tensors: Sequence[Tensor | None]) -> torch.dtype:
    """The dtype the inputs promote to (None entries skipped)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def finite_log(g: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """g with its real part raised to at least ``LOG_ZERO`` of ``dtype`` (default g's dtype), the
    dtype whose exp must give 0: -inf and every log below the value become it, the rest is
    unchanged; a complex g keeps its imaginary part. Differentiable (0 gradient where raised)."""
    floor = log_zero(real_dtype(dtype or g.dtype))
    if g.is_complex():
        return torch.complex(g.real.clamp(min=floor), g.imag)
    return g.clamp(min=floor)


def check_chunk_size(chunk_size: Any) -> int:
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


def compute_dtype(tensors: Sequence[Tensor | None]) -> torch.dtype:
    """Common dtype of the inputs; half precisions are computed in float32 (states stay float32,
    as in fla) and the output is cast back by the caller."""
    dtype = promoted_dtype(tensors)
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.complex32:
        return torch.complex64
    return dtype


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """A context with ``torch.autocast`` off on ``device``'s type (a no-op where it is off or where
    the device has no autocast, as the meta device)."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def without_autocast(fn: _Fn) -> _Fn:
    """Run ``fn`` with ``torch.autocast`` off on the device of its first tensor argument
    (positional or keyword).

    The operators lift half-precision inputs to float32 themselves (``compute_dtype``); under
    autocast their matmuls would be cast back to bfloat16 and the chunk and parallel forms, whose
    decay factors span up to e^{+-30} inside a chunk, would lose what the lift kept. Backward
    passes run outside autocast, as PyTorch recommends (the engine's trainer does), and then in
    the float32 of the forward."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
            return fn(*args, **kwargs)
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if device is None:
            return fn(*args, **kwargs)
        with autocast_off(device):
            return fn(*args, **kwargs)

    return run


# One C call that says whether autocast is on for any device (torch.nn's RNN modules use it):
# without it, finding the device and asking its autocast state cost several microseconds a call,
# which token-by-token decoding pays in every layer. Where a torch lacks it, every call asks.
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


@dataclass
class EOSProblem:
    """Canonical head-major form of one call of :func:`lcsm.ops.eos` (see the module glossary)."""

    i: Tensor
    e: Tensor
    s: Tensor
    g: Tensor | None
    m0: Tensor | None
    B: int
    T: int
    H: int
    K: int
    D: int
    out_dtype: torch.dtype
    e_dd: bool
    s_dd: bool
    g_dd: bool
    g_outer: tuple[Tensor, Tensor] | None = None
    g_product: tuple[Tensor, Tensor] | None = None
    # A real input of a complex computation, before its promotion ([B, H, T, D], a view of i): the
    # fft form convolves it with the kernel's real part when only Re(y) is asked for.
    i_real: Tensor | None = None

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
    def g_full(self) -> Tensor | None:
        """The log oscillation as one broadcastable tensor: ``g`` itself, for a separable pair
        the materialised sum g_row + g_col [B|1, H, T|1, K, D], for a product a * b."""
        if self.g_outer is not None:
            return self.g_outer[0] + self.g_outer[1]
        if self.g_product is not None:
            return self.g_product[0] * self.g_product[1]
        return self.g

    @property
    def decay_kind(self) -> str:
        """'none', 'scalar', 'row' (varies over K), 'col' (varies over D), 'outer' (a separable
        pair, o = a (x) b), 'full' (K x D) or 'product' (a full K x D log given as a * b)."""
        if self.g_outer is not None:
            return "outer"
        if self.g_product is not None:
            return "product"
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


def _state_shape(i: Tensor, name: str, x: Tensor, K: int, D: int) -> tuple[Tensor, bool]:
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


def _pair_part(log_o: Tensor, index: int, B: int, T: int, H: int, K: int, D: int) -> tuple[Tensor, bool]:
    """Canonicalise one factor of a separable pair: log_o[0] (rows) to [B|1, H, T|1, K, 1],
    log_o[1] (columns) to [B|1, H, T|1, 1, D]; returns (tensor, is_dd)."""
    name = f"log_o[{index}]"
    tail = (K, 1) if index == 0 else (1, D)
    what = "row" if index == 0 else "column"

    # The expected shapes are formatted only for an error: formatting a traced (symbolic) size
    # fixes it to its value, one compiled graph per B and T.
    def dd_shape() -> str:
        return f"[B, T, H, {'K, 1' if index == 0 else '1, D'}] = [{B}, {T}, {H}, {tail[0]}, {tail[1]}]"

    def di_shape() -> str:
        return f"[H, {'K, 1' if index == 0 else '1, D'}] = [{H}, {tail[0]}, {tail[1]}]"

    if log_o.dim() == 5:
        if tuple(log_o.shape) != (B, T, H, *tail):
            raise ValueError(f"{name}: data-dependent {what} decay must be {dd_shape()}, got {shape_str(log_o)}")
        return log_o.permute(0, 2, 1, 3, 4), True
    if log_o.dim() == 3:
        if tuple(log_o.shape) != (H, *tail):
            raise ValueError(f"{name}: data-independent {what} decay must be {di_shape()}, got {shape_str(log_o)}")
        return log_o[None, :, None], False
    raise ValueError(
        f"{name}: the {what} factor of a separable log_o must be {dd_shape()} (data-dependent) or "
        f"{di_shape()} (data-independent), got {log_o.dim()}-d tensor {shape_str(log_o)}"
    )


def _decay_tensor(name: str, x: Tensor, B: int, T: int, H: int, K: int, D: int) -> tuple[Tensor, bool]:
    """Canonicalise a log oscillation tensor (log_o, or an operand of a ``LogProduct``) to
    [B|1, H, T|1, K|1, D|1]; returns (tensor, is_dd)."""
    if x.dim() == 5:
        if tuple(x.shape[:3]) != (B, T, H):
            raise ValueError(
                f"{name}: data-dependent {name} must start with [B, T, H] = [{B}, {T}, {H}], got {shape_str(x)}"
            )
        xc, dd = x.permute(0, 2, 1, 3, 4), True
    elif x.dim() == 3:
        if x.shape[0] != H:
            raise ValueError(f"{name}: data-independent {name} must be [H, K|1, D|1] with H = {H}, got {shape_str(x)}")
        xc, dd = x[None, :, None], False
    else:
        forms = ["[B, T, H, K|1, D|1] (data-dependent)", "[H, K|1, D|1] (data-independent)"]
        if name == "log_o":
            forms += ["a separable pair (log_row, log_col)", "a LogProduct(a, b)"]
        raise ValueError(
            f"{name}: expected {', '.join(forms[:-1])} or {forms[-1]}, got {x.dim()}-d tensor {shape_str(x)}"
        )
    if xc.shape[-2] not in (1, K) or xc.shape[-1] not in (1, D):
        raise ValueError(f"{name}: last two dims must be (K or 1, D or 1) = ({K} or 1, {D} or 1), got {shape_str(x)}")
    return xc, dd


def _log_o_tensors(log_o: LogO) -> list[Tensor]:
    """The tensors of log_o: [], [log_o], the two factors of a separable pair or the two operands
    of a product (validated)."""
    if log_o is None:
        return []
    if isinstance(log_o, LogProduct):
        check_floating("log_o.a", log_o.a)
        check_floating("log_o.b", log_o.b)
        return [log_o.a, log_o.b]
    if isinstance(log_o, (tuple, list)):
        if len(log_o) != 2:
            raise ValueError(
                "log_o: a separable oscillation is a pair (log_row [B, T, H, K, 1] or [H, K, 1], "
                f"log_col [B, T, H, 1, D] or [H, 1, D]), got a {type(log_o).__name__} of length {len(log_o)}"
            )
        for n, part in enumerate(log_o):
            check_floating(f"log_o[{n}]", part)
        return list(log_o)
    check_floating("log_o", log_o)
    return [log_o]


def canonicalize(
    i: Tensor,
    e: Tensor,
    s: Tensor,
    log_o: LogO = None,
    initial_state: Tensor | None = None,
    state_name: str = "initial_state",
    states: int | None = None,
) -> EOSProblem:
    """Validate the arguments of :func:`lcsm.ops.eos` and return the canonical problem.
    ``log_o`` is None, one tensor, a separable pair (log_row, log_col) meaning
    o = exp(log_row + log_col), or a ``LogProduct(a, b)`` meaning o = exp(a * b). ``state_name``:
    the memory's argument name in errors (``eos_step`` calls it ``state``). ``states``: how many
    initial memories there are, B when None; packed sequences have one per document (N of
    ``cu_seqlens``), and ``m0`` is then [N, H, K, D]."""
    check_floating("i", i)
    check_floating("e", e)
    check_floating("s", s)
    decays = _log_o_tensors(log_o)
    pair = isinstance(log_o, (tuple, list))
    product = isinstance(log_o, LogProduct)
    if initial_state is not None:
        check_floating(state_name, initial_state)
    if pair:
        decay_names = [f"log_o[{n}]" for n in range(len(decays))]
    else:
        decay_names = ["log_o.a", "log_o.b"] if product else ["log_o"] * len(decays)
    check_same_device(
        {"i": i, "e": e, "s": s, **dict(zip(decay_names, decays, strict=False)), state_name: initial_state}
    )
    if i.dim() != 4:
        raise ValueError(f"i: expected [B, T, H, D], got {i.dim()}-d tensor {shape_str(i)}")
    B, T, H, D = i.shape
    K = e.shape[-1] if e.dim() in (2, 4) else (e.shape[1] if e.dim() == 3 else None)
    if K is None:
        raise ValueError(f"e: expected [B, T, H, K], [H, K] or [H, K, D], got {e.dim()}-d tensor {shape_str(e)}")
    ec, e_dd = _state_shape(i, "e", e, K, D)
    sc, s_dd = _state_shape(i, "s", s, K, D)
    if sc.shape[3] != K:
        raise ValueError(
            f"s: expand dimension K of s is {sc.shape[3]} but e has K = {K} (e {shape_str(e)}, s {shape_str(s)})"
        )

    gc, g_dd, pair_c, product_c = None, False, None, None
    if pair:
        (row, row_dd), (col, col_dd) = (_pair_part(part, n, B, T, H, K, D) for n, part in enumerate(decays))
        pair_c, g_dd = (row, col), row_dd or col_dd
    elif product:
        (a, a_dd), (b, b_dd) = (
            _decay_tensor(f"log_o.{n}", x, B, T, H, K, D) for n, x in zip("ab", decays, strict=False)
        )
        g_dd = a_dd or b_dd
        if max(a.shape[-2], b.shape[-2]) == K > 1 and max(a.shape[-1], b.shape[-1]) == D > 1:
            product_c = (a, b)
        else:
            gc = a * b  # no full K x D decay: formed at once (see LogProduct)
    elif log_o is not None:
        gc, g_dd = _decay_tensor("log_o", log_o, B, T, H, K, D)

    if initial_state is not None and states is not None and tuple(initial_state.shape) != (states, H, K, D):
        raise ValueError(
            f"{state_name}: with cu_seqlens expected one state per document, [N, H, K, D] = "
            f"[{states}, {H}, {K}, {D}], got {shape_str(initial_state)}"
        )
    if initial_state is not None and states is None and tuple(initial_state.shape) != (B, H, K, D):
        raise ValueError(f"{state_name}: expected [B, H, K, D] = [{B}, {H}, {K}, {D}], got {shape_str(initial_state)}")

    # y in the inputs' dtype: not the initial state's, which the operator itself returns in float32
    # for half-precision inputs (carried into the next call it made y float32 there)
    out_dtype = torch.promote_types(torch.promote_types(i.dtype, e.dtype), s.dtype)
    for x in decays:
        out_dtype = torch.promote_types(out_dtype, x.dtype)
    if initial_state is not None and initial_state.is_complex():
        out_dtype = torch.promote_types(out_dtype, torch.complex64)  # its kind, not its precision
    dtype = compute_dtype([i, e, s, *decays, initial_state])

    p = EOSProblem(
        i=i.permute(0, 2, 1, 3).to(dtype),
        e=ec.to(dtype),
        s=sc.to(dtype),
        g=gc.to(dtype) if gc is not None else None,
        m0=initial_state.to(dtype) if initial_state is not None else None,
        B=B,
        T=T,
        H=H,
        K=K,
        D=D,
        out_dtype=out_dtype,
        e_dd=e_dd,
        s_dd=s_dd,
        g_dd=g_dd,
        g_outer=tuple(x.to(dtype) for x in pair_c) if pair_c is not None else None,
        g_product=tuple(x.to(dtype) for x in product_c) if product_c is not None else None,
        i_real=i.permute(0, 2, 1, 3).to(real_dtype(dtype)) if dtype.is_complex and not i.is_complex() else None,
    )
    return p


def check_cu_seqlens(cu_seqlens: Any) -> list[int]:
    """The document boundaries of packed sequences, FlashAttention's ``cu_seqlens``: a 1-d integer
    tensor [N + 1], N >= 1. Returns them as ints; ``check_packed`` then checks them against the
    input's B and T."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected an integer torch.Tensor [N + 1], got {type(cu_seqlens).__name__}")
    # (an int8 or uint8 tensor cannot hold the boundaries of a row past 127 or 255 tokens)
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens: expected a torch.int64 or torch.int32 tensor, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.is_meta:
        raise ValueError("cu_seqlens: expected a tensor holding values (CPU or CUDA), got one on the meta device")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-d tensor [N + 1] of document boundaries with N >= 1, got {shape_str(cu_seqlens)}"
        )
    return [int(x) for x in cu_seqlens.tolist()]


def _brief(values: list[int]) -> str:
    """A list of boundaries for an error message, its middle elided when long."""
    if len(values) <= 8:
        return str(values)
    return "[" + ", ".join(map(str, values[:4])) + ", ..., " + ", ".join(map(str, values[-2:])) + "]"


def packed_bounds(cu_seqlens: Any, B: int, T: int) -> list[int]:
    """The document boundaries ``cu_seqlens`` of packed inputs [B, T, ...], checked, as ints."""
    bounds = check_cu_seqlens(cu_seqlens)
    check_packed(bounds, B, T)
    return bounds


def check_packed(bounds: list[int], B: int, T: int) -> None:
    """Boundaries of packed sequences against the input [B, T, ...]: B = 1, bounds[0] = 0,
    bounds[-1] = T, strictly increasing (every document holds at least one token; an empty one
    would have a final state but no step to give it)."""
    if B != 1:
        raise ValueError(
            f"cu_seqlens: packed sequences are one row, expected batch B = 1 holding the N documents "
            f"back to back, got B = {B}"
        )
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] = 0, got {bounds[0]} (cu_seqlens {_brief(bounds)})")
    if bounds[-1] != T:
        raise ValueError(
            f"cu_seqlens: expected cu_seqlens[-1] = T = {T}, the sequence length of i, got {bounds[-1]} "
            f"(cu_seqlens {_brief(bounds)})"
        )
    for n in range(len(bounds) - 1):
        if bounds[n + 1] <= bounds[n]:
            raise ValueError(
                f"cu_seqlens: expected strictly increasing boundaries (no empty documents), got "
                f"cu_seqlens[{n}] = {bounds[n]} and cu_seqlens[{n + 1}] = {bounds[n + 1]} (cu_seqlens {_brief(bounds)})"
            )


def finish(
    p: EOSProblem, y_bhtd: Tensor, m_T: Tensor | None, output_final_state: bool, real_output: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Back to the public layout [B, T, H, D] and dtype (y's real part when real_output); final
    state only when asked for."""
    if real_output and y_bhtd.is_complex():
        y_bhtd = y_bhtd.real
    y = y_bhtd.permute(0, 2, 1, 3).to(real_dtype(p.out_dtype) if real_output else p.out_dtype)
    if not output_final_state:
        return y, None
    return y, m_T.to(p.i.dtype)  # the compute dtype (float32 for half-precision inputs)


def on_device(x: Tensor) -> contextlib.AbstractContextManager:
    """The context a Triton launch on x's tensors runs in: x's CUDA device made the current one
    (Triton launches on the current device, so tensors on cuda:1 under a current cuda:0 would be
    read at addresses of the wrong device), nothing off CUDA (the CPU under the interpreter)."""
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def triton_unavailable(x: Tensor, traceable: bool = False) -> str | None:
    """Why no Triton kernel of lcsm.ops can run on x's tensors here, or None: triton missing, a call
    traced by torch.compile (unless ``traceable``: kernels a traced graph calls as custom ops), or a
    device other than CUDA, unless the CPU under Triton's interpreter."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.compiler.is_compiling() and not traceable:
        return "traced by torch.compile (the PyTorch forms trace with a symbolic T)"
    if x.device.type != "cuda":
        interpreted = False
        if x.device.type == "cpu":
            from . import triton_chunk

            interpreted = triton_chunk.INTERPRETED
        if not interpreted:
            return (
                f"the tensors are on {x.device}; the kernels run on CUDA devices, or on the CPU under Triton's "
                "interpreter (TRITON_INTERPRET=1 set before triton is imported)"
            )
    return None
