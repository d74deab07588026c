"""Mamba-1 mixer against an independent per-step selective scan written from the paper.

The reference follows Gu & Dao 2023, Algorithm 2 and eq. 2a-2b, 4, with the discretisation of the
official ``selective_scan_ref``: A_bar = exp(Delta A) (zero-order hold) and B_bar = Delta B (a
simplification of ZOH's (Delta A)^-1 (exp(Delta A) - I) Delta B that the official code makes).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import assert_close, assert_matches_reference


def make(d_model=8, seed=0, perturb=True, **options):
    torch.manual_seed(seed)
    mixer = layers.build("mamba", d_model, **options).double()
    if perturb:
        # Move every parameter off its structured init so layout mistakes (A_log transposed,
        # D per state instead of per channel, ...) cannot hide behind symmetric values.
        with torch.no_grad():
            for p in mixer.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return mixer


def reference(mixer, x):
    """Per-step Mamba block: in_proj, causal depthwise conv + SiLU, selective SSM, gate, out_proj."""
    B, T, _ = x.shape
    d_inner, N, W, R = mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank
    A = -torch.exp(mixer.A_log)  # [d_inner, N]
    conv_w = mixer.conv1d.weight[:, 0, :]  # [d_inner, W]
    h = x.new_zeros(B, d_inner, N)
    window = [x.new_zeros(B, d_inner) for _ in range(W - 1)]
    ys = []
    for t in range(T):
        xz = x[:, t] @ mixer.in_proj.weight.t()
        xt, z = xz[:, :d_inner], xz[:, d_inner:]
        window.append(xt)
        recent = window[len(window) - W :]  # oldest first
        u = mixer.conv1d.bias + sum(conv_w[:, j] * recent[j] for j in range(W))
        u = u * torch.sigmoid(u)
        dbc = u @ mixer.x_proj.weight.t()
        dt, Bt, Ct = dbc[:, :R], dbc[:, R : R + N], dbc[:, R + N :]
        delta = F.softplus(dt @ mixer.dt_proj.weight.t() + mixer.dt_proj.bias)  # [B, d_inner]
        A_bar = torch.exp(delta[:, :, None] * A)  # [B, d_inner, N]
        B_bar = delta[:, :, None] * Bt[:, None, :]
        h = A_bar * h + B_bar * u[:, :, None]
        y = (h * Ct[:, None, :]).sum(-1) + mixer.D * u
        y = y * (z * torch.sigmoid(z))
        ys.append(y @ mixer.out_proj.weight.t())
    return torch.stack(ys, 1)


def test_forward_equals_per_step_selective_scan():
    # T = 70 crosses the EOS op's default chunk boundary (64).
    mixer = make()
    x = torch.randn(2, 70, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_matches_reference(mixer, x, lambda x: reference(mixer, x), "mamba vs selective-scan loop")


def test_non_default_shapes_equal_reference():
    mixer = make(d_model=6, d_state=3, d_conv=2, expand=3, dt_rank=2)
    x = torch.randn(1, 9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert_matches_reference(mixer, x, lambda x: reference(mixer, x), "mamba, non-default options")


def test_conv_is_causal_and_carries_its_window():
    mixer = make()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, mixer.d_inner, dtype=torch.float64, generator=g)
    x2 = x.clone()
    x2[:, 6:] = torch.randn(2, 6, mixer.d_inner, dtype=torch.float64, generator=g)
    u, _ = mixer.conv(x, None)
    u2, _ = mixer.conv(x2, None)
    assert_close({"prefix": u2[:, :6]}, {"prefix": u[:, :6]}, context="conv causality")
    assert not torch.allclose(u2[:, 6], u[:, 6]), "the conv must see the current input"
    u_a, state = mixer.conv(x[:, :5], None)
    assert state.shape == (2, mixer.d_conv - 1, mixer.d_inner)
    u_b, _ = mixer.conv(x[:, 5:], state)
    assert_close({"u": torch.cat([u_a, u_b], 1)}, {"u": u}, context="conv with carried window")


def test_dt_A_D_init_and_weight_decay_tags():
    torch.manual_seed(0)
    mixer = layers.build("mamba", 64)  # d_inner = 128 samples of dt
    R = mixer.dt_rank
    assert math.ceil(64 / 16) == R
    dt = F.softplus(mixer.dt_proj.bias.detach().double())
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 1e-1 * (1 + 1e-5), (dt.min(), dt.max())
    # log-uniform over two decades: both ends are populated
    assert dt.min() < 3e-3 and dt.max() > 3e-2, (dt.min(), dt.max())
    assert mixer.dt_proj.weight.abs().max() <= R**-0.5
    expected_A = torch.arange(1, 17, dtype=torch.float32).repeat(mixer.d_inner, 1)
    assert_close({"A": -torch.exp(mixer.A_log.detach())}, {"A": -expected_A}, dtype=torch.float32)
    assert torch.equal(mixer.D.detach(), torch.ones(mixer.d_inner))
    for p in (mixer.A_log, mixer.D, mixer.dt_proj.bias):
        assert getattr(p, "_no_weight_decay", False)
    assert not getattr(mixer.in_proj.weight, "_no_weight_decay", False)


def test_bfloat16_layer_keeps_the_official_float32_parts():
    """As the official kernel: A_log, D and the Delta bias stay float32 in a bfloat16 layer, and
    Delta (bias added, softplus taken) comes out in float32, not rounded to bfloat16."""
    mixer = make().to(torch.bfloat16)
    kept = {n for n, p in mixer.named_parameters() if p.dtype == torch.float32}
    assert kept == {"A_log", "D", "dt_proj.bias"}, kept
    u = torch.randn(2, 5, mixer.d_inner, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    delta, Bt, Ct, A = mixer.ssm_inputs(u)
    assert delta.dtype == A.dtype == torch.float32 and Bt.dtype == Ct.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "options, name",
    [
        ({"d_state": 0}, "d_state"),
        ({"d_conv": 1.5}, "d_conv"),
        ({"expand": 0}, "expand"),
        ({"dt_rank": "full"}, "dt_rank"),
        ({"dt_min": 0.2, "dt_max": 0.1}, "dt_min, dt_max"),
    ],
)
def test_bad_options_name_the_argument(options, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        layers.build("mamba", 8, **options)
