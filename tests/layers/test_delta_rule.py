"""The delta-rule mixers against their papers' recurrences, written out step by step here.

fwp: LCSM eq. 13 / Schlag et al. 2021, W_t = W_{t-1} + beta_t k_t (v_t - W_{t-1}^T k_t)^T,
y_t = W_t^T q_t K^-1/2 (DeltaNet's query scale, as fla), with the projections, normalisations and
read-out recomputed from the mixer's weights, so the whole layer (not just the operator) is
checked. m1, m2: the same with their Table 7 oscillations; m3: the elementwise recurrence
m_t = (1 - k_t) * m_{t-1} + k_t v_t^T.
"""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.layers._delta import DeltaState
from lcsm.testing import assert_close, decode, gradients

D_MODEL, HEADS = 16, 4


def make(name, **options):
    torch.manual_seed(0)
    return layers.build(name, D_MODEL, **options).double()


def inputs(B=2, T=13, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)


def heads(x, mixer):
    return x.reshape(x.shape[0], x.shape[1], mixer.heads, -1)


def readout(mixer, y):
    """Per-head RMSNorm (eps 1e-5) with the shared weight, then the output projection."""
    if mixer.o_norm is not None:
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * mixer.o_norm
    return y.reshape(y.shape[0], y.shape[1], -1) @ mixer.o_proj.weight.T


def unit(x):
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)


def explicit_delta(mixer, x, W0, kind):
    """Per-step W_t of LCSM eq. 13 (fwp) or Table 7 (m1, m2); W [B, H, K, D]."""
    q = unit(F.silu(heads(x @ mixer.q_proj.weight.T, mixer)))
    k = unit(F.silu(heads(x @ mixer.k_proj.weight.T, mixer)))
    v = heads(x @ mixer.v_proj.weight.T, mixer)
    if kind == "fwp":
        beta = torch.sigmoid(x @ mixer.beta_proj.weight.T)  # [B, T, H]
        q = q * mixer.head_k**-0.5  # DeltaNet's query scale (fla chunk_delta_rule, scale K^-1/2)
    if kind == "m2":
        delta = heads(x @ mixer.kbar_proj.weight.T, mixer)
        kbar = unit(k + delta / (1 + delta.norm(dim=-1, keepdim=True)))
    W, ys = W0, []
    for t in range(x.shape[1]):
        k_t, v_t, q_t = k[:, t], v[:, t], q[:, t]
        read = torch.einsum("bhk,bhkd->bhd", k_t, W)  # W_{t-1}^T k_t
        if kind == "fwp":
            W = W + beta[:, t, :, None, None] * k_t[..., None] * (v_t - read)[..., None, :]
        elif kind == "m1":
            W = W - k_t[..., None] * read[..., None, :] + k_t[..., None] * v_t[..., None, :]
        else:
            read_bar = torch.einsum("bhk,bhkd->bhd", kbar[:, t], W)  # kbar^T W_{t-1}
            W = W - k_t[..., None] * read_bar[..., None, :] + k_t[..., None] * v_t[..., None, :]
        ys.append(torch.einsum("bhk,bhkd->bhd", q_t, W))
    return readout(mixer, torch.stack(ys, 1)), W


def explicit_m3(mixer, x, m0):
    k = torch.sigmoid(heads(x @ mixer.k_proj.weight.T, mixer))
    q = heads(x @ mixer.q_proj.weight.T, mixer)
    v = heads(x @ mixer.v_proj.weight.T, mixer)
    m, ys = m0, []
    for t in range(x.shape[1]):
        m = (1 - k[:, t, :, :, None]) * m + k[:, t, :, :, None] * v[:, t, :, None, :]
        ys.append((q[:, t, :, :, None] * m).sum(-2))
    return readout(mixer, torch.stack(ys, 1)), m


@pytest.mark.parametrize("name,kind", [("fwp", "fwp"), ("deltanet", "fwp"), ("m1", "m1"), ("m2", "m2")])
@pytest.mark.parametrize("mode,chunk_size", [("chunk", 4), ("chunk", 64), ("recurrent", 5)])
def test_delta_mixers_equal_their_recurrence(name, kind, mode, chunk_size):
    """The paper identity 'FWP chunk == the delta-rule recurrence' at the layer level (and M1/M2):
    chunk sizes 4 (T = 13 leaves a partial chunk) and 64 (> T), plus the custom-backward loop:
    outputs, final memory, and the gradients of the input, the initial memory and every parameter."""
    mixer, x = make(name, mode=mode, chunk_size=chunk_size), inputs().requires_grad_()
    W0 = torch.randn(
        2, HEADS, mixer.head_k, mixer.head_v, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    ).requires_grad_()
    wrt = {"x": x, "W0": W0, **dict(mixer.named_parameters())}
    y, state = mixer(x, state=DeltaState(memory=W0), return_state=True)
    y_ref, W_ref = explicit_delta(mixer, x, W0, kind)
    assert_close(
        gradients({"y": y, "memory": state.memory}, wrt),
        gradients({"y": y_ref, "memory": W_ref}, wrt),
        context=f"{name} {mode}",
    )


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "parallel", "auto"])
def test_m3_equals_its_elementwise_recurrence(mode):
    mixer, x = make("m3", mode=mode, chunk_size=4), inputs().requires_grad_()
    m0 = torch.randn(
        2, HEADS, mixer.head_k, mixer.head_v, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    ).requires_grad_()
    wrt = {"x": x, "m0": m0, **dict(mixer.named_parameters())}
    y, state = mixer(x, state=DeltaState(memory=m0), return_state=True)
    y_ref, m_ref = explicit_m3(mixer, x, m0)
    assert_close(
        gradients({"y": y, "memory": state.memory}, wrt), gradients({"y": y_ref, "memory": m_ref}, wrt), context=mode
    )


