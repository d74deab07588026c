"""Mixers under ``torch.compile(fullgraph=True, dynamic=True)``: output and every gradient (input
and parameters) equal eager for two sequence lengths (three for the matrix-transition mixers)
through one compiled graph (a recompile fails the test). Backend aot_eager: the graphs inductor
would compile, forward and backward, without its code generation (minutes per mixer on a busy
CPU; docs/compile.md)."""

import pytest
import torch
import torch._dynamo

from lcsm import layers
from lcsm.testing import assert_close, gradients

D_MODEL = 16
LENGTHS = (19, 29)


# Compiling since issue 68's fixes: a column decay with a symbolic batch (hgrn, mingru, minlstm,
# rg_lru, rwkv4), the FFT form (lru, s5, tnn), S4's kernel, the elementwise kernel (lcsm, mamba,
# longhorn: a full K x D decay)
NEWLY = ["hgrn", "mingru", "minlstm", "rg_lru", "rwkv4", "lru", "s5", "tnn", "s4", "lcsm", "mamba", "longhorn"]
# The matrix-transition mixers on eos_dplr's chunk forms (traced with a doubling scan over chunks),
# and dur (a separable decay, whose shape check had fixed B and T): a third length past two of the
# routed kernel's 64-step chunks
DPLR = ["comba", "gated_deltanet", "gated_deltaproduct", "gdn2", "kda", "rwkv7", "dur"]
DPLR_LENGTHS = (*LENGTHS, 150)


@pytest.mark.slow  # about 45 s per mixer on 2 busy cores
@pytest.mark.parametrize("name", ["gla", "mamba2", "fwp", "attention", "ces", "s4d", *NEWLY, *DPLR])
def test_mixer_compiles_equal_to_eager(name):
    torch.manual_seed(0)
    mixer = layers.build(name, D_MODEL)
    torch._dynamo.reset()
    compiled = torch.compile(mixer, fullgraph=True, dynamic=True, backend="aot_eager")
    params = dict(mixer.named_parameters())
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in DPLR_LENGTHS if name in DPLR else LENGTHS:
            x = torch.randn(2, T, D_MODEL, generator=torch.Generator().manual_seed(T)).requires_grad_()
            wrt = {"x": x, **params}
            assert_close(gradients({"y": compiled(x)}, wrt), gradients({"y": mixer(x)}, wrt), context=f"{name} T={T}")
