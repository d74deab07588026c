"""``eos_dplr`` against fla-core 0.6.0's pure-PyTorch references, one per member of the family.

Each test maps the reference's arguments onto eos_dplr's (i, e, s, a, b, log_alpha) and runs both
on the same values: ours in float64, theirs in the float32 they cast to, so the tolerance is
float32's. The mappings (docs/eos_dplr.md lists them with the scales):

    gated_delta_rule (GDN)  h <- a h; h += beta k (v - k^T h)^T
                            i = v, e = beta k, s = scale q, a = beta alpha k, b = k, log_alpha = g [B, T, H]
    kda                     per-row decay: a = beta k, b = exp(g) * k, e = beta k, log_alpha = g [B, T, H, K]
    comba                   GDN with the read key p: a = beta alpha k, b = p, e = beta k
    gated_delta_product     n micro-steps per token, k / v / beta [B, T n, H, .] token-major:
                            a = beta k (alpha beta k on the first), b = k, e = beta k ([B, T, H, n, K]),
                            log_alpha = g [B, T, H]
    generalized_delta_rule.dplr  S <- S exp(gk) + k v^T + beta (alpha^T S), head-major [B, H, T, .],
                            q scaled by K^-1/2: a = -beta, b = alpha, e = k, log_alpha = gk (RWKV-7's
                            chunk_rwkv7 is chunk_dplr_delta_rule with q = r, alpha = a, beta = b, gk = w)
    generalized_delta_rule.iplr  the same with no decay
    delta_rule              head-major, q scaled by K^-1/2: a = e = beta k, b = k
    gdn2                    S <- (I - k (b * k)^T) D(exp g) S + k (w * v)^T:
                            a = k, b = exp(g) * b * k, e = k, i = w * v, log_alpha = g [B, T, H, K]
"""

import pytest
import torch
from torch.nn.functional import logsigmoid, normalize

from lcsm.ops import eos_dplr
from lcsm.testing import assert_close

pytest.importorskip("fla")

B, T, H, K, V = 2, 19, 2, 8, 6
SCALE = K**-0.5


def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def common(seed=0):
    q, v = rnd(B, T, H, K, seed=seed), rnd(B, T, H, V, seed=seed + 1)
    k = normalize(rnd(B, T, H, K, seed=seed + 2), dim=-1)
    beta = torch.sigmoid(rnd(B, T, H, seed=seed + 3))
    m0 = rnd(B, H, K, V, seed=seed + 4)
    return q, k, v, beta, m0


def ours(i, e, s, a, b, log_alpha, m0):
    return eos_dplr(i, e, s, a, b, log_alpha, mode="chunk", chunk_size=8, initial_state=m0, output_final_state=True)


def compare(got, want, context):
    return assert_close(
        {"y": got[0], "m_T": got[1]}, {"y": want[0], "m_T": want[1]}, dtype=torch.float32, context=context
    )


def f32(*xs):
    return [x.float() for x in xs]


def test_gated_delta_rule():
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    q, k, v, beta, m0 = common()
    g = logsigmoid(rnd(B, T, H, seed=9) + 1)
    want = naive_recurrent_gated_delta_rule(
        *f32(q, k, v, beta, g), scale=SCALE, initial_state=m0.float(), output_final_state=True
    )
    bk = beta[..., None] * k
    got = ours(v, bk, SCALE * q, bk * g.exp()[..., None], k, g, m0)
    compare(got, want, "gated_delta_rule")


def test_kda():
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, beta, m0 = common(1)
    g = logsigmoid(rnd(B, T, H, K, seed=9) + 1)
    want = naive_recurrent_kda(*f32(q, k, v, g, beta), scale=SCALE, initial_state=m0.float(), output_final_state=True)
    bk = beta[..., None] * k
    got = ours(v, bk, SCALE * q, bk, g.exp() * k, g, m0)
    compare(got, want, "kda")


def test_comba():
    from fla.ops.comba.naive import naive_recurrent_comba

    q, k, v, beta, m0 = common(2)
    p = normalize(k + 0.3 * rnd(B, T, H, K, seed=8), dim=-1)
    g = logsigmoid(rnd(B, T, H, seed=9) + 1)
    want = naive_recurrent_comba(
        *f32(q, k, v, p, beta, g), scale=SCALE, initial_state=m0.float(), output_final_state=True
    )
    bk = beta[..., None] * k
    got = ours(v, bk, SCALE * q, bk * g.exp()[..., None], p, g, m0)
    compare(got, want, "comba")


