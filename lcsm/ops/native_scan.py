"""The selective scan on a CPU as one C kernel (``_native/scan.h``), with its adjoint.

It serves the EOS recurrence with vector e and s and a K x D decay: given as a product
``LogProduct(a, b)`` with b time-invariant, o_t = exp(a_t b), as Mamba's selective scan has it
(a = Delta_t [B, H, T, 1, D], b = A [H, K, D]); or as one tensor log_o [B, H, T, K, D]
(Longhorn's), read as the product log_o * 1. The chunk mode's elementwise
kernel (``chunk_scan``) computes
the same recurrence as PyTorch operations, tens per step: at batch 1 most of its time is spent
dispatching them (bench/results/native_scan.md). Here one pass per step forms exp(a_t b), updates
the memory and reduces it against s_t while the memory [K, 64 columns] stays in cache.

Forward: the memory at every chunk start (each ``chunk`` steps) is kept. Backward: each chunk is
recomputed from its start, its memories and decays held in a per-thread buffer, and the adjoint
recurrence runs over it in reverse, as ``chunk_scan.scan_chunk_backward`` does. Work is split
over (batch, head, block of 64 columns) among ``torch.get_num_threads()`` OpenMP threads: the
same runtime as torch's own parallel operations (loaded by torch first), whose idle workers take
the items. Forward and backward are torch.library custom ops (``native_scan``,
``native_scan_backward``), so that torch.compile's graphs call the kernel too.

The same library holds S4's kernel spectrum (its Cauchy sums over conjugate pairs and their
Woodbury combination) and its adjoint (``cauchy_forward``, ``cauchy_backward``;
``_native/cauchy.h``), which ``lcsm.layers.s4.kernel_spectrum`` calls eagerly on the CPU, and
CES's complex diagonal recurrence (``diag_forward``, ``diag_backward``; ``_native/diag.h``),
which ``lcsm.layers.ces`` calls likewise, block-diagonal linear maps (``_native/blockdiag.h``),
mLSTM's q/k/v projections, mLSTM's readout after its EOS call (``_native/readout.h``), and the
short depthwise causal convolutions (``_native/conv.h``), gated RMSNorms (``_native/rmsnorm.h``) and
SwiGLU's gate (``_native/glu.h``).

The kernel is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into
``$LCSM_NATIVE_DIR`` if set, else ``$LCSM_CACHE/native`` (default ``~/.cache/lcsm/native``), keyed by
the source, the flags, the compiler and the CPU's features (-march=native). ``native_unsupported``
says why it cannot run (no compiler, a failed build, ``LCSM_NATIVE=0``, inputs it does not take);
``eos``'s auto mode then takes the chunk form and ``explain`` says so. exp is evaluated by a
polynomial (``_native/scan.c``): within 2 units in the last place of libm's in float64, and 0
below exp(-87) in float32 (exp(-708) in float64), where libm returns a subnormal.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from lcsm._cache import cache_root

from ._autograd import first_order
from ._blocks import BLOCK_BYTES
from ._inputs import EOSProblem, constant_result

Tensor = torch.Tensor

_SOURCE = Path(__file__).parent / "_native"
# -ffp-contract=fast: a * b + c as one fused multiply-add (one rounding, not two), which -std=c11
# turns off by default; the products of the kernels' inner loops run at twice the rate with it.
_FLAGS = [
    *("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"),
    *("-fPIC", "-shared", "-std=c11"),
]
# -fopenmp: work items split among OpenMP threads; where the compiler cannot link OpenMP, the
# kernel is built with -fopenmp-simd (its loops still vectorised) and runs on one thread.
_THREADED, _SERIAL = "-fopenmp", "-fopenmp-simd"
# Columns of one work item (scan.h's DB): a [K, 64] memory of float32 is 4 KiB at K = 16.
COLUMNS = 64
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_state: dict = {"lib": None, "why": None, "serial": None}


def cache_dir() -> Path:
    """Where the compiled kernel is kept: ``$LCSM_NATIVE_DIR``, else ``$LCSM_CACHE/native``, else
    ``~/.cache/lcsm/native``. Its own variable lets runs with separate data caches (each test's, a
    project's) share one build, which takes seconds of compiler time."""
    own = os.environ.get("LCSM_NATIVE_DIR")
    return Path(own).expanduser() if own else cache_root() / "native"


def _cpu_features() -> str:
    """The CPU's feature flags (-march=native builds for them), or the machine name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded kernel, None), or (None, why not)."""
    if os.environ.get("LCSM_NATIVE", "1") == "0":
        return None, "LCSM_NATIVE=0 turns the native kernels off"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return None, f"no C compiler ({os.environ.get('CC', 'cc')!r} not found; set CC)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"the C compiler {compiler} did not run: {err}"
    key = hashlib.sha256()
    for part in [*(p.read_bytes() for p in sorted(_SOURCE.glob("*.[ch]"))), " ".join(_FLAGS).encode()]:
        key.update(part)
    key.update(version.encode())
    key.update(_cpu_features().encode())
    lib, why = None, None
    try:
        for threading in (_THREADED, _SERIAL):
            target = cache_dir() / f"scan-{key.hexdigest()[:16]}{threading}.so"
            failed = None if target.exists() else _compile(compiler, [*_FLAGS, threading], target)
            if failed is None:
                lib = ctypes.CDLL(str(target))
                break
            why = why or failed
        if lib is None:
            return None, f"building the native scan with {compiler} failed: {why}"
    except OSError as err:
        return None, f"the native scan could not be built or loaded at {target}: {err}"
    _state["serial"] = None if threading == _THREADED else f"one thread: {compiler} {_THREADED} failed: {why}"
    ptr, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    signatures = {
        # tensors, document bounds, strides, sizes, work items, threads, scratch and its size per thread
        "scan_forward_all": [*[ptr] * 9, ptr, ptr, ptr, i64, i64, ptr, i64],
        "scan_backward_all": [*[ptr] * 15, ptr, ptr, ptr, i64, i64, ptr, i64],
        # tensors, M, N2, rows H (the work items), threads (and the backward's scratch and its size per thread)
        "cauchy_forward_all": [*[ptr] * 9, *[i64] * 4],
        "cauchy_backward_all": [*[ptr] * 13, *[i64] * 4, ptr, i64],
        # tensors, M, N2, even, rows H, threads (and the backward's scratch and its size per thread)
        "s4_kernel_forward_all": [*[ptr] * 17, *[i64] * 5],
        "s4_kernel_backward_all": [*[ptr] * 24, *[i64] * 5, ptr, i64],
        # tensors, T, C, work items, threads, scratch and its size per thread
        "diag_forward_all": [*[ptr] * 8, *[i64] * 4, ptr, i64],
        "diag_backward_all": [*[ptr] * 12, *[i64] * 4, ptr, i64],
        # tensors, R, NB, BO, BI, work items, threads, scratch and its size per thread
        "blockdiag_apply_all": [*[ptr] * 3, *[i64] * 6, ptr, i64],
        "blockdiag_weight_grad_all": [*[ptr] * 3, *[i64] * 6, ptr, i64],
        # tensors, R, H, d, eps, norm eps, work items, threads, scratch and its size per thread
        "readout_forward_all": [*[ptr] * 7, *[i64] * 3, f64, f64, i64, i64, ptr, i64],
        "readout_backward_all": [*[ptr] * 12, *[i64] * 3, f64, f64, i64, i64, ptr, i64],
        # tensors, B, T, W, C, silu, work items, threads, scratch and its size per thread
        "conv_forward_all": [*[ptr] * 5, *[i64] * 5, i64, i64, ptr, i64],
        "conv_backward_all": [*[ptr] * 8, *[i64] * 5, i64, i64, ptr, i64],
        # tensors, R, C, group, gate first, eps, work items, threads, scratch and its size per thread
        "rmsnorm_forward_all": [*[ptr] * 4, *[i64] * 4, f64, i64, i64, ptr, i64],
        "rmsnorm_backward_all": [*[ptr] * 7, *[i64] * 4, f64, i64, i64, ptr, i64],
        # tensors (dy None: forward), elements, work items, threads, scratch and its size per thread
        "glu_all": [*[ptr] * 5, i64, i64, i64, ptr, i64],
        # tensors, strides, H, T, K, D, C, work items, threads, scratch and its size per thread
        "chunk_forward_all": [*[ptr] * 10, *[i64] * 5, i64, i64, ptr, i64],
        "chunk_backward_all": [*[ptr] * 14, *[i64] * 5, i64, i64, ptr, i64],
        # tensors, strides, H, T, K, D, C, column decay, work items, threads, scratch and its size per thread
        "chunk_vec_forward_all": [*[ptr] * 11, *[i64] * 6, i64, i64, ptr, i64],
        "chunk_vec_backward_all": [*[ptr] * 15, *[i64] * 6, i64, i64, ptr, i64],
    }
    for suffix in _SUFFIX.values():
        for name, argtypes in signatures.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, None
        fn = getattr(lib, f"chunk_scratch_{suffix}")  # C, K, D -> values of scratch per thread
        fn.argtypes, fn.restype = [i64] * 3, i64
        fn = getattr(lib, f"chunk_vec_scratch_{suffix}")  # C, K, D, decay width -> the same
        fn.argtypes, fn.restype = [i64] * 4, i64
    return lib, None


def _compile(compiler: str, flags: list[str], target: Path) -> str | None:
    """Compile the kernel to ``target``; the compiler's last message when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside the target and renamed into place: processes building at once (test workers)
    # each write their own file, and a reader never sees a partial one
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", tmp, str(_SOURCE / "scan.c")], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        os.replace(tmp, target)
    except subprocess.SubprocessError as err:
        return str(err)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return None


def library() -> ctypes.CDLL | None:
    """The compiled kernel (built on the first call in a process), or None; ``native_unsupported`` says why."""
    if _state["lib"] is None and _state["why"] is None:
        _state["lib"], _state["why"] = _build()
    return _state["lib"]


def native_unsupported(p: EOSProblem) -> str | None:
    """Why the native scan cannot serve this problem, or None when it can (the kernel is then
    built, if it was not)."""
    if p.i.device.type != "cpu":
        return f"the tensors are on {p.i.device} (the native scan runs on the CPU)"
    if p.i.dtype not in _SUFFIX:
        return f"compute dtype {p.i.dtype} (the kernel takes float32 and float64)"
    return scan_unsupported(p) or native_unavailable()


def scan_unsupported(p: EOSProblem) -> str | None:
    """Why this problem is not a selective scan (the native and Triton scans' problem: K-vector e
    and s, a full K x D decay as one tensor or a product with a time-invariant operand), or None."""
    if not (p.e_is_vector and p.s_is_vector):
        return "K x D " + "/".join(n for n, vec in (("e", p.e_is_vector), ("s", p.s_is_vector)) if not vec)
    if p.decay_kind not in ("full", "product") or (p.decay_kind == "product" and _split_product(p) is None):
        return (
            f"decay {p.decay_kind!r}: the kernel takes a full K x D decay, as one tensor or as a product "
            "a * b of which one operand is time-invariant (Mamba's Delta_t A)"
        )
    return None


def native_chunk_unsupported(p: EOSProblem) -> str | None:
    """Why the native chunk kernel (``native_chunk``) cannot run this problem's matmul kernel, or
    None when it does: it takes real float32 or float64 CPU tensors without a decay or with a
    scalar, row or column one, eagerly or in a compiled graph (two custom ops)."""
    if p.decay_kind not in KINDS:
        return f"decay {p.decay_kind!r} (the native chunk kernel takes {', '.join(KINDS)})"
    if p.i.device.type != "cpu":
        return f"the tensors are on {p.i.device}"
    if p.i.dtype not in _SUFFIX:
        return f"compute dtype {p.i.dtype} (the kernel takes real float32 and float64)"
    return native_unavailable()


@constant_result
def native_unavailable() -> str | None:
    """Why the kernel cannot run in this process (no compiler, a failed build, ``LCSM_NATIVE=0``),
    or None; built on the first call. A constant of a traced graph: torch.compile calls it while
    tracing, not in the graph."""
    return _state["why"] if library() is None else None


def native_serves(x: Tensor) -> bool:
    """Whether a layer's native kernel (``native_s4_spectrum``, ``native_diag_scan``,
    ``native_block_diag``, ``native_mlstm_readout``, ``native_causal_conv``,
    ``native_gated_rms_norm``, ``native_silu_mul``) takes x's computation: float32 or float64 CPU
    tensors, eager (traced graphs keep the layers' PyTorch forms), and the kernel built
    (``native_unavailable`` says why not)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _SUFFIX
        and not torch.compiler.is_compiling()
        and native_unavailable() is None
    )


