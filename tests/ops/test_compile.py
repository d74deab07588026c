"""``torch.compile(fullgraph=True, dynamic=True)`` of the EOS chunk kernel: the compiled function
equals eager (outputs, final states, every gradient under random cotangents) for four sequence
lengths through one compiled graph (a recompile fails the test), over decays that take each of
the kernel's exact forms (moderate, too strong for one reference per chunk, with resets).

Backends: ``aot_eager`` traces exactly what inductor compiles (forward and the custom backward,
torch.cond and scan included) without generating code, which takes minutes per decay kind on a
busy CPU; inductor itself runs on the no-decay and the row-decay kernels (docs/compile.md).
"""

import math

import pytest
import torch
import torch._dynamo
from torch.nn.functional import logsigmoid

from lcsm.ops import eos
from lcsm.ops._inputs import constant_result
from lcsm.testing import assert_close, gradients

# the traced PyTorch chunk form (what a compiled graph runs off the CPU), not the C kernel's ops
pytestmark = pytest.mark.usefixtures("pytorch_chunk_form")

B, H, K, D, C = 1, 2, 4, 3, 8
# (T, strength, resets): 1, 3, 4, 3 and 1 chunks, no T a multiple of C; the first shorter than a
# chunk (traced first: the graph must not hold only for one chunk), the third too strong for one
# reference per chunk, the fourth with decays of exactly 0 inside chunks, the last T = 2 (no
# [T - 1] slice whose size the graph would guard)
PROBLEMS = ((5, 1.0, ()), (19, 1.0, ()), (29, 30.0, ()), (23, 1.0, (5, 12, 20)), (2, 1.0, ()))
TAILS = {"none": None, "scalar": (1, 1), "row": (K, 1), "col": (1, D), "full": (K, D)}


