"""RWKV-7 against the official recurrence written out in its own convention (state S [V, K],
value rows, as the official CUDA kernel and rwkv_v7_numpy.py), and against fla-core's naive DPLR
recurrence on the same inputs."""

import math

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.models import ModelConfig, build_model
from lcsm.ops import eos_dplr
from lcsm.testing import rel_rms

torch.manual_seed(0)


def official_time_mix(m, x, v_first=None):
    """RWKV_Tmix_x070.forward with the official state loop: S = S (diag(w) - kk^T (kk a)) + v k^T,
    y = S r; w = exp(-exp(-softplus(-z) - 0.5)) as the official code writes it; a layer > 0 mixes in
    v_first (layer 0's values): v = v + (v_first - v) sigmoid(v0 + xv V1 V2). Returns the output
    and the layer's values before that mix (the official v_first of layer 0)."""
    B, T, C = x.shape
    H, N = m.heads, m.head_size
    xx = torch.cat([x.new_zeros(B, 1, C), x[:, :-1]], 1) - x
    xr, xw, xk = x + xx * m.x_r, x + xx * m.x_w, x + xx * m.x_k
    xv, xa, xg = x + xx * m.x_v, x + xx * m.x_a, x + xx * m.x_g
    r = xr @ m.receptance.weight.T
    w = -F.softplus(-(m.w0 + torch.tanh(xw @ m.w1) @ m.w2)) - 0.5
    k = xk @ m.key.weight.T
    v = v_own = xv @ m.value.weight.T
    if v_first is not None:
        v = v + (v_first - v) * torch.sigmoid(m.v0 + xv @ m.v1 @ m.v2)
    a = torch.sigmoid(m.a0 + (xa @ m.a1) @ m.a2)
    g = torch.sigmoid(xg @ m.g1) @ m.g2
    kk = F.normalize((k * m.k_k).view(B, T, H, N), dim=-1).view(B, T, C)
    k = k * (1 + (a - 1) * m.k_a)
    S = x.new_zeros(B, H, N, N)  # [value row i, key column j]
    ys = []
    for t in range(T):
        rt, wt, kt, vt = (z[:, t].view(B, H, N) for z in (r, w, k, v))
        at, bt = -kk[:, t].view(B, H, N), (kk[:, t] * a[:, t]).view(B, H, N)
        decay = torch.exp(-torch.exp(wt))
        sa = torch.einsum("bhij,bhj->bhi", S, at)
        S = S * decay[:, :, None, :] + sa[..., None] * bt[:, :, None, :] + vt[..., None] * kt[:, :, None, :]
        ys.append(torch.einsum("bhij,bhj->bhi", S, rt))
    y = torch.stack(ys, 1).reshape(B * T, C)
    y = F.group_norm(y, H, m.ln_x.weight, m.ln_x.bias, eps=64e-5).view(B, T, C)
    y = y + ((r.view(B, T, H, N) * k.view(B, T, H, N) * m.r_k).sum(-1, keepdim=True) * v.view(B, T, H, N)).view(B, T, C)
    return (y * g) @ m.output.weight.T, v_own


def test_rwkv7_matches_the_official_recurrence():
    m = layers.build("rwkv7", 32, head_size=8, layer_id=1, n_layers=3).double()
    with torch.no_grad():  # random trained-looking weights, so every term matters
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x, v_first = torch.randn(2, 13, 32, dtype=torch.float64), torch.randn(2, 13, 32, dtype=torch.float64)
    err = rel_rms(m(x, value_first=layers.ValueFirst(v_first)), official_time_mix(m, x, v_first)[0])
    print(f"relative RMS error {err:.2e}")
    assert err < 1e-12, err