def serial_reason() -> str | None:
    """Why the built kernel runs on one thread (its compiler could not link OpenMP), or None."""
    return _state["serial"]


def _split_product(p: EOSProblem) -> tuple[Tensor, Tensor] | None:
    """The product's operands as (a, b) with b shared by the batch and the steps ([1, H, 1, ..]),
    in either order, or None when neither is."""
    for a, b in (p.g_product, p.g_product[::-1]):
        if b.shape[0] == 1 and b.shape[2] == 1:
            return a, b
    return None


def eos_native(p: EOSProblem, chunk_size: int, cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """y [B, H, T, D] and the final states for a problem ``native_unsupported`` accepts: m_T
    [B, H, K, D], or with ``cu_seqlens`` (packed documents, B = 1, bounds already checked) each
    document's [N, H, K, D], each document started from its own initial state (p.m0 [N, H, K, D])."""
    x, e, s, a, b = scan_operands(p)
    y, m_T, _ = native_scan(x, e, s, a, b, p.m0, cu_seqlens, chunk_length(chunk_size, p.K, p.i.dtype))
    return y, m_T


def scan_operands(p: EOSProblem) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The selective scan's operands (x, e, s, a, b) of a problem ``native_unsupported`` accepts
    but for the device (the Triton scan takes the same): x [B, H, T, D], e, s [B, H, T, K], a [B, H,
    T, 1 | K, D] and b [H, K, D], the log decay a * b (a full tensor as itself times 1); broadcast
    views."""
    B, H, T, K, D = p.B, p.H, p.T, p.K, p.D
    if p.decay_kind == "full":
        a, b = p.g.expand(B, H, T, K, D), p.g.new_ones(1, 1, D).expand(H, K, D)
    else:
        a, b = _split_product(p)
        a, b = a.expand(B, H, T, a.shape[3], D), b[0, :, 0].expand(H, K, D)
    return p.i, p.e.squeeze(-1).expand(B, H, T, K), p.s.squeeze(-1).expand(B, H, T, K), a, b


def chunk_length(chunk_size: int, K: int, dtype: torch.dtype) -> int:
    """Steps between kept memories: ``chunk_size``, fewer where the backward's per-thread buffer
    of a chunk's memories and decays, (2C + 3) K COLUMNS values, would exceed BLOCK_BYTES."""
    per_step = 2 * K * COLUMNS * dtype.itemsize
    if per_step == 0:  # K = 0: no memory to keep
        return chunk_size
    return max(1, min(chunk_size, BLOCK_BYTES // per_step - 1))


def _unit_last(x: Tensor) -> Tensor:
    """x with its last dimension contiguous (the kernel's inner loops run along it)."""
    return x if x.shape[-1] <= 1 or x.stride(-1) == 1 else x.contiguous()


def _ptr(x: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(x.data_ptr() if x is not None else None)


def _int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


def _threads(items: int) -> int:
    """The OpenMP threads for ``items`` work items: torch.get_num_threads(), at most one per item."""
    return 1 if _state["serial"] else max(1, min(torch.get_num_threads(), items))


def _run(fn, items: int, scratch_per_thread: int, like: Tensor, *args) -> None:
    """fn over work items 0..items on ``_threads(items)`` threads, each with its scratch."""
    threads = _threads(items)
    scratch = like.new_empty(threads, scratch_per_thread)
    fn(*args, items, threads, _ptr(scratch), scratch_per_thread)


# The kernel as two torch.library custom ops with autograd: opaque to torch.compile's tracer (a
# graph calls them as it calls any aten op, their fake forms give the output shapes), so eager
# and compiled calls run the same kernel.


@torch.library.custom_op("lcsm::native_scan", mutates_args=())
def native_scan(
    x: Tensor, e: Tensor, s: Tensor, a: Tensor, b: Tensor, m0: Tensor | None, cu: Tensor | None, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, m_T, the memories at chunk starts) for x [B, H, T, D], e, s [B, H, T, K], a [B, H, T,
    1|K, D] (broadcast views allowed), b [H, K, D], the log decay a * b; m0 and m_T [B N, H, K, D]
    (m0 may be None); cu None (one document a row) or the N documents of the (B = 1) row, ``cu_seqlens``;
    ``chunk`` the steps between kept memories."""
    k = _Call(x, e, s, a, b, m0, cu, chunk)
    y = x.new_empty(k.B, k.H, k.T, k.D)
    m_T = x.new_empty(k.B * k.docs, k.H, k.K, k.D)
    starts = x.new_empty(k.B, k.H, -(-k.T // chunk), k.K, k.D)
    args = [_ptr(t) for t in (*k.inputs, k.m0, y, m_T, starts)]
    k.run("forward", k.B * k.H * k.blocks, k.K * COLUMNS, *args)
    return y, m_T, starts


@native_scan.register_fake
def _(x, e, s, a, b, m0, cu, chunk):
    B, H, T, D = x.shape
    K, docs = e.shape[-1], 1 if cu is None else cu.shape[0] - 1
    return x.new_empty(B, H, T, D), x.new_empty(B * docs, H, K, D), x.new_empty(B, H, (T + chunk - 1) // chunk, K, D)


@torch.library.custom_op("lcsm::native_scan_backward", mutates_args=())
def native_scan_backward(
    x: Tensor,
    e: Tensor,
    s: Tensor,
    a: Tensor,
    b: Tensor,
    m0: Tensor | None,
    cu: Tensor | None,
    starts: Tensor,
    gy: Tensor,
    gm_T: Tensor | None,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``native_scan``'s inputs x, e, s, a, b and m0 (zeros when m0 is None)."""
    k = _Call(x, e, s, a, b, m0, cu, chunk)
    B, H, T, K, D = k.B, k.H, k.T, k.K, k.D
    gy = gy.contiguous()
    gm_T = gm_T.contiguous() if gm_T is not None else None
    dx, da = x.new_empty(B, H, T, D), x.new_empty(B, H, T, a.shape[3], D)
    de, ds = x.new_empty(k.blocks, B, H, T, K), x.new_empty(k.blocks, B, H, T, K)
    db, dm0 = x.new_empty(B, H, K, D), x.new_empty(B * k.docs, H, K, D)
    args = [_ptr(t) for t in (*k.inputs, starts, gy, gm_T, k.m0, dx, de, ds, da, db, dm0)]
    k.run("backward", B * H * k.blocks, (2 * chunk + 3) * K * COLUMNS + COLUMNS, *args)
    return dx, de.sum(0), ds.sum(0), da, db.sum(0), dm0


@native_scan_backward.register_fake
def _(x, e, s, a, b, m0, cu, starts, gy, gm_T, chunk):
    return scan_gradients_like(x, e, a, cu)


def scan_gradients_like(x: Tensor, e: Tensor, a: Tensor, cu: Tensor | None) -> tuple[Tensor, ...]:
    """Empty tensors shaped as a selective scan's gradients of x, e, s, a, b and m0 (the native and
    Triton scans' backward ops' fake forms)."""
    B, H, T, D = x.shape
    K, docs = e.shape[-1], 1 if cu is None else cu.shape[0] - 1
    return (
        x.new_empty(B, H, T, D),
        x.new_empty(B, H, T, K),
        x.new_empty(B, H, T, K),
        x.new_empty(B, H, T, a.shape[3], D),
        x.new_empty(H, K, D),
        x.new_empty(B * docs, H, K, D),
    )


def _setup_context(ctx, inputs, output):
    x, e, s, a, b, m0, cu, chunk = inputs
    # the kept memories take no gradient, and an unused output's is None, not a tensor of zeros
    # (the kept memories' would be [B, H, T / chunk, K, D])
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, e, s, a, b, m0, cu, output[2])
    ctx.chunk = chunk


def _backward(ctx, gy, gm_T, _):
    x, e, s, a, b, m0, cu, starts = ctx.saved_tensors
    gy = gy if gy is not None else torch.zeros_like(x)
    # gradients of the (expanded) views the op was given: autograd sums them to each input's shape
    dx, de, ds, da, db, dm0 = native_scan_backward(x, e, s, a, b, m0, cu, starts, gy, gm_T, ctx.chunk)
    return dx, de, ds, da, db, dm0 if m0 is not None else None, None, None


native_scan.register_autograd(_backward, setup_context=_setup_context)


class _Call:
    """One call of the kernel: its inputs laid out for it (each last dimension contiguous), sizes,
    documents, and the ctypes arrays of scan.h's sizes, strides and document bounds."""

    def __init__(self, x, e, s, a, b, m0, cu, chunk):
        self.inputs = x, e, s, a, b = tuple(_unit_last(t) for t in (x, e, s, a, b))
        self.m0 = m0.contiguous() if m0 is not None else None
        self.B, self.H, self.T, self.D = x.shape
        self.K = e.shape[-1]
        bounds = [0, self.T] if cu is None else cu.tolist()
        self.docs, self.blocks = len(bounds) - 1, -(-self.D // COLUMNS)
        # scan.h's strides; a's row stride 0 when it has one row (Mamba's Delta_t, shared by every k)
        a_k = a.stride(3) if a.shape[3] > 1 else 0
        strides = [*x.stride()[:3], *e.stride()[:3], *s.stride()[:3], *a.stride()[:3], a_k, *b.stride()[:2]]
        sizes = [self.B, self.H, self.T, self.K, self.D, chunk, COLUMNS, self.docs, a.shape[3]]
        self.tail = _int64s(bounds), _int64s(strides), _int64s(sizes)
        self.suffix = _SUFFIX[x.dtype]

    def run(self, name: str, items: int, scratch: int, *args) -> None:
        _run(getattr(library(), f"scan_{name}_all_{self.suffix}"), items, scratch, self.inputs[0], *args, *self.tail)


def _loaded() -> ctypes.CDLL:
    """The built library; a clear error where it cannot run in this process."""
    if library() is None:
        raise RuntimeError(f"the native kernels cannot run in this process: {_state['why']}")
    return library()


def _kernel(name: str, x: Tensor):
    """The library's kernel ``name`` for x's dtype; a clear error where it cannot run on x."""
    lib = _loaded()
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        raise ValueError(f"the native kernels take float32 or float64 CPU tensors, got {x.dtype} on {x.device}")
    return getattr(lib, f"{name}_{_SUFFIX[x.dtype]}")


def _real_parts(z: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A complex tensor as contiguous [..., 2] real and imaginary parts of ``dtype`` (None stays
    None), as the kernels read complex operands and cotangents."""
    return None if z is None else torch.view_as_real(z.resolve_conj().to(dtype.to_complex())).contiguous()


def _constant(name: str) -> int:
    """A size the C source defines (``lcsm_<name>``), read from the built library."""
    return ctypes.c_int64.in_dll(_loaded(), f"lcsm_{name}").value


# S4's kernel spectrum (lcsm/layers/s4.py, ``kernel_spectrum``; C source _native/cauchy.h): the
# same library, one work item per row h, a vector of roots at a time.


def cauchy_forward(gr: Tensor, gi: Tensor, cr: Tensor, ci: Tensor, a: Tensor, s: Tensor, W: Tensor):
    """(K [H, M] complex, S [H, 16, M]): S[h, m, k] = sum_n W[h, n, k] / ((g_m - lam_n)(g_m -
    conj(lam_n))) and K = c (k_0 - k_1 k_2 / (1 + k_3)) with k_j = g S_j - S_(4+j), for g = gr + i gi
    [H, M], c = cr + i ci [M], a = Re lam and s = |lam|^2 [H, N2], W [H, N2, 8]; all real, of one
    dtype, contiguous. S (the real parts, then the imaginary) is for ``cauchy_backward``."""
    (H, M), N2 = gr.shape, a.shape[1]
    K, S = gr.new_empty(H, M, 2), gr.new_empty(H, 2 * W.shape[2], M)
    fn = _kernel("cauchy_forward_all", gr)
    fn(*(_ptr(t) for t in (gr, gi, cr, ci, a, s, W, K, S)), M, N2, H, _threads(H))
    return torch.view_as_complex(K), S


def cauchy_backward(gr, gi, cr, ci, a, s, W, S, grad_K: Tensor) -> tuple[Tensor, ...]:
    """The gradients of ``cauchy_forward``'s g (complex [H, M]), a, s and W, given K's (complex)."""
    (H, M), N2 = gr.shape, a.shape[1]
    gK = _real_parts(grad_K, gr.dtype)
    dg, da, ds, dW = gr.new_empty(H, M, 2), torch.empty_like(a), torch.empty_like(s), torch.empty_like(W)
    fn = _kernel("cauchy_backward_all", gr)
    tensors = (gr, gi, cr, ci, a, s, W, S, gK, dg, da, ds, dW)
    lanes = _constant("cauchy_vector_bytes") // gr.element_size()
    # per lane, sums over the roots for each pole: dW's 8, da's and ds's, and a vector's slack to align them
    _run(fn, H, (N2 * (W.shape[2] + 2) + 1) * lanes, gr, *(_ptr(t) for t in tensors), M, N2)
    return torch.view_as_complex(dg), da, ds, dW


def s4_kernel_forward(log_a, b, P, B, C, log_dt, r, c, even: bool) -> tuple[Tensor, tuple[Tensor, ...]]:
    """S4's kernel spectrum from its parameters (``native_s4_kernel``'s forward):
    ``cauchy_forward`` with its operands formed per row in C, g = (2 / dt) r, a = Re lam, s = |lam|^2,
    W = 2 [Re v, Re v a + Im v b], v = [C B, C P, conj(P) B, |P|^2]: log_a, b [H, N2] (lam =
    -exp(log_a) + i b), P, B, C [H, N2, 2] (real and imaginary parts), log_dt [H], all real of one
    dtype and contiguous; r = (1 - z) / (1 + z) and c = 2 / (1 + z) [M] complex at the roots z.
    Returns (K [H, M + even] complex, with ``even`` the z = -1 value dt Re(sum_n C_n B_n) last;
    the operands and sums ``s4_kernel_backward`` reads)."""
    (H, N2), M = log_a.shape, r.shape[0]
    rr, ri, cr, ci = (z.to(log_a.dtype).contiguous() for z in (r.real, r.imag, c.real, c.imag))
    gr, gi, a, s = log_a.new_empty(H, M), log_a.new_empty(H, M), torch.empty_like(log_a), torch.empty_like(log_a)
    W, K, S = log_a.new_empty(H, N2, 8), log_a.new_empty(H, M + even, 2), log_a.new_empty(H, 16, M)
    fn = _kernel("s4_kernel_forward_all", log_a)
    tensors = (log_a, b, P, B, C, log_dt, rr, ri, cr, ci, gr, gi, a, s, W, K, S)
    fn(*(_ptr(t) for t in tensors), M, N2, int(even), H, _threads(H))
    return torch.view_as_complex(K), (gr, gi, cr, ci, a, s, W, S)


def s4_kernel_backward(log_dt, b, P, B, C, kept: tuple[Tensor, ...], grad_K: Tensor, even: bool):
    """The gradients of ``s4_kernel_forward``'s log_a, b, P, B, C and log_dt given K's (complex);
    ``kept`` the forward's operands and sums."""
    gr, gi, cr, ci, a, s, W, S = kept
    (H, M), N2 = gr.shape, a.shape[1]
    gK = _real_parts(grad_K, gr.dtype)
    dg, da, ds, dW = gr.new_empty(H, M, 2), torch.empty_like(a), torch.empty_like(a), torch.empty_like(W)
    grads = (torch.empty_like(a), torch.empty_like(a), torch.empty_like(P), torch.empty_like(B), torch.empty_like(C))
    grads += (torch.empty_like(log_dt),)
    tensors = (log_dt, b, P, B, C, cr, ci, gr, gi, a, s, W, S, gK, dg, da, ds, dW, *grads)
    lanes = _constant("cauchy_vector_bytes") // gr.element_size()
    fn = _kernel("s4_kernel_backward_all", gr)
    _run(fn, H, (N2 * (W.shape[2] + 2) + 1) * lanes, gr, *(_ptr(t) for t in tensors), M, N2, int(even))
    return grads


# The chunk form with no, a scalar, a row or a column decay (lcsm/ops/chunk_matmul.py's matmul
# kernel, kinds "none", "scalar", "row" and "col"; C source _native/chunk.h): work items (batch
# row, head), each thread's taken in groups, the chunks in order over a group.

KINDS = ("none", "scalar", "row", "col")


def _step_major(x: Tensor) -> Tensor:
    """A [B, H, T, X] view the chunk kernel reads and whose layout its gradient takes: x itself when
    its elements are distinct and each row of X contiguous (the caller's [B, T, H, X] layout, seen
    head-major, or a contiguous [B, H, T, X]); otherwise (a broadcast, a strided slice) a copy laid
    out as [B, T, H, X]."""
    if x.stride(-1) == 1 and (x.is_contiguous() or x.transpose(1, 2).is_contiguous()):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _chunk_strides(*xs: Tensor) -> ctypes.Array:
    """Each [B, H, T, X] view's batch, head and time strides, in order, for chunk.h."""
    return _int64s([n for x in xs for n in x.stride()[:3]])


def _chunk_scratch(C: int, K: int, D: int, x: Tensor, kind: str) -> int:
    """Values of scratch per thread the chunk kernel needs (its padded blocks; chunk.h)."""
    lib, suffix = _loaded(), _SUFFIX[x.dtype]
    if kind in ("row", "col"):
        return getattr(lib, f"chunk_vec_scratch_{suffix}")(C, K, D, K if kind == "row" else D)
    return getattr(lib, f"chunk_scratch_{suffix}")(C, K, D)


# The chunk kernel's forward and backward, eagerly through an autograd.Function and in compiled
# graphs as two custom ops with autograd (as the scan above), both calling the same functions: the
# ops' dispatch costs about 0.1 ms a call each way, a quarter of a small call's time. Outputs a kind
# lacks (m_strict without a decay, y_strict but for a column decay) are empty tensors: an op
# returns tensors only.


def _chunk_operands(s: Tensor, e: Tensor, x: Tensor, g: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(t if t is None else _step_major(t) for t in (s, e, x, g))


def _chunk_outputs(s: Tensor, x: Tensor, C: int, kind: str, decayed: bool) -> tuple[Tensor, ...]:
    """The forward's outputs, allocated for the op and its fake alike (their strides must agree):
    y laid out as x; m_T; the memories at chunk starts; o_T m_{T-1} (with a decay: the decay
    gradient's boundary term); y without each step's own term (a column decay's gradient reads it)."""
    (B, H, T, K), D = s.shape, x.shape[-1]
    y, m_T = torch.empty_like(x), x.new_empty(B, H, K, D)
    starts = x.new_empty(B, H, (T + C - 1) // C, K, D)
    m_strict = torch.empty_like(m_T) if decayed else x.new_empty(0)
    return y, m_T, starts, m_strict, torch.empty_like(y) if kind == "col" else x.new_empty(0)


def _chunk_forward_impl(
    s: Tensor, e: Tensor, x: Tensor, g: Tensor | None, m0: Tensor | None, C: int, kind: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    s, e, x, g = _chunk_operands(s, e, x, g)
    (B, H, T, K), D = s.shape, x.shape[-1]
    m0 = None if m0 is None else m0.to(x.dtype).contiguous()
    y, m_T, starts, m_strict, y_strict = out = _chunk_outputs(s, x, C, kind, g is not None)
    if kind in ("row", "col"):
        fn = _kernel("chunk_vec_forward_all", x)
        tensors = (s, e, x, g, m0, y, y_strict if kind == "col" else None, m_T, m_strict, starts)
        sizes = (H, T, K, D, C, int(kind == "col"))
    else:
        fn = _kernel("chunk_forward_all", x)
        tensors = (s, e, x, g, m0, y, m_T, m_strict if g is not None else None, starts)
        sizes = (H, T, K, D, C)
    strides = _chunk_strides(s, e, x, x if g is None else g, y)
    _run(fn, B * H, _chunk_scratch(C, K, D, x, kind), x, *(_ptr(t) for t in tensors), strides, *sizes)
    return out


_chunk_forward = torch.library.custom_op("lcsm::native_chunk", _chunk_forward_impl, mutates_args=())


@_chunk_forward.register_fake
def _(s, e, x, g, m0, C, kind):
    s, _, x, _ = _chunk_operands(s, e, x, g)
    return _chunk_outputs(s, x, C, kind, g is not None)


def _chunk_gradients(s: Tensor, e: Tensor, x: Tensor, g: Tensor | None, kind: str) -> tuple[Tensor, ...]:
    """ds, de, dx laid out as s, e, x; dg as g (a row or column decay: the kernel writes it through
    g's strides) or contiguous (a scalar one), empty without a decay; dm0."""
    (B, H, _, K), D = s.shape, x.shape[-1]
    dg = x.new_empty(0) if g is None else x.new_empty(g.shape) if kind == "scalar" else torch.empty_like(g)
    return torch.empty_like(s), torch.empty_like(e), torch.empty_like(x), dg, x.new_empty(B, H, K, D)


def _chunk_backward_impl(
    s: Tensor,
    e: Tensor,
    x: Tensor,
    g: Tensor | None,
    m_strict: Tensor,
    starts: Tensor,
    y_strict: Tensor,
    dy: Tensor,
    dm_T: Tensor | None,
    C: int,
    kind: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``_chunk_forward``'s s, e, x, g (empty without a decay) and m0."""
    s, e, x, g = _chunk_operands(s, e, x, g)
    (B, H, T, K), D = s.shape, x.shape[-1]
    dy = _step_major(dy.to(x.dtype))
    dm_T = None if dm_T is None else dm_T.to(x.dtype).contiguous()
    carry = None
    if g is not None and dm_T is not None:  # the decay gradient's boundary term <dM, o_T m_{T-1}>
        over = {"scalar": (-2, -1), "row": -1, "col": -2}[kind]  # summed over what the decay shares
        carry = (dm_T * m_strict).sum(over).contiguous()
    ds, de, dx, dg, dm0 = out = _chunk_gradients(s, e, x, g, kind)
    if kind in ("row", "col"):
        fn = _kernel("chunk_vec_backward_all", x)
        y_strict = y_strict if kind == "col" else None
        tensors = (s, e, x, g, y_strict, starts, dy, dm_T, carry, ds, de, dx, dg, dm0)
        strides = _chunk_strides(s, e, x, g, dy, x if y_strict is None else y_strict)
        sizes = (H, T, K, D, C, int(kind == "col"))
    else:
        fn = _kernel("chunk_backward_all", x)
        tensors = (s, e, x, g, starts, dy, dm_T, carry, ds, de, dx, dg if g is not None else None, dm0)
        strides = _chunk_strides(s, e, x, *((x, dy, x) if g is None else (g, dy, dg)))
        sizes = (H, T, K, D, C)
    _run(fn, B * H, _chunk_scratch(C, K, D, x, kind), x, *(_ptr(t) for t in tensors), strides, *sizes)
    return out


_chunk_backward = torch.library.custom_op("lcsm::native_chunk_backward", _chunk_backward_impl, mutates_args=())


@_chunk_backward.register_fake
def _(s, e, x, g, m_strict, starts, y_strict, dy, dm_T, C, kind):
    s, e, x, g = _chunk_operands(s, e, x, g)
    return _chunk_gradients(s, e, x, g, kind)


def _chunk_setup_context(ctx, inputs, output):
    s, e, x, g, m0, C, kind = inputs
    _, _, starts, m_strict, y_strict = output
    ctx.save_for_backward(s, e, x, g, m_strict, starts, y_strict)
    ctx.C, ctx.kind, ctx.initial = C, kind, m0 is not None


def _chunk_gradients_of(ctx, dy: Tensor | None, dm_T: Tensor | None, backward) -> tuple:
    """The inputs' gradients by ``backward`` (the op or its implementation) from ctx's saved tensors."""
    s, e, x, g, m_strict, starts, y_strict = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    ds, de, dx, dg, dm0 = backward(s, e, x, g, m_strict, starts, y_strict, dy, dm_T, ctx.C, ctx.kind)
    return ds, de, dx, None if g is None else dg, dm0 if ctx.initial else None, None, None


_chunk_forward.register_autograd(
    lambda ctx, dy, dm_T, *_: _chunk_gradients_of(ctx, dy, dm_T, _chunk_backward), setup_context=_chunk_setup_context
)


class _NativeChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s: Tensor, e: Tensor, x: Tensor, g: Tensor | None, m0: Tensor | None, C: int, kind: str):
        out = _chunk_forward_impl(s, e, x, g, m0, C, kind)
        _chunk_setup_context(ctx, (s, e, x, g, m0, C, kind), out)
        return out[0], out[1]

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor | None, dm_T: Tensor | None):
        return _chunk_gradients_of(ctx, dy, dm_T, _chunk_backward_impl)


def native_chunk(
    s: Tensor, e: Tensor, x: Tensor, g: Tensor | None, m0: Tensor | None, chunk: int, kind: str | None = None
) -> tuple[Tensor, Tensor]:
    """EOS by the chunk form in the native kernel, forward and backward (``chunk_matmul``'s matmul
    kernel, its twin): m_t = o_t * m_{t-1} + e_t x_t^T, y_t = m_t^T s_t for s, e [B, H, T, K] and x
    [B, H, T, D] (views of the caller's [B, T, H, *] tensors are read in place), the log decay g =
    log o by ``kind``: "none" (g None), "scalar" (g [B, H, T, 1]), "row" (g [B, H, T, K]: o_t scales
    the memory's rows, GLA's) or "col" (g [B, H, T, D]: its columns); None takes "none" or "scalar"
    by g. m0 [B, H, K, D] or None (zeros), chunks of ``chunk`` steps; real float32 or float64 on the
    CPU, one dtype. Any decay takes the kernel's one form, however strong (chunk.h says how); a log
    below ``LOG_ZERO`` (-inf: a decay of exactly 0) is read as it, with a gradient of 0, as
    ``finite_log`` does. Returns (y [B, H, T, D] laid out as x, m_T [B, H, K, D]).
    ``native_unavailable()`` must be None."""
    kind = kind if kind is not None else "none" if g is None else "scalar"
    if kind not in KINDS:
        raise ValueError(f"native_chunk: kind expected one of {', '.join(KINDS)} or None, got {kind!r}")
    B, H, T, K = s.shape if s.dim() == 4 else (-1, -1, -1, -1)
    D = x.shape[-1] if x.dim() == 4 else -1
    width = {"scalar": 1, "row": K, "col": D}.get(kind)
    if (
        e.shape != s.shape
        or x.shape != (B, H, T, D)
        or (g is None) != (kind == "none")
        or (g is not None and g.shape != (B, H, T, width))
        or (m0 is not None and m0.shape != (B, H, K, D))
    ):
        got = [None if t is None else list(t.shape) for t in (s, e, x, g, m0)]
        want = "None" if kind == "none" else f"[B, H, T, {dict(scalar='1', row='K', col='D')[kind]}]"
        raise ValueError(
            f"native_chunk: expected s and e [B, H, T, K], x [B, H, T, D], g {want} (kind {kind!r}) and m0 "
            f"[B, H, K, D] or None, got {got}"
        )
    dtypes = {t.dtype for t in (s, e, x, g) if t is not None}
    if len(dtypes) > 1 or chunk < 1:
        got = f"{', '.join(sorted(map(str, dtypes)))}, chunk {chunk}"
        raise ValueError(f"native_chunk: expected one dtype and chunk >= 1, got {got}")
    if torch.compiler.is_compiling():
        y, m_T, *_ = _chunk_forward(s, e, x, g, m0, chunk, kind)
        return y, m_T
    return _NativeChunk.apply(s, e, x, g, m0, chunk, kind)


# CES's time-invariant complex diagonal recurrence with a real readout (lcsm/layers/ces.py; C
# source _native/diag.h), one state per channel: work items (batch row, block of channels).


def diag_forward(x: Tensor, lam: Tensor, e: Tensor, s: Tensor, m0: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """m_t = lam m_{t-1} + e x_t, y_t = Re(s m_t) per channel: x [B, T, C] real; lam, e, s [2, C] (real
    and imaginary parts); m0 [B, C, 2] or None (zeros). Returns (y [B, T, C], m_T [B, C, 2], the
    memories kept for the backward); all of x's dtype, inputs contiguous."""
    B, T, C = x.shape
    fn = _kernel("diag_forward_all", x)
    y, m_T = torch.empty_like(x), x.new_empty(B, C, 2)
    starts = x.new_empty(B, -(-T // _constant("diag_chunk")), 2, C)
    tensors = (x, lam, e, s, m0, y, m_T, starts)
    _run(fn, _diag_items(B, C), 2 * _constant("diag_block"), x, *(_ptr(t) for t in tensors), T, C)
    return y, m_T, starts


def diag_backward(
    x: Tensor, lam: Tensor, e: Tensor, s: Tensor, starts: Tensor, gy: Tensor, gm_T: Tensor | None
) -> tuple[Tensor, ...]:
    """``diag_forward``'s gradients: dx [B, T, C]; dlam, de, ds [B, 2, C] (each batch row's share);
    dm0 [B, C, 2]. gy [B, T, C] and gm_T [B, C, 2] (or None) contiguous, of x's dtype."""
    B, T, C = x.shape
    dx, dm0 = torch.empty_like(x), x.new_empty(B, C, 2)
    dlam, de, ds = (x.new_empty(B, 2, C) for _ in range(3))
    fn = _kernel("diag_backward_all", x)
    tensors = (x, lam, e, s, starts, gy, gm_T, dx, dlam, de, ds, dm0)
    scratch = (2 * _constant("diag_chunk") + 10) * _constant("diag_block")
    _run(fn, _diag_items(B, C), scratch, x, *(_ptr(t) for t in tensors), T, C)
    return dx, dlam, de, ds, dm0


def _diag_items(B: int, C: int) -> int:
    """The diagonal recurrence's work items: each batch row's blocks of channels."""
    return B * -(-C // _constant("diag_block"))


class _NativeS4Spectrum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: Tensor, c: Tensor, a: Tensor, s: Tensor, W: Tensor) -> Tensor:
        parts = [z.to(a.dtype).contiguous() for z in (g.real, g.imag, c.real, c.imag)]
        operands = (*parts, a.contiguous(), s.contiguous(), W.to(a.dtype).contiguous())
        K, S = cauchy_forward(*operands)
        ctx.save_for_backward(*operands, S)
        return K

    @staticmethod
    @first_order
    def backward(ctx, grad_K: Tensor):
        dg, da, ds, dW = cauchy_backward(*ctx.saved_tensors, grad_K)
        return dg, None, da, ds, dW


def native_s4_spectrum(g: Tensor, c: Tensor, a: Tensor, s: Tensor, W: Tensor) -> Tensor:
    """S4's kernel spectrum by the native kernel, with its adjoint (autograd; c is a constant):
    K[h, m] = c_m (k_0 - k_1 k_2 / (1 + k_3)), k_j = g S_j - S_(4+j), from the Cauchy sums over
    conjugate pairs S[h, m, k] = sum_n W[h, n, k] / ((g - lam_n)(g - conj(lam_n))), for g [H, M] and
    c [M] complex, a = Re lam and s = |lam|^2 [H, N2] real, W [H, N2, 8] real -> [H, M] complex,
    computed in a's dtype (float32 or float64), on the CPU. ``native_unavailable()`` must be None."""
    H, N2 = a.shape if a.dim() == 2 else (-1, -1)
    columns = _constant("cauchy_columns")
    if g.dim() != 2 or g.shape[0] != H or c.shape != g.shape[1:] or s.shape != a.shape or W.shape != (H, N2, columns):
        raise ValueError(
            f"native_s4_spectrum: expected g [H, M], c [M], a and s [H, N2], W [H, N2, {columns}], got "
            f"{list(g.shape)}, {list(c.shape)}, {list(a.shape)}, {list(s.shape)}, {list(W.shape)}"
        )
    return _NativeS4Spectrum.apply(g, c, a, s, W)


class _NativeS4Kernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_A_real, A_imag, P, B, C, log_dt, r, c, even: bool) -> Tensor:
        params = [t.contiguous() for t in (log_A_real, A_imag, P, B, C, log_dt)]
        K, kept = s4_kernel_forward(*params, r, c, even)
        ctx.save_for_backward(*params[1:], *kept)
        ctx.even = even
        return K

    @staticmethod
    @first_order
    def backward(ctx, grad_K: Tensor):
        A_imag, P, B, C, log_dt, *kept = ctx.saved_tensors
        grads = s4_kernel_backward(log_dt, A_imag, P, B, C, tuple(kept), grad_K, ctx.even)
        return (*grads, None, None, None)


def native_s4_kernel(log_A_real, A_imag, P, B, C, log_dt, r: Tensor, c: Tensor, even: bool) -> Tensor:
    """S4's kernel spectrum from its parameters (lcsm/layers/s4.py, ``S4._kernel``) by the native
    kernel, with every parameter's gradient written out in C (autograd; r and c are constants):
    ``native_s4_spectrum``'s sums and combination with their operands g = (2 / dt) r, a = Re lam,
    s = |lam|^2 and W = 2 [Re v, Re(v conj(lam))], v = [C B, C P, conj(P) B, |P|^2], formed per row
    in the same pass, where autograd through those small [H, N/2] and [H, M] complex operations
    (some 60 of a few microseconds each, forward and backward) cost as much as the sums at T = 512.
    log_A_real, A_imag [H, N2] (lam = -exp(log_A_real) + i A_imag), P, B, C [H, N2, 2] (real and
    imaginary parts; C is C~), log_dt [H], all real of one dtype (float32 or float64), on the CPU;
    r = (1 - z) / (1 + z) and c = 2 / (1 + z) [M] complex at the roots z; even: whether z = -1 is a
    root, its value dt Re(sum_n C_n B_n) then appended -> [H, M + even] complex.
    ``native_unavailable()`` must be None."""
    H, N2 = log_A_real.shape if log_A_real.dim() == 2 else (-1, -1)
    pairs = (H, N2, 2)
    if (
        A_imag.shape != (H, N2)
        or (P.shape, B.shape, C.shape) != (pairs, pairs, pairs)
        or log_dt.shape != (H,)
        or r.dim() != 1
        or c.shape != r.shape
    ):
        raise ValueError(
            "native_s4_kernel: expected log_A_real and A_imag [H, N2], P, B, C [H, N2, 2], log_dt [H], r and c "
            f"[M], got {[list(t.shape) for t in (log_A_real, A_imag, P, B, C, log_dt, r, c)]}"
        )
    return _NativeS4Kernel.apply(log_A_real, A_imag, P, B, C, log_dt, r, c, even)


class _DiagScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, lam: Tensor, e: Tensor, s: Tensor, m0: Tensor | None):
        parts = [torch.stack([z.real, z.imag]).to(x.dtype).contiguous() for z in (lam, e, s)]
        x = x.contiguous()
        y, m_T, starts = diag_forward(x, *parts, _real_parts(m0, x.dtype))
        ctx.save_for_backward(x, *parts, starts)
        ctx.initial = m0 is not None  # the backward forms dm0 regardless; it is returned only then
        return y, torch.view_as_complex(m_T)

    @staticmethod
    @first_order
    def backward(ctx, gy: Tensor | None, gm_T: Tensor | None):
        x, lam, e, s, starts = ctx.saved_tensors
        gy = torch.zeros_like(x) if gy is None else gy.to(x.dtype).contiguous()
        dx, dlam, de, ds, dm0 = diag_backward(x, lam, e, s, starts, gy, _real_parts(gm_T, x.dtype))

        def summed(d: Tensor) -> Tensor:  # [B, 2, C]: each batch row's share, real and imaginary parts
            return torch.complex(d[:, 0].sum(0), d[:, 1].sum(0))

        return dx, summed(dlam), summed(de), summed(ds), torch.view_as_complex(dm0) if ctx.initial else None


def native_diag_scan(x: Tensor, lam: Tensor, e: Tensor, s: Tensor, m0: Tensor | None) -> tuple[Tensor, Tensor]:
    """A time-invariant complex diagonal recurrence with a real readout by the native kernel, with
    its adjoint (autograd): m_t = lam m_{t-1} + e x_t, y_t = Re(s m_t) per channel, for x [B, T, C]
    real (float32 or float64, on the CPU), lam, e, s [C] complex, m0 [B, C] complex or None (zeros)
    -> (y [B, T, C], m_T [B, C] complex). A pass over time per block of channels, where an FFT form
    transforms every channel at twice the length. ``native_unavailable()`` must be None."""
    C = x.shape[-1]
    if x.dim() != 3 or any(z.shape != (C,) for z in (lam, e, s)) or (m0 is not None and m0.shape != (x.shape[0], C)):
        shapes = ", ".join(str(None if z is None else list(z.shape)) for z in (lam, e, s, m0))
        raise ValueError(
            f"native_diag_scan: expected x [B, T, C], lam, e, s [C], m0 [B, C] or None, got {list(x.shape)}, {shapes}"
        )
    return _DiagScan.apply(x, lam, e, s, m0)


# Block-diagonal linear maps (mLSTM's q/k/v projections; C source _native/blockdiag.h): work items
# are blocks of rows (tokens).


def _block_diag_apply(rows: Tensor, w: Tensor) -> Tensor:
    """y [R, NB * BO] for rows [R, NB * BI] and w [NB, BO, BI], contiguous, of one dtype."""
    (R, _), (NB, BO, BI) = rows.shape, w.shape
    y = rows.new_empty(R, NB * BO)
    fn = _kernel("blockdiag_apply_all", rows)
    _run(fn, _tiles(R, "blockdiag_rows"), NB * BO * BI, rows, _ptr(rows), _ptr(w), _ptr(y), R, NB, BO, BI)
    return y


class _BlockDiag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor) -> Tensor:
        rows, w = x.contiguous().view(-1, x.shape[-1]), w.to(x.dtype).contiguous()
        ctx.save_for_backward(rows, w)
        return _block_diag_apply(rows, w).view(*x.shape[:-1], -1)

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        rows, w = ctx.saved_tensors
        (R, _), (NB, BO, BI) = rows.shape, w.shape
        dy_rows = dy.to(rows.dtype).contiguous().view(R, NB * BO)
        dx = _block_diag_apply(dy_rows, w.transpose(1, 2).contiguous())
        dw_part = rows.new_empty(_tiles(R, "blockdiag_rows"), NB, BO, BI)
        fn = _kernel("blockdiag_weight_grad_all", rows)
        _run(fn, _tiles(R, "blockdiag_rows"), 1, rows, _ptr(rows), _ptr(dy_rows), _ptr(dw_part), R, NB, BO, BI)
        return dx.view(*dy.shape[:-1], NB * BI), dw_part.sum(0)


def _tiles(rows: int, name: str) -> int:
    """Work items of a kernel that takes ``rows`` rows (tokens) in tiles of ``lcsm_<name>``."""
    return -(-rows // _constant(name))


def native_block_diag(x: Tensor, w: Tensor) -> Tensor:
    """A block-diagonal linear map by the native kernel, with its adjoint (autograd):
    y[..., n, u] = sum_o w[n, u, o] x[..., n, o] for x [..., NB * BI] and w [NB, BO, BI] -> [...,
    NB * BO], computed in x's dtype (float32 or float64), on the CPU. ``native_unavailable()`` must
    be None."""
    if w.dim() != 3 or x.dim() < 1 or x.shape[-1] != w.shape[0] * w.shape[2]:
        raise ValueError(
            f"native_block_diag: expected x [..., NB * BI] and w [NB, BO, BI], got {list(x.shape)}, {list(w.shape)}"
        )
    return _BlockDiag.apply(x, w)


# mLSTM's readout after its EOS call (lcsm/layers/mlstm.py; C source _native/readout.h): work items
# are tiles of rows (tokens).


class _MLSTMReadout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, floor, c, z, scale, skip, eps: float, norm_eps: float):
        H, d1 = y.shape[-2:]
        d, dt = d1 - 1, y.dtype
        R = y.numel() // (H * d1)
        y, floor, c, z, scale, skip = (t.to(dt).contiguous() for t in (y, floor, c, z, scale, skip))
        out = c.new_empty(c.shape)
        fn = _kernel("readout_forward_all", y)
        items = _tiles(R, "readout_rows")
        ptrs = [_ptr(t) for t in (y, floor, c, z, scale, skip, out)]
        _run(fn, items, 1, y, *ptrs, R, H, d, eps, norm_eps)
        ctx.save_for_backward(y, floor, c, z, scale, skip)
        ctx.sizes = (R, H, d, eps, norm_eps)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout: Tensor):
        y, floor, c, z, scale, skip = ctx.saved_tensors
        R, H, d, eps, norm_eps = ctx.sizes
        dout = dout.to(y.dtype).contiguous()
        dy, dfloor, dc, dz = (torch.empty_like(t) for t in (y, floor, c, z))
        items = _tiles(R, "readout_rows")
        parts = y.new_empty(items, 2, H * d)
        fn = _kernel("readout_backward_all", y)
        tensors = (y, floor, c, z, scale, skip, dout, dy, dfloor, dc, dz, parts)
        _run(fn, items, 2 * d, y, *(_ptr(t) for t in tensors), R, H, d, eps, norm_eps)
        dscale, dskip = parts.sum(0).unbind(0)
        return dy, dfloor, dc, dz, dscale, dskip, None, None


def native_mlstm_readout(
    y: Tensor, floor: Tensor, c: Tensor, z: Tensor, scale: Tensor, skip: Tensor, eps: float, norm_eps: float
) -> Tensor:
    """mLSTM's readout after its EOS call by the native kernel, with its adjoint (autograd): per
    token and head, h = y[..., :d] / (max(|y[..., d]|, floor) + eps), then
    (layer_norm(h over d, norm_eps) * scale + skip * c) * silu(z), heads side by side; for y [..., H,
    d + 1], floor [..., H], c and z [..., H d], scale and skip [H d] -> [..., H d], in y's dtype
    (float32 or float64), on the CPU. ``native_unavailable()`` must be None."""
    *lead, H, d1 = y.shape
    width = H * (d1 - 1)
    if (
        d1 < 2
        or floor.shape != (*lead, H)
        or c.shape != (*lead, width)
        or z.shape != c.shape
        or scale.shape != (width,)
        or skip.shape != (width,)
    ):
        shapes = ", ".join(str(list(t.shape)) for t in (y, floor, c, z, scale, skip))
        raise ValueError(
            "native_mlstm_readout: expected y [..., H, d + 1], floor [..., H], c and z [..., H d], scale and "
            f"skip [H d], got {shapes}"
        )
    return _MLSTMReadout.apply(y, floor, c, z, scale, skip, float(eps), float(norm_eps))


# The short depthwise causal convolutions (lcsm/layers/packing.py's short_conv; C source
# _native/conv.h): work items are (batch row, tile of steps).


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, history, taps, bias, silu: bool):
        (B, T, C), W = x.shape, taps.shape[0]
        x, taps = x.contiguous(), taps.to(x.dtype).contiguous()
        history = None if history is None else history.to(x.dtype).contiguous()
        bias = None if bias is None else bias.to(x.dtype).contiguous()
        y = torch.empty_like(x)
        items = B * _tiles(T, "conv_rows")
        fn = _kernel("conv_forward_all", x)
        _run(fn, items, 1, x, _ptr(x), _ptr(history), _ptr(taps), _ptr(bias), _ptr(y), B, T, W, C, int(silu))
        ctx.save_for_backward(x, history, taps, bias)
        ctx.silu = silu
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        x, history, taps, bias = ctx.saved_tensors
        (B, T, C), W = x.shape, taps.shape[0]
        dy = dy.to(x.dtype).contiguous()
        dx = torch.empty_like(x)
        dhistory = None if history is None else torch.empty_like(history)
        rows = _constant("conv_rows")
        items = B * _tiles(T, "conv_rows")
        parts = x.new_empty(items, W + 1, C)
        fn = _kernel("conv_backward_all", x)
        tensors = (x, history, taps, bias, dy, dx, dhistory, parts)
        _run(fn, items, (rows + W - 1) * C, x, *(_ptr(t) for t in tensors), B, T, W, C, int(ctx.silu))
        summed = parts.sum(0)
        return dx, dhistory, summed[:W], None if bias is None else summed[W], None


def native_causal_conv(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, silu: bool = False
) -> Tensor:
    """The depthwise causal convolution by the native kernel, with its adjoint (autograd): y_t =
    bias + sum_j weight[:, 0, j] full_{t + j}, then SiLU if ``silu``, for x [B, T, C] continuing
    from history [B, W - 1, C] (the inputs before x, oldest first; None: zeros), weight [C, 1, W]
    (``nn.Conv1d(C, C, W, groups=C)``'s) and bias [C] or None -> [B, T, C], in x's dtype (float32 or
    float64), on the CPU. ``native_unavailable()`` must be None."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[:2] != (x.shape[2], 1):
        raise ValueError(
            f"native_causal_conv: expected x [B, T, C] and weight [C, 1, W], got {list(x.shape)}, {list(weight.shape)}"
        )
    (B, _, C), W = x.shape, weight.shape[2]
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"native_causal_conv: expected bias [C] = [{C}], got {list(bias.shape)}")
    if history is not None and history.shape != (B, W - 1, C):
        raise ValueError(
            f"native_causal_conv: expected history [B, W - 1, C] = [{B}, {W - 1}, {C}], got {list(history.shape)}"
        )
    return _CausalConv.apply(x, history, weight[:, 0].t(), bias, bool(silu))


# Gated RMSNorms (Mamba-2's; C source _native/rmsnorm.h): work items are tiles of rows.


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z, weight, group: int, eps: float, gate_first: bool):
        C = y.shape[-1]
        R = y.numel() // max(1, C)
        y, z, weight = (t.to(y.dtype).contiguous() for t in (y, z, weight))
        out = torch.empty_like(y)
        items = _tiles(R, "rmsnorm_rows")
        fn = _kernel("rmsnorm_forward_all", y)
        _run(fn, items, 1, y, _ptr(y), _ptr(z), _ptr(weight), _ptr(out), R, C, group, int(gate_first), eps)
        ctx.save_for_backward(y, z, weight)
        ctx.args = (R, C, group, int(gate_first), eps)
        return out

    @staticmethod
    @first_order
    def backward(ctx, dout: Tensor):
        y, z, weight = ctx.saved_tensors
        R, C, group, gate_first, eps = ctx.args
        dout = dout.to(y.dtype).contiguous()
        dy, dz = torch.empty_like(y), torch.empty_like(z)
        items = _tiles(R, "rmsnorm_rows")
        parts = y.new_empty(items, C)
        fn = _kernel("rmsnorm_backward_all", y)
        tensors = (y, z, weight, dout, dy, dz, parts)
        _run(fn, items, 1, y, *(_ptr(t) for t in tensors), R, C, group, gate_first, eps)
        return dy, dz, parts.sum(0), None, None, None


def native_gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, group: int, eps: float, gate_first: bool) -> Tensor:
    """A gated RMSNorm by the native kernel, with its adjoint (autograd), over groups of ``group``
    channels of y and z [..., C]: with ``gate_first`` (Mamba-2's) a = y * silu(z), a / rms(a) *
    weight; else (fla's FusedRMSNormGated) y / rms(y) * weight * silu(z); rms the root mean square
    over the group plus eps, weight [C]; in y's dtype (float32 or float64), on the CPU.
    ``native_unavailable()`` must be None."""
    C = y.shape[-1] if y.dim() else 0
    if y.dim() < 1 or z.shape != y.shape or weight.shape != (C,) or group < 1 or C % group:
        raise ValueError(
            f"native_gated_rms_norm: expected y and z [..., C] and weight [C] with C a multiple of group, got "
            f"{list(y.shape)}, {list(z.shape)}, {list(weight.shape)}, group {group}"
        )
    return _GatedRMSNorm.apply(y, z, weight, int(group), float(eps), bool(gate_first))


# SwiGLU's gate (lcsm/models/blocks.py's GLU; C source _native/glu.h): work items are tiles of the
# flattened elements.


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        a, b = a.contiguous(), b.to(a.dtype).contiguous()
        y = torch.empty_like(a)
        tensors = (a, b, None, y, None)
        _run(_kernel("glu_all", a), _tiles(a.numel(), "glu_elements"), 1, a, *(_ptr(t) for t in tensors), a.numel())
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    @first_order
    def backward(ctx, dy: Tensor):
        a, b = ctx.saved_tensors
        dy = dy.to(a.dtype).contiguous()
        da, db = torch.empty_like(a), torch.empty_like(b)
        tensors = (a, b, dy, da, db)
        _run(_kernel("glu_all", a), _tiles(a.numel(), "glu_elements"), 1, a, *(_ptr(t) for t in tensors), a.numel())
        return da, db


def native_silu_mul(a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b (SwiGLU's gate) by the native kernel, one pass each way, with its adjoint
    (autograd), for a and b of one shape, in a's dtype (float32 or float64), on the CPU.
    ``native_unavailable()`` must be None."""
    if a.shape != b.shape:
        raise ValueError(f"native_silu_mul: expected a and b of one shape, got {list(a.shape)}, {list(b.shape)}")
    return _SiluMul.apply(a, b)
