"""The CUDA subset: the same code paths on a GPU, judged against float64 on the CPU.

Skipped where no CUDA device is visible (CI); ``bench/gpu.sh`` runs it on a GPU machine. Each case
computes the fast form in float32 on the device and the recurrent reference in float64 on the CPU
from the same values: outputs, final states and every gradient under random cotangents (the
cotangents are drawn on the CPU and moved, so both sides see the same ones). Every registered
mixer runs forward, decode and packed on the device against its float64 CPU twin.
"""

import copy
import importlib.util

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm import layers, tasks
from lcsm.models import HeadConfig, ModelConfig, build_model
from lcsm.ops import LogProduct, eos, eos_delta, eos_dplr, explain
from lcsm.testing import assert_close, decode, gradients

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 means float32: cuDNN's convolutions (the short convs) default to TF32 on Ampere+."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


B, T, H, K, D = 2, 75, 3, 16, 8  # T odd and not a multiple of the chunk sizes below


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _run_both(fast, reference, inputs: dict, tol_dtype=torch.float32, context=""):
    """``fast`` on the device in float32 and ``reference`` on the CPU in float64; compare outputs and
    gradients of every input."""
    ref_in = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    dev_in = {n: t.to("cuda", torch.float32).requires_grad_() for n, t in inputs.items() if t is not None}
    ref = gradients(reference(**ref_in), ref_in)
    got = gradients(fast(**dev_in), dev_in)
    assert_close({n: v.cpu() if v is not None else None for n, v in got.items()}, ref, tol_dtype, context)


DECAYS = {
    "none": None,
    "scalar": lambda: logsigmoid(_rand(B, T, H, 1, 1, seed=5) + 3),
    "row": lambda: logsigmoid(_rand(B, T, H, K, 1, seed=5) + 3),
    "column": lambda: logsigmoid(_rand(B, T, H, 1, D, seed=5) + 3),
}


