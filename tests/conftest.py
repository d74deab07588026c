"""Session setup shared by the whole suite.

Triton reads TRITON_INTERPRET when it is first imported and when each kernel is decorated: its
own library functions (``tl.sum`` and the like) and every ``@triton.jit`` kernel become either
interpreter functions or compiled ones, once per process, and the two cannot be mixed. Where no
CUDA device is visible nothing can be compiled, so the interpreter is turned on here, before any
test module imports triton (fla imports it too); the Triton kernels' tests
(tests/ops/test_triton_chunk.py) then run on the CPU, their ``tl.dot`` computed as on the device
(``_emulate_device_dots``). With a CUDA device, or where the variable is already set, it is left
as it is.

Tests that run the torch.compile branches eagerly patch ``torch.compiler.is_compiling`` to return
True, and those branches call ``torch.cond``, which traces with dynamo even in eager mode. Dynamo
reads its table of tracing-state functions (``tracing_state_functions``, cached on first use) from
``torch.compiler`` itself: built inside a patch, it would hold the patch and treat the real
``is_compiling`` as an unknown op in every later compile of the process. It is built here first.
"""

import importlib
import os

import pytest

from lcsm._cache import cache_root

# One intra-op thread per test process (and per process a test starts), unless the caller chose:
# the tests' problems are tiny, and torch's default of one thread per core made the two xdist
# workers on two cores run four spinning OpenMP threads (the whole suite about 2x slower, the
# packed-sequence tests 4x).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The native kernels are built once, where the caller's environment keeps them, and shared by
# every test and every process a test starts: tests give each run its own LCSM_CACHE (task data),
# which would otherwise rebuild the kernels there, about 8 s of compiler time each (a
# quarter of the suite's time). The build tests set their own directory.
os.environ.setdefault("LCSM_NATIVE_DIR", str(cache_root() / "native"))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _emulate_device_dots() -> None:
    """Make Triton's interpreter compute ``tl.dot`` as an NVIDIA GPU does for lcsm's kernels: it
    computes every product in float32 whatever ``input_precision`` asks, and (3.9) multiplies
    bfloat16 operands' raw bits. Here bfloat16 operands are multiplied as their values (exact
    products, float32 sums, as the tensor cores do), and float32 ones under ``tf32x3`` are split as
    the compiled kernel splits them: high = x rounded to TF32 (to nearest, ties away), low = x - high
    truncated to TF32 by the tensor core, high @ high + (high @ low + low @ high); under ``tf32``
    both truncated to TF32 (so that a kernel asking for it fails the float32 tolerances, as on the
    device). Other products are the interpreter's own. Marks the method (``emulates_device``) for tests that need it."""
    try:
        import numpy as np
        import triton.language as tl
        from triton._C.libtriton import ir
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None or getattr(original, "emulates_device", False):
        return
    mask = np.uint32(0xFFFFE000)

    def tf32_nearest(x):
        return ((x.view(np.uint32) + np.uint32(0x1000)) & mask).view(np.float32)

    def tf32_truncated(x):
        return (x.view(np.uint32) & mask).view(np.float32)

    def bfloat16_values(x):
        return (x.astype(np.uint32) << 16).view(np.float32)

    def create_dot(self, a, b, acc, input_precision, max_num_imprecise_acc):
        x, y = a.data, b.data
        if a.dtype.scalar == tl.bfloat16 and b.dtype.scalar == tl.bfloat16:
            out = bfloat16_values(x) @ bfloat16_values(y)
        elif x.dtype == y.dtype == np.float32 and input_precision == ir.INPUT_PRECISION.TF32x3:
            x_high, y_high = tf32_nearest(x), tf32_nearest(y)
            x_low, y_low = tf32_truncated(x - x_high), tf32_truncated(y - y_high)
            out = x_high @ y_high + (x_high @ y_low + x_low @ y_high)
        elif x.dtype == y.dtype == np.float32 and input_precision == ir.INPUT_PRECISION.TF32:
            out = tf32_truncated(x) @ tf32_truncated(y)  # the tensor core reads 19 of the 32 bits
        else:
            return original(self, a, b, acc, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle((out + acc.data).astype(acc.data.dtype), acc.dtype.scalar)

    create_dot.emulates_device = True
    builder.create_dot = create_dot


def _vectorised_scans() -> None:
    """Make the interpreter's ``tl.associative_scan`` with a combine function of its own (not a sum
    or a product; the selective scan's, lcsm/ops/triton_scan.py) combine whole slices along the
    scan's axis at once: it calls the function once per element in Python (a [16, 32, 8] block of
    pairs took ~0.2 s a scan). The same combines in the same order along the axis: the same numbers."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    scans = getattr(interpreter, "ScanOps", None)
    if scans is None or getattr(scans.generic_scan, "vectorised", False):
        return

    def generic_scan(self, input):
        data = [arg.handle.data for arg in input]
        out = [np.empty_like(d) for d in data]
        acc = None
        for j in range(data[0].shape[self.axis]):
            step = tuple(
                self.to_tensor(np.take(d, j, axis=self.axis), arg.dtype) for d, arg in zip(data, input, strict=True)
            )
            if acc is None:
                acc = step
            else:
                ret = self.combine_fn.fn(*acc, *step)
                acc = ret if isinstance(ret, tuple) else (ret,)
            for o, a in zip(out, acc, strict=True):
                at = (slice(None),) * self.axis + (j,)
                o[at] = np.asarray(a.handle.data).reshape(o[at].shape)
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input, strict=True)]

    generic_scan.vectorised = True
    scans.generic_scan = generic_scan


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _emulate_device_dots()
    _vectorised_scans()

# After the variable: importing dynamo imports triton.
import torch._dynamo.variables.torch  # noqa: E402

if hasattr(torch._dynamo.variables.torch, "tracing_state_functions"):
    torch._dynamo.variables.torch.tracing_state_functions()


@pytest.fixture
def pytorch_chunk_form(monkeypatch):
    """eos's chunk mode in its PyTorch form, which a compiled graph traces off the CPU: on CPU
    tensors it would call the C kernel's custom ops instead (tests/ops/test_native_chunk.py)."""

    def off(p):
        return "off: the PyTorch chunk form under test"

    for module in ("lcsm.ops.chunk", "lcsm.ops.eos"):  # the module, not lcsm.ops's function eos
        monkeypatch.setattr(importlib.import_module(module), "native_chunk_unsupported", off)