@pytest.mark.parametrize("name", ["fwp", "m1", "m2"])
def test_memory_stays_bounded_on_long_sequences(name):
    """The normalisations' purpose: over 1024 random tokens the memory stays O(||v||). (M2 with an
    independent unit kbar diverges, ~1e57 here; the bounded tilt keeps it at the M1 scale.)"""
    mixer, x = make(name, mode="chunk"), inputs(B=1, T=1024)
    with torch.no_grad():
        _, state = mixer(x, return_state=True)
        v_max = (x @ mixer.v_proj.weight.T).norm(dim=-1).max()
    assert torch.isfinite(state.memory).all()
    assert state.memory.norm(dim=(-2, -1)).max() < 10 * v_max


def test_expand_k_gives_rectangular_memory():
    mixer, x = make("fwp", expand_k=2.0), inputs(T=5)
    assert (mixer.head_k, mixer.head_v) == (8, 4)
    y, state = mixer(x, return_state=True)
    assert state.memory.shape == (2, HEADS, 8, 4)
    y_steps, s = decode(mixer, x)
    assert_close({"y": y_steps, "memory": s.memory}, {"y": y, "memory": state.memory})


def test_describe_rows():
    rows = {n: make(n).describe() for n in ("fwp", "m1", "m2", "m3")}
    assert rows["fwp"].oscillation == "I_k - beta_t k_t k_t^T" and rows["fwp"].expand == "beta_t k_t"
    assert rows["m1"].oscillation == "I_k - k_t k_t^T"
    assert rows["m2"].oscillation == "I_k - k_t kbar_t^T"
    assert rows["m3"].oscillation == "I_k - Diag{k_t}"
    assert [rows[n].psi for n in ("fwp", "m1", "m2", "m3")] == ["matrix"] * 3 + ["elementwise"]
    assert layers.resolve("deltanet")[0] is layers.resolve("fwp")[0]


@pytest.mark.parametrize(
    "option,value,pattern",
    [
        ("heads", 3, "heads: expected a positive integer dividing d_model=16, got 3"),
        ("heads", 0, "heads: expected"),
        ("expand_k", 0.3, "expand_k: expected a positive number"),
        ("expand_k", -1.0, "expand_k: expected a positive number"),
        ("expand_k", float("nan"), "expand_k: expected a positive number"),
        ("expand_k", float("inf"), "expand_k: expected a positive number"),
        ("mode", "fft", "mode: expected one of auto, recurrent, chunk, triton, got 'fft'"),
        ("chunk_size", 0, "chunk_size: expected an integer >= 1, got 0"),
        ("output_norm", "yes", "output_norm: expected True or False, got 'yes'"),
        ("negative_eigenvalues", 1, "negative_eigenvalues: expected True or False, got 1"),
    ],
)
def test_bad_options(option, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        layers.build("fwp", D_MODEL, **{option: value})


@pytest.mark.parametrize("name", ["fwp", "m3"])
def test_without_output_norm(name):
    """output_norm=False: the read-out is the output projection of the raw per-head y."""
    mixer, x = make(name, output_norm=False), inputs(T=5)
    assert mixer.o_norm is None
    y_ref, _ = (
        explicit_delta(mixer, x, torch.zeros(2, HEADS, 4, 4, dtype=torch.float64), "fwp")
        if name == "fwp"
        else explicit_m3(mixer, x, torch.zeros(2, HEADS, 4, 4, dtype=torch.float64))
    )
    assert_close({"y": mixer(x)}, {"y": y_ref})


def test_m3_accepts_eos_modes_only():
    layers.build("m3", D_MODEL, mode="parallel")
    with pytest.raises(ValueError, match="mode: expected one of auto, recurrent, parallel, chunk, got 'fft'"):
        layers.build("m3", D_MODEL, mode="fft")


def test_wrong_state_is_a_clear_error():
    mixer, x = make("fwp"), inputs(T=3)
    with pytest.raises(ValueError, match=r"state.memory: expected \[2, 4, 4, 4\], got \[2, 4, 4, 5\]"):
        mixer(x, state=DeltaState(memory=torch.zeros(2, 4, 4, 5, dtype=torch.float64)))


def test_negative_eigenvalues_doubles_beta():
    """negative_eigenvalues=True: beta = 2 sigmoid(.) spans (0, 2), so the eigenvalue 1 - beta of
    I - beta k k^T goes negative (Grazzi et al. 2025); off, the layer is unchanged (beta in (0, 1))."""
    x = inputs(B=4, T=64) * 20  # large inputs push the sigmoid to both ends
    betas = {}
    for on in (False, True):
        mixer = make("fwp", negative_eigenvalues=on)
        with torch.no_grad():
            mixer.beta_proj.weight.mul_(20)
            betas[on] = mixer._delta_states(x)[0].norm(dim=-1) / mixer._delta_states(x)[3].norm(dim=-1)
    torch.testing.assert_close(betas[True], 2 * betas[False], rtol=1e-12, atol=1e-12)
    assert 0 <= betas[True].min() < 0.05 and 1.95 < betas[True].max() <= 2
    assert betas[False].max() <= 1
    # off, the output is bit-identical to the default layer's
    x = inputs()
    assert torch.equal(make("fwp")(x), make("fwp", negative_eigenvalues=False)(x))
    assert not torch.allclose(make("fwp")(x), make("fwp", negative_eigenvalues=True)(x))
