"""RWKV-4 time mixing against the WKV formula written out with its full sums (Peng et al. 2023,
eq. 14 / section 3.2), including keys large enough to overflow exp in float32."""

import itertools
import math

import pytest
import torch

from lcsm import layers
from lcsm.layers.rwkv4 import RWKV4State, running_max
from lcsm.testing import assert_close, decode

D_MODEL = 8


def make(dtype=torch.float64, key_scale=1.0, seed=0):
    torch.manual_seed(seed)
    mixer = layers.build("rwkv4", D_MODEL, layer_id=1, n_layers=3)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name != "time_decay":
                p.add_(0.2 * torch.randn_like(p))
        mixer.key.weight.mul_(key_scale)
    return mixer.to(dtype)


def reference(mixer, x):
    """out_t = W_o (sigmoid(r_t) * wkv_t) with
    wkv_t = (sum_{s<t} e^{-(t-1-s) w + k_s} v_s + e^{u + k_t} v_t) / (same with v = 1), in float64."""
    return wkv_formula({n: t.detach().double() for n, t in mixer.named_parameters()}, x.double())


def wkv_formula(p, x):
    """``reference`` on a dict of parameters (autograd flows through it when they require grad)."""
    xx = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    def mix(mu):
        return x * mu + xx * (1 - mu)

    k = mix(p["time_mix_k"]) @ p["key.weight"].t()
    v = mix(p["time_mix_v"]) @ p["value.weight"].t()
    r = mix(p["time_mix_r"]) @ p["receptance.weight"].t()
    w, u = torch.exp(p["time_decay"]), p["time_first"]
    T = x.shape[1]
    outs = []
    for t in range(T):
        num = torch.exp(u + k[:, t]) * v[:, t]
        den = torch.exp(u + k[:, t])
        for s in range(t):
            weight = torch.exp(-(t - 1 - s) * w + k[:, s])
            num = num + weight * v[:, s]
            den = den + weight
        outs.append((torch.sigmoid(r[:, t]) * num / den) @ p["output.weight"].t())
    return torch.stack(outs, 1), k


