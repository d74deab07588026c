"""The native selective scan (``lcsm.ops.native_scan``, mode "native") against the recurrent
reference: outputs, final states and every gradient, in float64 and float32, odd lengths, chunk
lengths that do not divide them; the plan's choice and its refusals."""

import os
import shutil

import pytest
import test_packed as packed
import torch
from test_eos import B, D, H, K, check, make_inputs, run

from lcsm.ops import LogProduct, eos, explain
from lcsm.ops import native_scan as native
from lcsm.testing import assert_close

# Where a C compiler exists the kernel must build: a failed build would otherwise skip every test.
if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the native scan cannot be built here", allow_module_level=True)


def _args(inputs):
    return inputs["i"], inputs["e"], inputs["s"], inputs["log_o"]


def test_the_kernel_builds():
    assert native.library() is not None, native._state["why"]


# Mamba's product (a step times a time-invariant K x D matrix, in either order), a full K x D
# decay tensor, data-dependent or time-invariant
DECAYS = [("product", (True, False)), ("product", (False, True)), ("full", True), ("full", False)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("T,chunk_size", [(1, 16), (17, 16), (65, 7), (65, 64), (200, 1)])
@pytest.mark.parametrize("decay,dd", DECAYS)
def test_against_the_reference(decay, dd, T, chunk_size, initial, dtype):
    inputs = make_inputs(T, decay=decay, dd_decay=dd, initial=initial)
    assert explain(*_args(inputs)).mode == ("recurrent" if T == 1 else "native")
    check(inputs, "native", dtype, chunk_size=chunk_size, context=f"{decay} T={T} C={chunk_size} initial={initial}")


def test_the_plan_says_where_memories_are_kept():
    def kept(T):
        return explain(*_args(make_inputs(T, decay="full", dd_decay=True)), chunk_size=16).reason

    assert "memory kept every 16 steps" in kept(17) and "memory kept at the start only" in kept(16)


def test_without_the_final_state():
    """y alone: the backward takes no final-state cotangent (None: the kernel reads none) and no
    gradient for the kept memories, and gives the reference's gradients."""
    x = make_inputs(37, decay="product", dd_decay=(True, False), initial=True, seed=3)
    leaves = {n: x[n].clone().requires_grad_() for n in ("i", "e", "s", "initial_state")}
    a, b = x["log_o"].a.clone().requires_grad_(), x["log_o"].b.clone().requires_grad_()
    grads = {}
    for mode in ("native", "recurrent"):
        m0 = leaves["initial_state"]
        y, _ = eos(leaves["i"], leaves["e"], leaves["s"], LogProduct(a, b), mode=mode, initial_state=m0)
        cot = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=y.dtype)
        grads[mode] = dict(zip([*leaves, "a", "b"], torch.autograd.grad(y, [*leaves.values(), a, b], cot), strict=True))
    assert_close(grads["native"], grads["recurrent"], torch.float64)
    # the kept memories are no differentiable output: autograd forms no zero gradient for them
    operands = (leaves["i"].transpose(1, 2), *(leaves[n].transpose(1, 2) for n in ("e", "s")))
    kept = native.native_scan(*operands, a.transpose(1, 2), b, None, None, 16)[2]
    assert kept.numel() > 0 and not kept.requires_grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("e,s", [("vec", "dd"), ("dd", "vec"), ("vec", "vec")])
def test_data_independent_expand_and_shrink(e, s, dtype):
    """Time-shared e or s: the kernel reads them with a zero time stride; their gradients sum over steps."""
    check(make_inputs(33, e=e, s=s, decay="product", dd_decay=(True, False)), "native", dtype, context=f"e={e} s={s}")


def test_operands_in_either_order():
    """LogProduct(b, a): the product commutes, and the kernel takes its time-invariant K x D operand as b."""
    inputs = make_inputs(29, decay="product", dd_decay=(True, False))
    swapped = dict(inputs, log_o=LogProduct(inputs["log_o"].b, inputs["log_o"].a))
    assert explain(swapped["i"], swapped["e"], swapped["s"], swapped["log_o"]).mode == "native"
    check(swapped, "native", torch.float64, context="swapped operands")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decays_below_the_smallest_normal_number(dtype):
    """log o down to about -400: float32's decays below exp(-87) are 0 in the kernel (subnormal in
    libm's exp) and float64's exact; both within the dtype's tolerance of the reference."""
    check(make_inputs(40, decay="product", dd_decay=(True, False), strength=100.0), "native", dtype, context="strong")


