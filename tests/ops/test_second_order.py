"""Second-order gradients (a gradient differentiated again: Hessian-vector products, gradient
penalties): the plain-autograd modes give them, and every hand-written backward refuses them by
name instead of leaving their terms out."""

import importlib
import pkgutil

import pytest
import torch
from torch.nn.functional import logsigmoid

import lcsm
from lcsm.models import ModelConfig, build_model
from lcsm.ops import eos
from lcsm.testing import assert_close

# a differentiable function whose Hessian the backward passes must carry: rough, not to be trusted
# to the 1e-10 the modes agree to (central differences at h = 1e-5 are good to ~1e-9 here)
FD_TOLERANCE = 1e-6


def inputs(seed=0, B=1, T=13, H=2, K=4, D=3):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return rnd(B, T, H, D), rnd(B, T, H, K), rnd(B, T, H, K), logsigmoid(rnd(B, T, H, K, 1))


def hessian_vector(f, x, v):
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(f(x), x, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), x)
    return hv


def finite_difference(f, x, v, h=1e-5):
    def grad(at):
        at = at.detach().requires_grad_()
        return torch.autograd.grad(f(at), at)[0]

    return (grad(x + h * v) - grad(x - h * v)) / (2 * h)


def objective(mode, e, s, log_o):
    def f(i):
        y, m = eos(i.tanh(), e, s, log_o, mode=mode, output_final_state=True)
        return (y**2).sum() + (m**3).sum()

    return f


@pytest.mark.parametrize("mode", ["recurrent", "parallel"])
def test_hessian_vector_products_of_the_autograd_modes_match_finite_differences(mode):
    x, e, s, log_o = inputs()
    v = torch.randn_like(x)
    f = objective(mode, e, s, log_o)
    hv, fd = hessian_vector(f, x, v), finite_difference(f, x, v)
    assert ((hv - fd).norm() / fd.norm()).item() < FD_TOLERANCE
    # and the two modes agree far below that
    assert_close({"hv": hv}, {"hv": hessian_vector(objective("recurrent", e, s, log_o), x, v)}, torch.float64)


@pytest.mark.parametrize("mode", ["chunk", "auto"])
def test_a_hand_written_backward_refuses_to_be_differentiated(mode):
    x, e, s, log_o = inputs()

    def f(i):
        return (eos(i.tanh(), e, s, log_o, mode=mode, chunk_size=4)[0] ** 2).sum()

    with pytest.raises(RuntimeError, match="second-order gradients .* not supported"):
        hessian_vector(f, x, torch.randn_like(x))


def test_a_model_refuses_a_hessian_vector_product_rather_than_miss_terms():
    # (the default channel mixer's SwiGLU and the chunk form: a 1.2 relative error before)
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="linear_attention", d_model=16, n_layers=1, vocab_size=11), verbose=False)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    block = model.double().backbone.blocks[0]
    with pytest.raises(RuntimeError, match="second-order gradients"):
        hessian_vector(lambda u: (block(u) ** 2).sum(), x, torch.randn_like(x))


def _functions(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _functions(sub)


def test_every_hand_written_backward_is_marked_first_order():
    for module in pkgutil.walk_packages(lcsm.__path__, "lcsm."):
        if module.name.startswith(("lcsm.ops", "lcsm.layers")):
            importlib.import_module(module.name)
    functions = [f for f in _functions(torch.autograd.Function) if f.__module__.startswith("lcsm.")]
    # RG-LRU's bounded square root: its backward is plain autograd on its saved input
    differentiable = {"lcsm.layers.rg_lru._BoundedSqrt"}
    unmarked = [
        name
        for f in functions
        if (name := f"{f.__module__}.{f.__qualname__}") not in differentiable
        and not getattr(f.backward, "first_order", False)
    ]
    assert len(functions) >= 20 and not unmarked