@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("mode", ["chunk", "parallel", "auto", "triton"])
def test_eos_on_cuda(decay, mode):
    log_o = DECAYS[decay]() if DECAYS[decay] else None
    inputs = {
        "i": _rand(B, T, H, D, seed=1),
        "e": _rand(B, T, H, K, seed=2) / K**0.5,
        "s": _rand(B, T, H, K, seed=3),
        "log_o": log_o,
        "initial_state": _rand(B, H, K, D, seed=4),
    }

    def run(m, chunk_size=16):
        def f(i, e, s, initial_state, log_o=None):
            y, final = eos(
                i, e, s, log_o, mode=m, initial_state=initial_state, output_final_state=True, chunk_size=chunk_size
            )
            return {"y": y, "final": final}

        return f

    _run_both(run(mode), run("recurrent"), inputs, context=f"eos {mode} {decay}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("mode", ["auto", "triton"])
def test_selective_scan_on_cuda(mode):
    """Mamba's product decay (Delta_t [.., 1, D] times A [H, K, D]): auto takes the Triton scan on
    CUDA tensors; against the float64 recurrence on the CPU."""
    inputs = {
        "i": _rand(B, T, H, D, seed=1),
        "e": _rand(B, T, H, K, seed=2) / K**0.5,
        "s": _rand(B, T, H, K, seed=3),
        "a": torch.nn.functional.softplus(_rand(B, T, H, 1, D, seed=4)),
        "b": -torch.exp(_rand(H, K, D, seed=5) / 2),
        "initial_state": _rand(B, H, K, D, seed=6),
    }

    def run(m):
        def f(i, e, s, a, b, initial_state):
            y, final = eos(i, e, s, LogProduct(a, b), mode=m, initial_state=initial_state, output_final_state=True)
            return {"y": y, "final": final}

        return f

    x = {n: inputs[n].cuda().float() for n in ("i", "e", "s")}
    assert explain(**x, log_o=LogProduct(inputs["a"].cuda(), inputs["b"].cuda())).kernel == "triton-scan"
    _run_both(run(mode), run("recurrent"), inputs, context=f"selective scan {mode}")


@pytest.mark.parametrize("gate", [False, True])
def test_eos_delta_and_dplr_on_cuda(gate):
    k = normalize(_rand(B, T, H, K, seed=1), dim=-1)
    beta = torch.sigmoid(_rand(B, T, H, 1, seed=2)) * 2
    inputs = {
        "i": _rand(B, T, H, D, seed=3),
        "e": beta * k,
        "s": _rand(B, T, H, K, seed=4) / K**0.5,
        "a": beta * k,
        "b": k,
        "log_o": logsigmoid(_rand(B, T, H, seed=5) + 3) if gate else None,
        "initial_state": _rand(B, H, K, D, seed=6),
    }

    def delta(m):
        def f(i, e, s, a, b, initial_state, log_o=None):
            y, final = eos_delta(
                i, e, s, a, b, log_o, mode=m, initial_state=initial_state, output_final_state=True, chunk_size=16
            )
            return {"y": y, "final": final}

        return f

    def dplr(i, e, s, a, b, initial_state, log_o=None):
        # exp(g) (I - a b^T) = D(exp(g)) - (exp(g) a) b^T: the same transition in DPLR form.
        if log_o is not None:
            a = a * log_o.exp().unsqueeze(-1)
        y, final = eos_dplr(
            i, e, s, a, b, log_o, mode="chunk", initial_state=initial_state, output_final_state=True, chunk_size=16
        )
        return {"y": y, "final": final}

    _run_both(delta("chunk"), delta("recurrent"), inputs, context="eos_delta chunk")
    _run_both(dplr, delta("recurrent"), inputs, context="eos_dplr chunk")


def test_eos_dplr_row_decay_on_cuda():
    k = normalize(_rand(B, T, H, K, seed=1), dim=-1)
    a = torch.sigmoid(_rand(B, T, H, 1, seed=2)) * normalize(k + 0.3 * _rand(B, T, H, K, seed=7), dim=-1)
    inputs = {
        "i": _rand(B, T, H, D, seed=3),
        "e": _rand(B, T, H, K, seed=4) / K**0.5,
        "s": normalize(_rand(B, T, H, K, seed=5), dim=-1),
        "a": a,
        "b": k,
        "log_alpha": logsigmoid(_rand(B, T, H, K, seed=6) + 2),
        "initial_state": _rand(B, H, K, D, seed=8),
    }

    def run(m):
        def f(i, e, s, a, b, log_alpha, initial_state):
            y, final = eos_dplr(
                i, e, s, a, b, log_alpha, mode=m, initial_state=initial_state, output_final_state=True, chunk_size=16
            )
            return {"y": y, "final": final}

        return f

    _run_both(run("chunk"), run("recurrent"), inputs, context="eos_dplr row decay")


def _twins(name, d=32):
    torch.manual_seed(0)
    cpu = layers.build(name, d).double()
    return cpu, copy.deepcopy(cpu).to("cuda", torch.float32)


@pytest.mark.parametrize("name", layers.available())
def test_mixer_on_cuda(name):
    """Forward with final state, decode and a packed row of three documents on the device against
    the float64 CPU forward of the same weights."""
    cpu, gpu = _twins(name)
    x = _rand(2, 37, 32, seed=1)
    y_ref, state_ref = cpu(x, return_state=True)
    y, state = gpu(x.to("cuda", torch.float32), return_state=True)
    got = {"y": y.cpu(), **{n: t.cpu() for n, t in state.tensors().items()}}
    assert_close(got, {"y": y_ref, **state_ref.tensors()}, torch.float32, name)
    y_steps, _ = decode(gpu, x.to("cuda", torch.float32))
    assert_close({"y": y_steps.cpu()}, {"y": y_ref}, torch.float32, f"{name} decode")
    if getattr(gpu, "bidirectional", False):
        return
    packed = x[:1]
    cu = torch.tensor([0, 1, 20, 37])
    y_packed = gpu(packed.to("cuda", torch.float32), cu_seqlens=cu.to("cuda"))
    y_alone = torch.cat([cpu(packed[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)], 1)
    assert_close({"y": y_packed.cpu()}, {"y": y_alone}, torch.float32, f"{name} packed")


@pytest.mark.parametrize("name", tasks.available())
def test_evaluators_take_device_logits_and_host_labels(name):
    """Every task's evaluator on logits on the device and labels left on the host (a loop of one's
    own, not the engine's, which moves the batch) gives the metrics of the same values on the CPU."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, 7, generator=g)
    labels = torch.randint(0, 7, (4, 9), generator=g)
    labels[:, :3] = tasks.IGNORE_INDEX
    results = []
    for device in ("cpu", "cuda"):
        evaluator = tasks.resolve(name).evaluator()
        evaluator.update(logits.to(device), labels)
        results.append(evaluator.compute())
    assert results[0] == pytest.approx(results[1], rel=1e-6), name


@pytest.mark.parametrize("mixer", ["gla", "gated_deltanet", "mamba2", "attention"])
def test_bf16_training_step_on_cuda(mixer):
    torch.manual_seed(0)
    cfg = ModelConfig(mixer=mixer, d_model=64, n_layers=2, vocab_size=97, head=HeadConfig(kind="lm"))
    model = build_model(cfg, verbose=False).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 97, (4, 129), device="cuda")
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_auto_takes_triton_where_it_was_measured_faster():
    """auto on CUDA: the Triton kernels for bfloat16 inputs and for float32 with a row decay; the
    chunk form for float32 with no or a scalar decay (bench/results/gpu_triton.md)."""
    x = {n: torch.randn(1, 40, 2, 16, device="cuda") for n in ("i", "e", "s")}
    row = logsigmoid(torch.randn(1, 40, 2, 16, 1, device="cuda"))
    scalar = logsigmoid(torch.randn(1, 40, 2, 1, 1, device="cuda"))
    assert explain(**x, log_o=row).mode == "triton"
    assert explain(**x, log_o=scalar).mode == "chunk"
    assert "float32 inputs with no or a scalar decay" in explain(**x, log_o=scalar).reason
    bf16 = {n: t.bfloat16() for n, t in x.items()}
    assert explain(**bf16, log_o=scalar.bfloat16()).mode == "triton"


def _inductor_equals_eager(f, cases):
    """f under torch.compile (inductor, fullgraph, dynamic T) equals eager at each case, outputs
    (y, m_T) and every gradient, through one graph (inductor may fuse the ops around the kernels:
    equal up to float32 rounding)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for T_, x in cases:
        leaves = {n: t.to("cuda", torch.float32).requires_grad_() for n, t in x.items()}

        def out(fn, leaves=leaves):
            y, m = fn(**leaves)
            return {"y": y, "m_T": m}

        assert_close(gradients(out(compiled), leaves), gradients(out(f), leaves), torch.float32, f"T={T_}")
    assert counter.frame_count == 1


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_inductor_graph_launches_the_triton_kernels():
    """eos's mode "triton" with a row decay compiled: the graph launches the kernels through the
    custom op lcsm::triton_chunk, at two lengths."""

    def f(i, e, s, log_o):
        return eos(i, e, s, log_o, mode="triton", output_final_state=True)

    def case(T_):
        x = {n: _rand(2, T_, 3, 16, seed=n_) for n_, n in enumerate(("i", "e", "s"))}
        return T_, {**x, "log_o": logsigmoid(_rand(2, T_, 3, 16, 1, seed=7) + 3)}

    _inductor_equals_eager(f, [case(70), case(101)])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_inductor_graph_launches_the_triton_carry():
    """eos_delta's mode "triton" with a gate compiled: the graph carries the memory by the custom op
    lcsm::triton_delta_carry (its traced chunks pad one more than eager's), at two lengths."""

    def f(i, e, s, b, log_o):
        return eos_delta(i, e, s, e, b, log_o, mode="triton", output_final_state=True, chunk_size=16)

    def case(T_):
        k = normalize(_rand(2, T_, 3, 16, seed=1), dim=-1)
        x = {"i": _rand(2, T_, 3, 8, seed=2), "e": 0.5 * k, "s": _rand(2, T_, 3, 16, seed=3), "b": k}
        return T_, {**x, "log_o": logsigmoid(_rand(2, T_, 3, seed=4) + 2)}

    _inductor_equals_eager(f, [case(37), case(50)])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_inductor_graph_launches_the_triton_scan():
    """The selective scan compiled (mode "triton", Mamba's product): the graph launches its kernels
    through the custom ops lcsm::triton_scan and its backward, at two lengths."""

    def f(i, e, s, a, b):
        return eos(i, e, s, LogProduct(a, b), mode="triton", output_final_state=True)

    def case(T_):
        x = {n: _rand(2, T_, 3, 16, seed=n_) for n_, n in enumerate(("i", "e", "s"))}
        a = torch.nn.functional.softplus(_rand(2, T_, 3, 1, 16, seed=5))
        return T_, {**x, "a": a, "b": -torch.exp(_rand(3, 16, 16, seed=6) / 2)}

    _inductor_equals_eager(f, [case(70), case(101)])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_kernels_run_on_the_inputs_device():
    """Inputs on cuda:1 while cuda:0 is current: the Triton kernels (chunk form, delta carry,
    selective scan) launch on cuda:1 and equal the same call on cuda:0."""
    x = {n: _rand(1, 40, 2, 16, seed=j) for j, n in enumerate(("i", "e", "s"))}
    row = logsigmoid(_rand(1, 40, 2, 16, 1, seed=5) + 3)
    k = normalize(x["e"], dim=-1)
    calls = {
        "chunk": lambda d: eos(d["i"], d["e"], d["s"], d["row"], mode="triton"),
        "delta": lambda d: eos_delta(d["i"], 0.5 * d["k"], d["s"], 0.5 * d["k"], d["k"], mode="triton"),
        "scan": lambda d: eos(d["i"], d["e"], d["s"], LogProduct(d["row"].transpose(-1, -2), -d["b"]), mode="triton"),
    }
    values = {**x, "row": row, "k": k, "b": torch.rand(2, 16, 16, dtype=torch.float64)}
    torch.cuda.set_device(0)
    for name, call in calls.items():
        ys = [call({n: v.to(f"cuda:{j}", torch.float32) for n, v in values.items()})[0] for j in (0, 1)]
        assert ys[1].device == torch.device("cuda", 1)
        assert torch.equal(ys[0].cpu(), ys[1].cpu()), name