def test_threads_split_the_work_alike():
    """With two threads each takes its own (batch, head, column block) items: the same numbers as one."""
    inputs = make_inputs(50, decay="product", dd_decay=(True, False))
    inputs["i"] = torch.randn(B, 50, H, 2 * native.COLUMNS + D, dtype=torch.float64)  # 3 column blocks
    inputs["log_o"] = LogProduct(
        torch.rand(B, 50, H, 1, inputs["i"].shape[-1], dtype=torch.float64),
        -torch.rand(H, K, inputs["i"].shape[-1], dtype=torch.float64),
    )
    inputs["initial_state"] = torch.randn(B, H, K, inputs["i"].shape[-1], dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(inputs, "native", torch.float64)
        torch.set_num_threads(3)
        three = run(inputs, "native", torch.float64)
    finally:
        torch.set_num_threads(threads)
    for name, x in one.items():
        assert torch.equal(x, three[name]), name
    check(inputs, "native", torch.float64, context="3 column blocks")


@pytest.mark.parametrize(
    "case,expected",
    [
        (dict(decay="outer"), "decay 'outer'"),
        (dict(decay="product", dd_decay=True), "one operand is time-invariant"),
        (dict(decay="product", dd_decay=(True, False), e="mat"), "K x D e"),
        (dict(decay="product", dd_decay=(True, False), complex_decay=True), "compute dtype torch.complex128"),
    ],
)
def test_native_mode_refuses_what_it_cannot_serve(case, expected):
    inputs = make_inputs(20, **case)
    with pytest.raises(ValueError, match="mode='native' cannot serve these inputs") as err:
        explain(*_args(inputs), mode="native")
    assert expected in str(err.value)
    # auto takes the chunk form for them
    assert explain(*_args(inputs)).mode == "chunk"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("bounds,chunk_size", [("ones", 4), ("random", 5), ("one-document", 64), ("ones", 1)])
@pytest.mark.parametrize("decay", ["product", "full"])
def test_packed_documents_against_each_alone(decay, bounds, chunk_size, initial, dtype):
    """cu_seqlens: each document from its own initial state (one-token documents at the start,
    inside and at the end; chunks across document starts), per-document final states and every
    gradient against the reference run on each document alone."""
    b = packed._bounds(bounds)
    inputs = packed.make_inputs(decay, n_docs=len(b) - 1, initial=initial, seed=4)
    assert explain(*_args(inputs), cu_seqlens=torch.tensor(b)).mode == "native"
    packed.check_packed(eos, inputs, b, dtype, f"{bounds} C={chunk_size}", mode="native", chunk_size=chunk_size)


def test_turned_off_by_the_environment(monkeypatch):
    """LCSM_NATIVE=0: no build, and auto says why it takes the chunk form."""
    monkeypatch.setenv("LCSM_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {**native._state, "lib": None, "why": None})
    plan = explain(*_args(make_inputs(20, decay="product", dd_decay=(True, False))))
    assert plan.mode == "chunk" and "not the native scan: LCSM_NATIVE=0" in plan.reason


def test_a_failed_build_is_reported(monkeypatch, tmp_path):
    """A compiler that fails: the plan names it and its last message; nothing is cached."""
    fake = tmp_path / "cc"
    fake.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'error: broken' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LCSM_NATIVE_DIR")
    monkeypatch.setattr(native, "_state", {**native._state, "lib": None, "why": None})
    plan = explain(*_args(make_inputs(20, decay="product", dd_decay=(True, False))))
    assert plan.mode == "chunk" and "failed: error: broken" in plan.reason
    assert list((tmp_path / "cache" / "native").iterdir()) == []


def test_a_compiler_without_openmp_builds_a_one_thread_kernel(monkeypatch, tmp_path):
    """A compiler that cannot link OpenMP: the kernel is built without it and runs on one thread,
    with the same results; the plan says so."""
    real = shutil.which(os.environ.get("CC", "cc"))
    fake = tmp_path / "cc"
    fake.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "error: no OpenMP here" >&2; exit 1; }; done\n'
        f'exec "{real}" "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LCSM_NATIVE_DIR")
    monkeypatch.setattr(native, "_state", {**native._state, "lib": None, "why": None, "serial": None})
    inputs = make_inputs(40, decay="product", dd_decay=(True, False))
    plan = explain(*_args(inputs))
    assert plan.mode == "native" and "one thread" in plan.reason and "error: no OpenMP here" in plan.reason
    assert [p.name.endswith("-fopenmp-simd.so") for p in (tmp_path / "cache" / "native").iterdir()] == [True]
    check(inputs, "native", torch.float64, context="kernel built without OpenMP")


def test_the_kernels_directory(monkeypatch, tmp_path):
    """``$LCSM_NATIVE_DIR`` where set (runs with separate data caches share one build), else
    ``$LCSM_CACHE/native``, else ``~/.cache/lcsm/native``."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LCSM_NATIVE_DIR", str(tmp_path / "kernels"))
    assert native.cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("LCSM_NATIVE_DIR")
    assert native.cache_dir() == tmp_path / "cache" / "native"
    monkeypatch.delenv("LCSM_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.cache_dir() == tmp_path / "home" / ".cache" / "lcsm" / "native"


def test_an_unwritable_cache_is_reported(monkeypatch, tmp_path):
    """A cache directory that cannot be made: the plan says so, nothing raises."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("LCSM_CACHE", str(blocker / "cache"))
    monkeypatch.delenv("LCSM_NATIVE_DIR")
    monkeypatch.setattr(native, "_state", {**native._state, "lib": None, "why": None})
    plan = explain(*_args(make_inputs(20, decay="product", dd_decay=(True, False))))
    assert plan.mode == "chunk" and "could not be built or loaded" in plan.reason


def test_compiled_calls_run_the_kernel(monkeypatch):
    """torch.compile(fullgraph=True, dynamic=True): the traced graph calls the kernel's custom ops,
    at two lengths without retracing, with the eager call's outputs and gradients."""
    calls = []
    run_kernel = native._run
    monkeypatch.setattr(native, "_run", lambda *args: calls.append(1) or run_kernel(*args))

    def f(i, e, s, a, b):
        return eos(i, e, s, LogProduct(a, b), output_final_state=True)

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T in (37, 50):
        inputs = make_inputs(T, decay="product", dd_decay=(True, False), initial=False)
        log_o = inputs["log_o"]
        leaves = [x.detach().requires_grad_() for x in (*_args(inputs)[:3], log_o.a, log_o.b)]
        results = []
        for fn in (f, compiled):
            calls.clear()
            y, m = fn(*leaves)
            grads = torch.autograd.grad((y * 1.3).sum() + (m * 0.7).sum(), leaves)
            assert len(calls) == 2  # forward and backward
            results.append([y, m, *grads])
        for eager, traced in zip(*results, strict=True):
            assert torch.equal(eager, traced)
    assert counter.frame_count == 1


def test_the_public_native_ops_refuse_what_they_cannot_take(monkeypatch):
    """native_s4_spectrum, native_s4_kernel and native_diag_scan name the shapes they got and
    expected; without the kernel they say why (not an AttributeError from a missing library)."""
    from lcsm.ops import native_diag_scan, native_s4_kernel, native_s4_spectrum

    z = torch.zeros(3, dtype=torch.complex128)
    with pytest.raises(ValueError, match=r"native_diag_scan: expected x \[B, T, C\].*got \[2, 5, 4\], \[3\]"):
        native_diag_scan(torch.zeros(2, 5, 4, dtype=torch.float64), z, z, z, None)
    a, c = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(7, dtype=torch.complex128)
    W = torch.zeros(2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"native_s4_spectrum: expected g \[H, M\].*got \[3, 7\], \[7\], \[2, 4\]"):
        native_s4_spectrum(torch.zeros(3, 7, dtype=torch.complex128), c, a, a, W)
    with pytest.raises(ValueError, match=r"W \[H, N2, 8\], got .*\[2, 4, 4\]"):
        native_s4_spectrum(torch.zeros(2, 7, dtype=torch.complex128), c, a, a, W[..., :4])
    pairs = torch.zeros(2, 4, 2, dtype=torch.float64)
    s4_params = (a, a, pairs, pairs, pairs, torch.zeros(2, dtype=torch.float64), c, c)
    got = r"got \[\[2, 4\], \[2, 4\], \[2, 4, 2\], \[2, 4\],"  # B [H, N2]: not its [H, N2, 2] pairs
    with pytest.raises(ValueError, match=r"native_s4_kernel: expected .*" + got):
        native_s4_kernel(*s4_params[:3], a, *s4_params[4:], True)
    with pytest.raises(ValueError, match="float32 or float64 CPU tensors, got torch.float16"):
        native_diag_scan(torch.zeros(1, 5, 3, dtype=torch.float16), z, z, z, None)
    monkeypatch.setattr(native, "_state", {**native._state, "lib": None, "why": "turned off by the test"})
    monkeypatch.setenv("LCSM_NATIVE", "0")
    with pytest.raises(RuntimeError, match="the native kernels cannot run in this process"):
        native_diag_scan(torch.zeros(1, 5, 3, dtype=torch.float64), z, z, z, None)
    with pytest.raises(RuntimeError, match="the native kernels cannot run in this process"):
        native_s4_spectrum(torch.zeros(2, 7, dtype=torch.complex128), c, a, a, W)
    with pytest.raises(RuntimeError, match="the native kernels cannot run in this process"):
        native_s4_kernel(*s4_params, True)
