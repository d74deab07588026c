"""Mixers under ``torch.compile(fullgraph=True, dynamic=True)``: output and every gradient (input
and parameters) equal eager for three sequence lengths (four for the matrix-transition mixers)
through one compiled graph (a recompile fails the test). Backend aot_eager: the graphs inductor
would compile, forward and backward, without its code generation (minutes per mixer on a busy
CPU; docs/compile.md)."""

import pytest
import torch
import torch._dynamo

from lcsm import layers
from lcsm.testing import assert_close, gradients

# the traced PyTorch chunk form (what a compiled graph runs off the CPU), not the C kernel's ops
pytestmark = pytest.mark.usefixtures("pytorch_chunk_form")

D_MODEL = 16
# the last T = 2, even after odd lengths: no [T - 1] slice (a token shift's, a real FFT's backward)
# whose size the graph would guard, no parity guard (S4's odd kernel size)
LENGTHS = (19, 29, 2)


# Compiling since issue 68's fixes: a column decay with a symbolic batch (hgrn, mingru, minlstm,
# rg_lru, rwkv4), the FFT form (lru, s5, tnn), S4's kernel, the elementwise kernel (lcsm, mamba,
# longhorn: a full K x D decay)
NEWLY = ["hgrn", "mingru", "minlstm", "rg_lru", "rwkv4", "lru", "s5", "tnn", "s4", "lcsm", "mamba", "longhorn"]
# The matrix-transition mixers on eos_dplr's chunk forms (traced with a doubling scan over chunks),
# and dur (a separable decay, whose shape check had fixed B and T): one length more, past two of the
# routed kernel's 64-step chunks
DPLR = ["comba", "gated_deltanet", "gated_deltaproduct", "gdn2", "kda", "rwkv7", "dur"]
DPLR_LENGTHS = (19, 29, 150, 2)


@pytest.mark.slow  # about 45 s per mixer on 2 busy cores
@pytest.mark.parametrize("name", ["gla", "mamba2", "mlstm", "metala", "fwp", "attention", "ces", "s4d", *NEWLY, *DPLR])
def test_mixer_compiles_equal_to_eager(name):
    compiles_equal_to_eager(name, DPLR_LENGTHS if name in DPLR else LENGTHS, "aot_eager")


@pytest.mark.slow
def test_s4_with_an_even_l_max_compiles_equal_to_eager():
    """S4's official parametrization at an even l_max: the kernel's length is l_max, a plain integer
    in the graph, and its z = -1 root takes the limit there as in eager (it was evaluated as a
    rounded -1, 3e-3 off in the gradients). T = l_max, the whole kernel, is a second graph
    (docs/compile.md): the lengths stay below it."""
    compiles_equal_to_eager("s4", (19, 12, 7), "aot_eager", l_max=20)


def compiles_equal_to_eager(name, lengths, backend, **options):
    """The mixer compiled whole with a symbolic T equals eager at each length, with no recompile."""
    torch.manual_seed(0)
    mixer = layers.build(name, D_MODEL, **options)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, dynamic=True, backend=backend)
    params = dict(mixer.named_parameters())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in lengths:
            x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(T)).requires_grad_()
            wrt = {"x": x, **params}
            assert_close(gradients({"y": compiled(x)}, wrt), gradients({"y": mixer(x)}, wrt), context=f"{name} T={T}")


@pytest.mark.slow  # about 20 minutes on 2 busy cores (inductor's code generation)
def test_gla_compiles_with_inductor():
    """The gla mixer through inductor (it had failed on a torch.cond whose branch outputs' strides
    differed, with the batch symbolic): one graph for every length, equal to eager."""
    compiles_equal_to_eager("gla", LENGTHS, "inductor")


# the mixers whose traced branches this changes reach: eos_dplr's and eos_delta's chunk
# forms, the token shift, the FFT form at 2T + 2, S4's kernel size and FFT length
TRACED_BRANCHES = ["gated_deltanet", "kda", "gated_deltaproduct", "comba", "gdn2", "rwkv7", "rwkv4"]
TRACED_BRANCHES += ["s4", "s4d", "lru", "tnn", "ces"]


@pytest.mark.parametrize("name", TRACED_BRANCHES)
def test_traced_branches_run_eagerly(name, monkeypatch):
    """The branches taken under torch.compile (``torch.compiler.is_compiling()``), run eagerly in
    float64, equal the eager forms (output, input and parameter gradients) at an even and an odd
    length and at T = 2: the exactness the compiled tests check in float32, to float64 rounding."""
    torch.manual_seed(0)
    mixer = layers.build(name, D_MODEL).double()
    params = dict(mixer.named_parameters())
    for T in (2, 19, 20):
        x = torch.randn(2, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
        wrt = {"x": x.requires_grad_(), **params}
        expected = gradients({"y": mixer(x)}, wrt)
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            actual = gradients({"y": mixer(x)}, wrt)
        assert_close(actual, expected, context=f"{name} T={T}")


@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("given", [False, True])
def test_token_shift_traced_branch(T, given, monkeypatch):
    """``packing.previous``'s branch for torch.compile (a cat, then a slice of T steps) run eagerly
    gives the eager shift, bit for bit (both only move values)."""
    from lcsm.layers.packing import previous

    g = torch.Generator().manual_seed(T)
    t = torch.randn(2, T, 3, generator=g)
    first = torch.randn(2, 3, generator=g) if given else None
    expected = previous(t, first, None)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(previous(t, first, None), expected)