def inputs(T, seed=1, dtype=torch.float64):
    return torch.randn(2, T, D_MODEL, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype,key_scale", [(torch.float64, 1.0), (torch.float32, 16.0)])
def test_gradients_equal_the_wkv_formula(dtype, key_scale):
    """The input's and every parameter's gradient under a random cotangent, against autograd
    through the written-out formula in float64. The layer computes its stabilising scales without
    gradient because they cancel exactly in the ratio; this holds it to that, with keys large
    enough in float32 (|k| > 20) that the scales are far from 0."""
    mixer = make(dtype, key_scale=key_scale)
    x = inputs(12, seed=6, dtype=dtype).requires_grad_()
    w = inputs(12, seed=7)
    (mixer(x) * w.to(dtype)).sum().backward()
    actual = {"x": x.grad, **{n: p.grad for n, p in mixer.named_parameters()}}
    params = {n: p.detach().double().requires_grad_() for n, p in mixer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    y, k = wkv_formula(params, x64)
    assert key_scale == 1.0 or k.abs().max() > 20, k.abs().max()
    (y * w).sum().backward()
    expected = {"x": x64.grad, **{n: p.grad for n, p in params.items()}}
    assert_close(actual, expected, dtype=dtype, context=f"rwkv4 gradients {dtype}")


def test_forward_equals_wkv_formula():
    # T = 70 crosses the EOS op's default chunk boundary (64).
    mixer, x = make(), inputs(70)
    expected, _ = reference(mixer, x)
    assert_close({"y": mixer(x)}, {"y": expected}, context="rwkv4 vs WKV formula")


@pytest.mark.parametrize("key_scale, min_k", [(16.0, 30.0), (60.0, 120.0)])
def test_large_keys_stay_finite_and_exact_in_float32(key_scale, min_k):
    # k beyond 88.7 overflows exp in float32; the carried log-scale must absorb it exactly.
    mixer, x = make(torch.float32, key_scale=key_scale), inputs(20, seed=4, dtype=torch.float32)
    expected, k = reference(mixer, x)
    assert k.abs().max() > min_k, k.abs().max()
    y, state = mixer(x, return_state=True)
    assert torch.isfinite(y).all() and torch.isfinite(state.memory).all()
    assert_close({"y": y}, {"y": expected.float()}, context=f"rwkv4 float32, max |k| = {k.abs().max():.0f}")
    y1, s1 = mixer(x[:, :7], return_state=True)
    y2 = mixer(x[:, 7:], state=s1)
    assert_close({"y": torch.cat([y1, y2], 1)}, {"y": expected.float()}, context="rwkv4 float32, carried state")


def test_step_loop_with_large_keys_in_float32():
    mixer, x = make(torch.float32, key_scale=60.0), inputs(9, seed=5, dtype=torch.float32)
    expected, _ = reference(mixer, x)
    assert_close({"y": decode(mixer, x)[0]}, {"y": expected.float()}, context="rwkv4 float32 decoding")


def test_strong_decay_and_negative_bonus_in_float32():
    # w = e^5 ~ 148 per step: e^{-w} underflows in float32, so past terms vanish and the current
    # token's bonus e^{u + k_t} (u = -4) dominates the denominator.
    mixer, x = make(torch.float32, key_scale=4.0), inputs(12, seed=6, dtype=torch.float32)
    with torch.no_grad():
        mixer.time_decay[: D_MODEL // 2] = 5.0
        mixer.time_first.fill_(-4.0)
    expected, _ = reference(mixer.double(), x)
    mixer.float()
    y, state = mixer(x, return_state=True)
    assert torch.isfinite(y).all()
    assert_close({"y": y}, {"y": expected.float()}, context="rwkv4 float32, strong decay")
    y1, s1 = mixer(x[:, :5], return_state=True)
    assert_close(
        {"y": torch.cat([y1, mixer(x[:, 5:], state=s1)], 1)},
        {"y": expected.float()},
        context="rwkv4 float32, strong decay, carried state",
    )


PACKED = [0, 6, 7, 15, 20, 57]  # a document of one token, and one of 37 (six doubling steps)


def packed_inputs(dtype):
    """One packed row; the first document's inputs 4 times the others' (its keys far larger)."""
    x = torch.cat([inputs(29, seed=8, dtype=dtype), inputs(29, seed=9, dtype=dtype)], 1)[:1, :57]
    return x * torch.where(torch.arange(57) < PACKED[1], 4.0, 0.25).to(dtype)[:, None]


def test_packed_documents_with_large_keys_equal_the_wkv_formula_in_float32():
    """Each document of a packed row against the formula on it alone, with keys past exp's float32
    overflow in the first document and far smaller ones after it: a log-scale (running maximum)
    carried across a boundary would flush the later documents' terms to zero. Final states equal
    each document run alone."""
    mixer = make(torch.float32, key_scale=60.0)
    x = packed_inputs(torch.float32)
    y, final = mixer(x, return_state=True, cu_seqlens=torch.tensor(PACKED))
    assert torch.isfinite(y).all() and torch.isfinite(final.memory).all()
    finals = []
    for n, (a, b) in enumerate(itertools.pairwise(PACKED)):
        expected, k = reference(mixer, x[:, a:b])
        assert n > 0 or k.abs().max() > 300, k.abs().max()
        assert_close({"y": y[:, a:b]}, {"y": expected.float()}, context=f"rwkv4 packed float32, document {n}")
        finals.append(mixer(x[:, a:b], return_state=True)[1])
    expected_states = {key: torch.cat([f.tensors()[key] for f in finals]) for key in final.tensors()}
    assert_close(final.tensors(), expected_states, context="rwkv4 packed float32 final states")


def test_packed_documents_from_empty_and_carried_memories():
    """Initial states mixing empty memories (init_state: the scale starts at -inf) and carried
    ones, per document of a packed row: outputs and final states equal each document alone."""
    mixer, x = make(), packed_inputs(torch.float64)
    N = len(PACKED) - 1
    with torch.no_grad():
        carried = mixer(torch.cat([inputs(3, seed=s) for s in (10, 11, 12)])[:N], return_state=True)[1]
    keep = torch.arange(N) % 2 == 1  # documents 1 and 3 carry a memory, the others start empty
    init = RWKV4State(
        **{
            key: torch.where(keep.view(-1, *[1] * (t.dim() - 1)), t, torch.zeros_like(t))
            for key, t in carried.tensors().items()
        }
    )
    y, final = mixer(x, state=init, return_state=True, cu_seqlens=torch.tensor(PACKED))
    for n, (a, b) in enumerate(itertools.pairwise(PACKED)):
        y_n, f_n = mixer(x[:, a:b], state=init.map(lambda t, n=n: t[n : n + 1]), return_state=True)
        got = {"y": y[:, a:b], **{key: t[n : n + 1] for key, t in final.tensors().items()}}
        assert_close(got, {"y": y_n, **f_n.tensors()}, context=f"rwkv4 packed document {n}")


def test_running_max_restarts_exactly_at_every_document():
    """The packed log-scale's running maximum equals torch.cummax on each document alone, bit for bit."""
    a = torch.randn(1, 57, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    got = running_max(a, torch.tensor(PACKED))
    for a_, b_ in itertools.pairwise(PACKED):
        assert torch.equal(got[:, a_:b_], torch.cummax(a[:, a_:b_], dim=1).values)


def test_official_init():
    torch.manual_seed(0)
    mixer = layers.build("rwkv4", 8, layer_id=1, n_layers=3)  # ratio_0_to_1 = 1/2, ratio_1_to_almost0 = 2/3
    h = torch.arange(8, dtype=torch.float64)
    decay = -5 + 8 * (h / 7) ** (0.7 + 1.3 * 0.5)
    first = math.log(0.3) + ((h + 1) % 3 - 1) * 0.5
    ddd = h / 8
    expected = {
        "time_decay": decay,
        "time_first": first,
        "time_mix_k": ddd ** (2 / 3),
        "time_mix_v": ddd ** (2 / 3) + 0.15,
        "time_mix_r": ddd ** (1 / 3),
    }
    got = {n: getattr(mixer, n).detach() for n in expected}
    assert_close(got, {n: t.float() for n, t in expected.items()}, dtype=torch.float32, context="rwkv4 init")
    for n in expected:
        assert getattr(getattr(mixer, n), "_no_weight_decay", False), n


@pytest.mark.parametrize("options, name", [({"n_layers": 0}, "n_layers"), ({"layer_id": 3, "n_layers": 3}, "layer_id")])
def test_bad_options_name_the_argument(options, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        layers.build("rwkv4", 8, **options)
