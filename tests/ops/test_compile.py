"""``torch.compile(fullgraph=True, dynamic=True)`` of the EOS chunk kernel: the compiled function
equals eager (outputs, final states, every gradient under random cotangents) for four sequence
lengths through one compiled graph (a recompile fails the test), over decays that take each of
the kernel's exact forms (moderate, too strong for one reference per chunk, with resets).

Backends: ``aot_eager`` traces exactly what inductor compiles (forward and the custom backward,
torch.cond and scan included) without generating code, which takes minutes per decay kind on a
busy CPU; inductor itself runs on the no-decay kernel (docs/compile.md).
"""

import math

import pytest
import torch
import torch._dynamo
from torch.nn.functional import logsigmoid

from lcsm.ops import eos
from lcsm.testing import assert_close, gradients

B, H, K, D, C = 1, 2, 4, 3, 8
# (T, strength, resets): 1, 3, 4 and 3 chunks, no T a multiple of C; the first shorter than a chunk
# (traced first: the graph must not hold only for one chunk), the third too strong for one
# reference per chunk, the fourth with decays of exactly 0 inside chunks
PROBLEMS = ((5, 1.0, ()), (19, 1.0, ()), (29, 30.0, ()), (23, 1.0, (5, 12, 20)))
TAILS = {"none": None, "scalar": (1, 1), "row": (K, 1), "col": (1, D), "full": (K, D)}


def inputs(T: int, decay: str, strength: float, resets: tuple[int, ...], seed: int) -> dict[str, torch.Tensor | None]:
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


# (decay, backend): inductor where its compile time is moderate on a CPU, aot_eager elsewhere. The
# suite runs the scalar case (torch.cond, the scan and the reset masks all traced); the others take
# 30-70 s each on 2 busy cores and are marked slow (`pytest -m slow`).
SLOW = pytest.mark.slow
CASES = [
    pytest.param("none", "inductor", marks=SLOW),
    ("scalar", "aot_eager"),
    pytest.param("row", "aot_eager", marks=SLOW),
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


@pytest.mark.slow  # about 40 s on 2 busy cores
@pytest.mark.parametrize("log_alpha", ["row", "scalar"])
def test_dplr_chunk_compiles_per_length_equal_to_eager(log_alpha):
    """eos_dplr's chunk form traced whole (its recomputing backward calls autograd inside a
    backward, so a traced graph is differentiated by autograd instead; the scalar case takes the
    routed delta kernel) equals eager at a fixed length: its loop over chunks fixes T, one graph
    per length (docs/compile.md)."""
    from lcsm.ops import eos_dplr

    T = 19
    g = torch.Generator().manual_seed(7)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, 1, generator=g))
    tail = (K,) if log_alpha == "row" else ()
    x = {
        "i": torch.randn(B, T, H, D, generator=g),
        "e": beta * k,
        "s": torch.randn(B, T, H, K, generator=g) / math.sqrt(K),
        "b": k.clone(),
        "log_alpha": logsigmoid(torch.randn(B, T, H, *tail, generator=g) + 2.0),
        "initial_state": torch.randn(B, H, K, D, generator=g),
    }

    def fn(i, e, s, b, log_alpha, initial_state):
        return eos_dplr(
            i, e, s, e, b, log_alpha, mode="chunk", chunk_size=C, initial_state=initial_state, output_final_state=True
        )

    def grads(f):
        leaves = {name: v.clone().requires_grad_() for name, v in x.items()}
        y, m = f(**leaves)
        return gradients({"y": y, "m_T": m}, leaves)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    assert_close(grads(compiled), grads(fn), context=f"eos_dplr log_alpha={log_alpha}")