@pytest.mark.parametrize("n", [2, 3])
def test_gated_delta_product(n):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    q, _, _, _, m0 = common(3)
    k = normalize(rnd(B, T * n, H, K, seed=5), dim=-1)
    v = rnd(B, T * n, H, V, seed=6)
    beta = 2 * torch.sigmoid(rnd(B, T * n, H, seed=7))  # beta in (0, 2): negative eigenvalues
    g = logsigmoid(rnd(B, T, H, seed=9) + 1)
    want = naive_recurrent_gated_delta_product(
        *f32(q, k, v, g, beta), scale=SCALE, initial_state=m0.float(), output_final_state=True, num_householder=n
    )

    def micro(x):  # [B, T n, H, .] token-major -> [B, T, H, n, .]
        return x.reshape(B, T, n, H, x.shape[-1]).transpose(2, 3)

    bk = micro(beta[..., None] * k)
    # The decay precedes the first factor: (I - a b^T) alpha = alpha I - (alpha a) b^T.
    first = torch.ones(B, T, H, n, 1, dtype=torch.float64)
    first[:, :, :, 0] = g.exp()[..., None]
    got = ours(micro(v), bk, SCALE * q, first * bk, micro(k), g, m0)
    compare(got, want, f"gated_delta_product n={n}")


def _rwkv7_like(seed):
    """RWKV-7's pair in fla's dplr arguments: alpha = -kappa_hat, beta = kappa_hat * a_gate."""
    q, k, v, _, m0 = common(seed)
    kappa = normalize(rnd(B, T, H, K, seed=seed + 10), dim=-1)
    gate = torch.sigmoid(rnd(B, T, H, K, seed=seed + 11))
    w = -0.6 * torch.sigmoid(rnd(B, T, H, K, seed=seed + 12)).exp()  # RWKV-7's log decay, in (-1.6, -0.6)
    hm = [x.transpose(1, 2) for x in (q, k, v, -kappa, kappa * gate, w)]
    return q, k, v, -kappa, kappa * gate, w, m0, hm


def test_generalized_delta_rule_dplr():
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    q, k, v, alpha, beta, w, m0, hm = _rwkv7_like(4)
    o, S = dplr_recurrence(*f32(*hm), initial_state=m0.float(), output_final_state=True)
    got = ours(v, k, SCALE * q, -beta, alpha, w, m0)
    compare(got, (o.transpose(1, 2), S), "dplr")


def test_generalized_delta_rule_iplr():
    from fla.ops.generalized_delta_rule.iplr.naive import iplr_recurrence

    q, k, v, alpha, beta, _, m0, hm = _rwkv7_like(5)
    o, S = iplr_recurrence(*f32(*hm[:5]), initial_state=m0.float(), output_final_state=True)
    got = ours(v, k, SCALE * q, -beta, alpha, None, m0)
    compare(got, (o.transpose(1, 2), S), "iplr")


def test_delta_rule():
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    q, k, v, beta, m0 = common(6)
    o, S = delta_rule_recurrence(
        *f32(*(x.transpose(1, 2) for x in (q, k, v, beta))), initial_state=m0.float(), output_final_state=True
    )
    bk = beta[..., None] * k
    got = ours(v, bk, SCALE * q, bk, k, None, m0)
    compare(got, (o.transpose(1, 2), S), "delta_rule")


def test_gdn2():
    from fla.ops.gdn2.naive import naive_recurrent_gdn2

    q, k, v, _, m0 = common(7)
    g = logsigmoid(rnd(B, T, H, K, seed=9) + 1)
    erase = torch.sigmoid(rnd(B, T, H, K, seed=10))
    write = torch.sigmoid(rnd(B, T, H, V, seed=11))
    want = naive_recurrent_gdn2(
        *f32(q, k, v, g, erase, write), scale=SCALE, initial_state=m0.float(), output_final_state=True
    )
    got = ours(write * v, k, SCALE * q, k, g.exp() * erase * k, g, m0)
    compare(got, want, "gdn2")
