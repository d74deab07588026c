"""Test helpers: the one tolerance helper every test of lcsm uses (relative RMS error per named
tensor), gradients under shared random cotangents, token-by-token decoding of a mixer, which
the tests hold to its forward pass, and the mixer cases the registry's contract tests run.

    rel_rms(a, ref) = ||a - ref||_2 / max(||ref||_2, tiny)

compared against a tolerance that depends only on the dtype. Tests never loosen these per case;
a fast path that needs a looser bound is a bug in the fast path (or the test's problem is badly
conditioned and should be rescaled, not the tolerance).
"""

from __future__ import annotations

import torch

# float64 checks are "tight": algebraically equal forms agree to ~1e-12 relative RMS.
RTOL = {
    torch.float64: 1e-9,
    torch.complex128: 1e-9,
    torch.float32: 2e-4,
    torch.complex64: 2e-4,
    torch.bfloat16: 2e-2,
    torch.float16: 5e-3,
}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error of ``actual`` against ``expected`` (both cast to the wider dtype)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape mismatch: {tuple(actual.shape)} vs expected {tuple(expected.shape)}")
    a = actual.detach().to(torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64)
    b = expected.detach().to(a.dtype)
    if not torch.isfinite(torch.view_as_real(a) if a.is_complex() else a).all():
        return float("inf")
    denom = b.abs().pow(2).sum().sqrt().item()
    num = (a - b).abs().pow(2).sum().sqrt().item()
    if denom == 0.0:
        return num
    return num / denom


def tolerance(dtype: torch.dtype) -> float:
    return RTOL[dtype]


def assert_close(
    actual: dict[str, torch.Tensor | None],
    expected: dict[str, torch.Tensor | None],
    dtype: torch.dtype | None = None,
    context: str = "",
) -> dict[str, float]:
    """Compare dicts of named tensors; fail with the relative RMS error of every name.

    ``dtype`` selects the tolerance (default: the dtype of the first expected tensor).
    Entries that are None in both dicts are skipped; None in only one is a failure.
    """
    errors: dict[str, float] = {}
    missing = []
    for name, ref in expected.items():
        got = actual.get(name)
        if ref is None and got is None:
            continue
        if ref is None or got is None:
            missing.append(name)
            continue
        if dtype is None:
            dtype = ref.dtype
        errors[name] = rel_rms(got, ref)
    tol = tolerance(dtype)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    if bad or missing:
        lines = [f"{n}: rel RMS {e:.3e}{'  <-- exceeds' if n in bad else ''}" for n, e in errors.items()]
        lines += [f"{n}: missing on one side" for n in missing]
        raise AssertionError(f"{context} (tolerance {tol:.1e} for {dtype})\n  " + "\n  ".join(lines))
    return errors


def gradients(outputs: dict[str, torch.Tensor], wrt: dict[str, torch.Tensor], seed: int = 2) -> dict[str, torch.Tensor]:
    """``outputs`` and the gradients of sum_k <outputs[k], c_k> with respect to every tensor of
    ``wrt`` (named "d" + its key; None where an input does not reach the outputs), one dict for
    ``assert_close``. The cotangents c_k are random, drawn from ``seed`` in the order of the
    outputs (complex where the output is), so two calls with outputs of the same shapes share them."""
    gen = torch.Generator().manual_seed(seed)

    def cotangent(y: torch.Tensor) -> torch.Tensor:
        def draw():
            return torch.randn(y.shape, generator=gen, dtype=torch.float64)

        return (torch.complex(draw(), draw()) if y.is_complex() else draw()).to(device=y.device, dtype=y.dtype)

    names = list(outputs)
    grads = torch.autograd.grad(
        [outputs[n] for n in names], list(wrt.values()), [cotangent(outputs[n]) for n in names], allow_unused=True
    )
    return {**outputs, **{f"d{k}": g for k, g in zip(wrt, grads, strict=False)}}


def assert_op_matches(
    op, reference, inputs: dict[str, torch.Tensor], dtype: torch.dtype, context: str = "", leave_out=(), **options
) -> dict[str, float]:
    """``op(**inputs, **options)`` with its inputs in ``dtype`` against ``reference`` on the same
    keyword arguments in float64: the output and the gradient of every input under random
    cotangents (``gradients``), judged at ``dtype``'s tolerance. ``leave_out`` names gradients
    (e.g. "dfloor") not compared, where the test says why."""

    def run(fn, dt: torch.dtype) -> dict[str, torch.Tensor]:
        leaves = {k: v.to(dt).requires_grad_() for k, v in inputs.items()}
        got = gradients({"out": fn(**leaves, **options)}, leaves)
        return {k: v for k, v in got.items() if k not in leave_out}

    return assert_close(run(op, dtype), run(reference, torch.float64), dtype=dtype, context=context)


def assert_matches_reference(module, x: torch.Tensor, reference, context: str = "", forward=None) -> dict[str, float]:
    """``forward(x)`` (default ``module(x)``) against ``reference(x)``, a written-out form computed
    from the module's own parameters: the outputs (a tensor, or a dict of named tensors), and the
    gradients of the input and of every trainable parameter of ``module`` under random
    cotangents, so that a detached or misrouted input shows even where the outputs agree."""
    x = x.detach().requires_grad_()
    wrt = {"x": x, **{n: p for n, p in module.named_parameters() if p.requires_grad}}

    def named(out):
        return out if isinstance(out, dict) else {"y": out}

    return assert_close(
        gradients(named((forward or module)(x)), wrt), gradients(named(reference(x)), wrt), context=context
    )


def decode(mixer, x: torch.Tensor):
    """``mixer.step`` token by token over x [B, T, d_model] from ``mixer.init_state``: the outputs
    stacked [B, T, d_model] and the final state."""
    state, ys = mixer.init_state(x.shape[0]), []
    for x_t in x.unbind(1):
        y_t, state = mixer.step(x_t, state)
        ys.append(y_t)
    return torch.stack(ys, 1), state


def mixer_cases() -> list[tuple[str, dict]]:
    """(name, options) of every registered mixer with its defaults, then with each option set it
    declares to build another structure (``Mixer.option_variants``): the cases of the registry's
    contract tests."""
    from lcsm import layers

    names = layers.available()
    return [(name, {}) for name in names] + [
        (name, dict(options)) for name in names for options in layers.resolve(name)[0].option_variants
    ]


def case_id(case: tuple[str, dict]) -> str:
    """A mixer case's test id: ``name`` or ``name,option=value,...``."""
    name, options = case
    return ",".join([name, *(f"{k}={v}" for k, v in options.items())])
