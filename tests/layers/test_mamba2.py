"""Mamba-2 mixer against the chunked SSD formula of the paper (Dao & Gu 2024, section 6, Listing 1:
diagonal blocks through the 1-semiseparable mask L = exp(segsum(A)), chunk states, the inter-chunk
recurrence, and the state-to-output term), written out here with the block around it (in_proj
split [z, x, B, C, dt], conv + SiLU over xBC, D skip, RMSNorm(y * SiLU(z)) per group, out_proj)."""

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import assert_close, gradients, rel_rms


def make(d_model=16, seed=0, **options):
    torch.manual_seed(seed)
    mixer = layers.build("mamba2", d_model, **options).double()
    # Off the structured init, so that layout mistakes cannot hide behind equal values.
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return mixer


def segsum(a):
    """a [..., L] -> [..., L, L]: entry (i, j) = a[j+1] + ... + a[i] for j <= i, -inf above."""
    L = a.shape[-1]
    c = torch.cumsum(a, -1)
    out = c[..., :, None] - c[..., None, :]
    return out.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -torch.inf)


def ssd_chunked(X, A, B, C, block):
    """X [b, T, h, p], A [b, T, h] (log decays), B, C [b, T, h, n]; T a multiple of block."""
    b, T, h, p = X.shape
    X, A, B, C = (t.unflatten(1, (T // block, block)) for t in (X, A, B, C))
    A = A.permute(0, 3, 1, 2)  # b h c l
    Acum = A.cumsum(-1)
    Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, torch.exp(segsum(A)), X)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, torch.exp(Acum[..., -1:] - Acum), X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    chunk_decay = torch.exp(segsum(F.pad(Acum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states[:, :-1], torch.exp(Acum))
    return (Y_diag + Y_off).flatten(1, 2), states[:, -1]


def reference(m, x, block=16):
    d_inner, N, G, H, P, W = m.d_inner, m.d_state, m.ngroups, m.nheads, m.headdim, m.d_conv
    zxbcdt = x @ m.in_proj.weight.t()
    z, xBC, dt = zxbcdt.split([d_inner, d_inner + 2 * G * N, H], -1)
    xBC = F.conv1d(F.pad(xBC.transpose(1, 2), (W - 1, 0)), m.conv1d.weight, m.conv1d.bias, groups=xBC.shape[-1])
    xBC = F.silu(xBC.transpose(1, 2))
    xs, Bt, Ct = xBC.split([d_inner, G * N, G * N], -1)
    dt = F.softplus(dt + m.dt_bias)
    A = -torch.exp(m.A_log)
    X = xs.unflatten(-1, (H, P))
    Bh = Bt.unflatten(-1, (G, N)).repeat_interleave(H // G, 2)
    Ch = Ct.unflatten(-1, (G, N)).repeat_interleave(H // G, 2)
    y, final = ssd_chunked(X * dt[..., None], A * dt, Bh, Ch, block)
    y = (y + m.D[:, None] * X).flatten(-2)
    g = (y * F.silu(z)).unflatten(-1, (G, -1))
    g = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + 1e-5)).flatten(-2) * m.norm_weight
    return g @ m.out_proj.weight.t(), final.transpose(-1, -2)


@pytest.mark.parametrize("options", [{}, {"ngroups": 2, "headdim": 8, "chunk_size": 64}, {"chunk_size": 7}])
def test_forward_equals_chunked_ssd(options):
    # T = 80: five of the mixer's default chunks (16) and of the reference's blocks (16); chunks of
    # 64 and 7 do not divide it.
    m = make(**options)
    x = torch.randn(2, 80, 16, dtype=torch.float64, requires_grad=True)
    wrt = {"x": x, **dict(m.named_parameters())}
    y, state = m(x, return_state=True)
    y_ref, ssm_ref = reference(m, x)
    errors = assert_close(gradients({"y": y, "ssm": state.ssm}, wrt), gradients({"y": y_ref, "ssm": ssm_ref}, wrt))
    print("mamba2 vs chunked SSD", options, errors)


def test_inits_follow_official_ranges():
    m = layers.build("mamba2", 64, headdim=8)  # 16 heads
    A = torch.exp(m.A_log)
    assert bool(((A >= 1) & (A <= 16)).all())
    dt = F.softplus(m.dt_bias)
    assert bool(((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all())
    assert bool((m.D == 1).all()) and bool((m.norm_weight == 1).all())
    assert m.in_proj.weight.shape == (2 * 128 + 2 * 16 + 16, 64)


def test_gate_is_before_the_norm():
    # norm(y * silu(z)) differs from norm(y) * silu(z): a swapped order would not match.
    m = make()
    y, z = torch.randn(2, 3, m.d_inner, dtype=torch.float64), torch.randn(2, 3, m.d_inner, dtype=torch.float64)
    after = m.gated_norm(y, torch.full_like(z, 30.0)) * F.silu(z)  # silu(30) ~ 30: gate ~ identity
    assert rel_rms(m.gated_norm(y, z), after) > 0.1


@pytest.mark.parametrize(
    "options, match",
    [
        ({"headdim": 5}, r"^headdim: expected a divisor of d_inner = expand \* d_model = 32, got 5"),
        ({"ngroups": 3}, r"^ngroups: expected a divisor of the number of heads 2, got 3"),
        ({"A_init_min": 4.0, "A_init_max": 2.0}, r"^A_init_min, A_init_max: expected A_init_min <= A_init_max"),
        ({"dt_min": 0.0}, r"^dt_min: expected a positive finite number, got 0.0"),
        ({"chunk_size": 0}, r"^chunk_size: expected an integer >= 1, got 0"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        layers.build("mamba2", 16, **options)
