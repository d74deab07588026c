"""MetaLA: the explicit parallel form (appendix A3, eq. A28-A30 and A38) against the recurrent
mixer, and the ablation options' parameter sets."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from lcsm import layers
from lcsm.testing import assert_close, assert_matches_reference, decode, gradients

D_MODEL = 16


def make(**options):
    torch.manual_seed(0)
    m = layers.build("metala", D_MODEL, **options).double()
    with torch.no_grad():
        # w_aug and the gate bias start at zero; random values exercise every term.
        if m.self_augmentation:
            m.w_aug.normal_(0.0, 1.0)
        m.g_proj.bias.normal_(0.0, 0.5)
    return m


def inputs(B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64)


def parallel_form(m, x):
    """The MetaLA layer written as an attention map (eq. A28-A30, A38), independent of lcsm.ops:

        O = (((Q * A)(B / A)^T) * M) V + sigmoid(diag(sum(Q * B * W, dim=1)) V)

    A_t = prod_{j<=t} alpha_j, B_t = 1 - alpha_t (or the key), M the causal mask, W_t = w_aug,
    and the query of the map scaled by K^-1/2 (the official fla call). Eq. A38 writes the
    self-augmentation without the sigmoid that eq. A35 and the official code apply; we apply it.
    """
    B_, T, d = x.shape
    H, K, D = m.heads, m.key_dim, m.head_dim
    if m.use_conv:
        W = m.conv_size
        xc = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), m.conv1d.weight, groups=d)
        xc = F.silu(xc).transpose(1, 2)
    else:
        xc = x
    q = (xc @ m.q_proj.weight.T).view(B_, T, H, K)
    alpha = torch.sigmoid(xc @ m.decay_proj.weight.T).pow(1.0 / 16).view(B_, T, H, K)
    b = (xc @ m.k_proj.weight.T).view(B_, T, H, K) if m.use_key else 1 - alpha
    v = (xc @ m.v_proj.weight.T).view(B_, T, H, D)
    A = torch.cumprod(alpha, dim=1)
    att = torch.einsum("bthk,bshk->bhts", q * A * K**-0.5, b / A)
    att = att * torch.ones(T, T, dtype=torch.bool).tril()  # M: s <= t
    o = torch.einsum("bhts,bshd->bthd", att, v)
    if m.self_augmentation:
        diag = (q * b * m.w_aug.view(H, K)).sum(-1)  # [B, T, H]
        o = o + torch.sigmoid(diag.unsqueeze(-1) * v)
    o = F.layer_norm(o, (D,)).reshape(B_, T, d)
    gate = F.silu(xc @ m.g_proj.weight.T + m.g_proj.bias)
    return (gate * o) @ m.out_proj.weight.T


ABLATIONS = [
    {},
    {"self_augmentation": False},
    {"conv": False},
    {"use_key": True},
    {"heads": 2, "conv_size": 2},
]


@pytest.mark.parametrize("options", ABLATIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_parallel_form_equals_recurrent_mixer(options):
    """The forward (outputs, and the input's and every parameter's gradient) and the step loop."""
    m, x = make(**options), inputs()
    assert_matches_reference(m, x, lambda x: parallel_form(m, x), context=str(options))
    with torch.no_grad():
        assert_close({"recurrent": decode(m, x)[0]}, {"recurrent": parallel_form(m, x)}, context=str(options))


@pytest.mark.parametrize(
    "options",
    [*ABLATIONS, {"conv_size": 1}, {"conv_size": 6}],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default",
)
def test_packed_documents_equal_each_alone(options):
    """``cu_seqlens`` under every ablation and conv width (1: no history; 6: documents shorter
    than the window reach into their own history only): outputs, final states and the gradients
    of x, every parameter and the initial states equal each document run alone."""
    m = make(**options)
    cu = [0, 1, 4, 11, 12]
    N = len(cu) - 1
    x = inputs(B=1, T=cu[-1]).requires_grad_()
    with torch.no_grad():
        init = m(inputs(B=N, T=3, seed=2), return_state=True)[1]
    init = init.map(lambda t: t.detach().requires_grad_())
    y, final = m(x, state=init, return_state=True, cu_seqlens=torch.tensor(cu))
    alone = [
        m(x[:, a:b], state=init.map(lambda t, n=n: t[n : n + 1]), return_state=True)
        for n, (a, b) in enumerate(itertools.pairwise(cu))
    ]
    outs = {"y": y, **final.tensors()}
    refs = {"y": torch.cat([y_n for y_n, _ in alone], 1)}
    refs.update({k: torch.cat([f.tensors()[k] for _, f in alone]) for k in final.tensors()})
    wrt = {"x": x, **dict(m.named_parameters()), **{f"state.{k}": v for k, v in init.tensors().items()}}
    assert_close(gradients(outs, wrt), gradients(refs, wrt), dtype=torch.float64, context=str(options))


def test_self_augmentation_changes_only_the_current_token():
    """Eq. A35: the augmentation acts on o_t alone, never on the memory (section A3.2)."""
    m, x = make(), inputs()
    y1, with_aug = m(x, return_state=True)
    with torch.no_grad():
        m.w_aug.zero_()
    y0, without = m(x, return_state=True)
    assert_close({"memory": with_aug.memory}, {"memory": without.memory})
    assert (y1 - y0).abs().amax() > 1e-3


def param_count(m):
    return {n: p.numel() for n, p in m.named_parameters()}


def test_ablations_change_the_parameter_set():
    d, W = D_MODEL, 4
    base = param_count(make())
    # Section A3.1: q, decay (d x d/2 each), v, gate, out (d x d) = 4 d^2, like softmax attention;
    # plus the gate bias, w_aug (d/2) and the depthwise conv (d x W).
    assert sum(base.values()) == 4 * d * d + d + d // 2 + d * W
    assert base["conv1d.weight"] == d * W and base["w_aug"] == d // 2 and "k_proj.weight" not in base
    assert "conv1d.weight" not in param_count(make(conv=False))
    assert make(conv=False).init_state(2).conv is None
    assert "w_aug" not in param_count(make(self_augmentation=False))
    with_key = param_count(make(use_key=True))
    assert set(with_key) - set(base) == {"k_proj.weight"} and with_key["k_proj.weight"] == d * d // 2
    assert param_count(make(conv_size=2))["conv1d.weight"] == 2 * d


def test_recurrence_is_gla_row_decay_with_key_free_expand():
    """The memory after one token is (1 - alpha_1)^T v_1 per head (eq. A34 from m_0 = 0)."""
    m, x = make(conv=False), inputs(T=1)
    _, state = m(x, return_state=True)
    H, K, D = m.heads, m.key_dim, m.head_dim
    alpha = torch.sigmoid(x[:, 0] @ m.decay_proj.weight.T).pow(1.0 / 16).view(-1, H, K)
    v = (x[:, 0] @ m.v_proj.weight.T).view(-1, H, D)
    assert_close({"memory": state.memory}, {"memory": (1 - alpha).unsqueeze(-1) * v.unsqueeze(-2)})


@pytest.mark.parametrize(
    "options, match",
    [
        ({"heads": 3}, "heads"),
        ({"conv_size": 0}, "conv_size"),
        ({"conv": "yes"}, "conv"),
        ({"use_key": 1}, "use_key"),
    ],
)
def test_bad_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=f"^{match}:"):
        layers.build("metala", D_MODEL, **options)