def test_rwkv7_layer_0_stores_its_values_and_later_layers_need_them():
    first = layers.build("rwkv7", 32, head_size=8, layer_id=0, n_layers=2).double()
    later = layers.build("rwkv7", 32, head_size=8, layer_id=1, n_layers=2).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    shared = layers.ValueFirst()
    y = first(x, value_first=shared)
    torch.testing.assert_close(y, official_time_mix(first, x)[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(shared.values, official_time_mix(first, x)[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="^value_first: layer 1 of RWKV-7 mixes in the values of the model's layer 0"):
        later(x)
    with pytest.raises(ValueError, match=r"^value_first.values: expected \[2, 5, 32\]"):
        later(x, value_first=layers.ValueFirst(shared.values[:, :4]))
    plain = layers.build("rwkv7", 32, head_size=8, layer_id=1, n_layers=2, value_residual=False)
    assert not hasattr(plain, "v0") and plain(x.float()).shape == x.shape


def test_rwkv7_model_value_residual_is_the_written_out_two_layer_formula():
    """A two-layer rwkv7 LM against the blocks written out around the official time mixing: layer 1
    mixes in layer 0's values, in one pass, over a packed row, and decoding token by token."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="rwkv7", vocab_size=32, d_model=32, n_layers=2), verbose=False)
    model = model.double().eval()
    with torch.no_grad():  # trained-looking weights, so that the value residual's gate matters
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))

    def written_out(ids, residual=True):
        b0, b1 = model.backbone.blocks
        x = model.backbone.embedding(ids)
        y0, v_first = official_time_mix(b0.mixer, b0.norm1(x))
        x = x + y0
        x = x + b0.channel(b0.norm2(x))
        x = x + official_time_mix(b1.mixer, b1.norm1(x), v_first if residual else None)[0]
        x = x + b1.channel(b1.norm2(x))
        return model.logits(model.backbone.norm(x))

    ref = written_out(ids)
    assert rel_rms(written_out(ids, residual=False), ref) > 1e-3  # the residual changes the output
    err = rel_rms(model(ids), ref)
    packed = model(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 9, 18])).reshape(ref.shape)
    logits, state = model(ids[:, :4], return_state=True)
    steps = [logits]
    for t in range(4, 9):
        logits, state = model(ids[:, t : t + 1], state=state, return_state=True)
        steps.append(logits)
    errs = {"forward": err, "packed": rel_rms(packed, ref), "decode": rel_rms(torch.cat(steps, 1), ref)}
    print("rwkv7 two-layer model vs written out:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert max(errs.values()) < 1e-12, errs


def test_rwkv7_decay_is_the_official_soft_clamp():
    z = torch.linspace(-20, 20, 101, dtype=torch.float64)
    official = torch.exp(-torch.exp(-F.softplus(-z) - 0.5))
    torch.testing.assert_close(torch.exp(-math.exp(-0.5) * torch.sigmoid(z)), official, atol=1e-15, rtol=1e-13)


def test_rwkv7_operator_matches_fla_dplr_naive():
    naive = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    B, T, H, N = 2, 9, 3, 8
    r, k, v = (torch.randn(B, T, H, N, dtype=torch.float64) for _ in range(3))
    kk = F.normalize(torch.randn(B, T, H, N, dtype=torch.float64), dim=-1)
    a = torch.rand(B, T, H, N, dtype=torch.float64)
    log_w = -0.6 * torch.rand(B, T, H, N, dtype=torch.float64)
    ours, _ = eos_dplr(v, k, r, kk * a, kk, log_w)

    def bhtd(t):
        return t.transpose(1, 2).contiguous()

    # fla's naive scales q by K^-1/2 itself; RWKV-7 reads with scale 1, so r is pre-scaled. It
    # computes in float32 (and casts all but its alpha argument), so it gets float32 inputs.
    args = (bhtd(r) * N**0.5, bhtd(k), bhtd(v), bhtd(-kk), bhtd(kk * a), bhtd(log_w))
    ref, _ = naive.dplr_recurrence(*(t.float() for t in args), output_final_state=True)
    err = rel_rms(ours, ref.transpose(1, 2).double())
    print(f"relative RMS error {err:.2e}")
    assert err < 1e-5, err


def test_weight_decay_falls_on_the_projections_only():
    """As the official optimiser groups them: the linear layers' weights decay; the vectors, the
    norm and the LoRA factors (w1 ... g2, not named ".weight" officially) do not."""
    mixer = layers.build("rwkv7", 64)
    decayed = {n for n, p in mixer.named_parameters() if not getattr(p, "_no_weight_decay", False)}
    assert decayed == {"receptance.weight", "key.weight", "value.weight", "output.weight"}, decayed
