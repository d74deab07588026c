"""Session setup shared by the whole suite.

Triton reads TRITON_INTERPRET when it is first imported and when each kernel is decorated: its
own library functions (``tl.sum`` and the like) and every ``@triton.jit`` kernel become either
interpreter functions or compiled ones, once per process, and the two cannot be mixed. Where no
CUDA device is visible nothing can be compiled, so the interpreter is turned on here, before any
test module imports triton (fla imports it too); the Triton kernels' tests
(tests/ops/test_triton_chunk.py) then run on the CPU. With a CUDA device, or where the variable
is already set, it is left as it is.

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