def inputs(
    T: int, decay: str, strength: float, resets: tuple[int, ...], seed: int, B: int = B
) -> dict[str, torch.Tensor | None]:
    """float32 EOS inputs with vector e and s; ``strength`` scales the log decay (x 30: spans
    beyond SAFE_SPAN within a chunk, the sub-chunk form); ``resets``: steps whose decay is exactly
    0 (log -inf)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    log_o = None
    if TAILS[decay] is not None:
        log_o = strength * logsigmoid(rnd(B, T, H, *TAILS[decay]) + 1.0)
        log_o[:, list(resets)] = -math.inf
    return {
        "i": rnd(B, T, H, D),
        "e": rnd(B, T, H, K) / math.sqrt(K),
        "s": rnd(B, T, H, K) / math.sqrt(K),
        "log_o": log_o,
        "initial_state": rnd(B, H, K, D),
    }


def run(x: dict[str, torch.Tensor | None], fn) -> dict[str, torch.Tensor]:
    x = {k: None if v is None else v.clone().requires_grad_() for k, v in x.items()}
    y, m = fn(x["i"], x["e"], x["s"], x["log_o"], x["initial_state"])
    return gradients({"y": y, "m_T": m}, {k: v for k, v in x.items() if v is not None})


def chunk(i, e, s, log_o, initial_state):
    return eos(i, e, s, log_o, mode="chunk", initial_state=initial_state, output_final_state=True, chunk_size=C)


def chained(i, e, s, log_o, initial_state):
    """Two kernels in one graph, the second from the first's output and final state, as two layers
    of a model are; a rotating (complex) decay read out as its real part, as the diagonal SSMs read
    theirs."""

    def kernel(x, m):
        return eos(
            x, e, s, log_o, mode="chunk", initial_state=m, output_final_state=True, chunk_size=C, real_output=True
        )

    y, m = kernel(i, initial_state)
    return kernel(y, m)


# (decay, backend): inductor where its compile time is moderate on a CPU, aot_eager elsewhere. Each
# takes 30-70 s on 2 busy cores and is marked slow (`pytest -m slow`); the suite traces the row
# decay twice in one graph instead (test_two_kernels_in_one_graph_with_batch_equal_to_heads).
SLOW = pytest.mark.slow
CASES = [
    pytest.param("none", "inductor", marks=SLOW),
    pytest.param("scalar", "aot_eager", marks=SLOW),
    pytest.param("row", "aot_eager", marks=SLOW),
    # inductor's code for the row decay (GLA's), torch.cond's branches and the scan: about 6 min
    # on 2 busy cores
    pytest.param("row", "inductor", marks=SLOW),
    pytest.param("col", "aot_eager", marks=SLOW),
    # a full K x D decay: the elementwise kernel, traced in its doubling form (chunk_scan.traced_elementwise)
    pytest.param("full", "aot_eager", marks=SLOW),
]


@pytest.mark.parametrize("decay,backend", CASES)
def test_chunk_compiles_equal_to_eager(decay, backend):
    """One graph for every length and each of the kernel's forms (``PROBLEMS``), which eager
    picks by reading the decay's values and the traced kernel selects among by torch.cond."""
    torch._dynamo.reset()
    compiled = torch.compile(chunk, fullgraph=True, dynamic=True, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, (T, strength, resets) in enumerate(PROBLEMS):
            x = inputs(T, decay, strength, resets, seed)
            assert_close(run(x, compiled), run(x, chunk), context=f"decay={decay} backend={backend} T={T}")


def test_two_kernels_in_one_graph_with_batch_equal_to_heads():
    """A graph of two decayed kernels (two layers of a model) with B = H. Regressions: the second
    kernel read the floor of its log decays (LOG_ZERO) through the first kernel's subgraph, which
    dynamo refused ("lift_tracked_freevar_to_input"); with B = H the tracer gave both sizes one
    symbol and torch.cond could not prove its branches' strides dense (row and column decays); a
    rotation read 2 pi as the first did LOG_ZERO. Backend aot_eager, a row decay with a rotation,
    moderate, too strong for one reference per chunk and with resets: torch.cond, the scan and the
    reset masks traced."""
    torch._dynamo.reset()
    compiled = torch.compile(chained, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, (T, strength, resets) in enumerate(PROBLEMS[1:4]):
            x = inputs(T, "row", strength, resets, seed, B=H)
            angle = torch.rand(x["log_o"].shape, generator=torch.Generator().manual_seed(seed))
            x["log_o"] = torch.complex(x["log_o"], angle)
            assert_close(run(x, compiled), run(x, chained), context=f"two kernels, B = H = {H}, T={T}")


# eos_dplr's chunk form (and eos_delta's, on which the routed cases run): 1, 3, 2 (a multiple of
# C) and 6 chunks, then T = 2 after the others; the first shorter than a chunk
DPLR_LENGTHS = (5, 19, 16, 45, 2)
# case: (the kernel it takes, the log decay's shape after [B, T, H], micro-steps per token, a is e)
DPLR_CASES = {
    "row": ("eos_dplr's WY / UT form", (K,), 1, True),
    "scalar": ("eos_delta's kernel (routed)", (), 1, True),
    "product": ("eos_dplr's WY / UT form, micro-steps", (), 2, False),
    "eos_delta": ("eos_delta itself", (), 1, True),
}


def dplr_inputs(T: int, case: str, seed: int) -> dict[str, torch.Tensor]:
    """float32 delta-rule inputs, DeltaNet's conditioning (normalised keys, beta in (0, 1), decays
    near 1), so that long products of transitions stay bounded."""
    _, tail, n, shared = DPLR_CASES[case]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    micro = (n,) if n > 1 else ()
    k = torch.nn.functional.normalize(rnd(B, T, H, *micro, K), dim=-1)
    beta = torch.sigmoid(rnd(B, T, H, *micro, 1))
    x = {
        "i": rnd(B, T, H, *micro, D),
        "e": beta * k if shared else rnd(B, T, H, *micro, K) / math.sqrt(K),
        "s": rnd(B, T, H, K) / math.sqrt(K),
        "b": k,
        "log_alpha": logsigmoid(rnd(B, T, H, *tail) + 2.0),
        "initial_state": rnd(B, H, K, D),
    }
    if not shared:
        x["a"] = beta * k
    return x


def dplr_chunk(i, e, s, b, log_alpha, initial_state, a=None):
    """eos_dplr's chunk form; a None: a is e (DeltaNet's shared beta k, the kernels' a_is_e)."""
    from lcsm.ops import eos_dplr

    a = e if a is None else a
    return eos_dplr(
        i, e, s, a, b, log_alpha, mode="chunk", chunk_size=C, initial_state=initial_state, output_final_state=True
    )


def delta_chunk(i, e, s, b, log_alpha, initial_state):
    from lcsm.ops import eos_delta

    return eos_delta(
        i, e, s, e, b, log_alpha, mode="chunk", chunk_size=C, initial_state=initial_state, output_final_state=True
    )


# aot_eager 30-60 s each on 2 busy cores; inductor's code for the WY form with a row decay (KDA's,
# RWKV-7's) about 5 min, for eos_delta's kernel with a scalar one (Gated DeltaNet's) about 3 min
INDUCTOR_DPLR = [("row", "inductor"), ("scalar", "inductor")]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "backend"), [*((case, "aot_eager") for case in DPLR_CASES), *INDUCTOR_DPLR])
def test_dplr_chunk_compiles_equal_to_eager(case, backend):
    """One graph for every length (``DPLR_LENGTHS``): traced, the chunk forms keep the chunk length,
    pad one all-padding chunk more and carry the memory across chunks by a doubling scan
    (``delta._doubling_carry``) instead of a loop whose trip count would fix T; eos_dplr's
    recomputing backward is not traced (autograd differentiates the chunk form)."""
    fn = delta_chunk if case == "eos_delta" else dplr_chunk
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)

    def grads(f, x):
        leaves = {name: v.clone().requires_grad_() for name, v in x.items()}
        y, m = f(**leaves)
        return gradients({"y": y, "m_T": m}, leaves)

    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, T in enumerate(DPLR_LENGTHS):
            x = dplr_inputs(T, case, seed)
            assert_close(grads(compiled, x), grads(fn, x), context=f"{case} ({DPLR_CASES[case][0]}) T={T}")


def test_constant_result_marks_as_dynamo_does():
    """``_inputs.constant_result`` sets the attribute that ``torch.compiler.assume_constant_result``
    sets, without importing dynamo at import time: a torch that marks constants otherwise fails here
    (and the two-kernel graph above with it)."""

    def f():
        return 1.0

    def g():
        return 1.0

    assert vars(constant_result(f)) == vars(torch.compiler.assume_constant_result(g)) != {}
