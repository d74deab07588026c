"""The bidirectional encoder: non-causal, equal to the MNet sum of a forward prefix map and a
backward suffix map evaluated position by position, and blind to right padding."""

import pytest
import torch

from lcsm.layers import build
from lcsm.models import Bidirectional, HeadConfig, ModelConfig, build_model, preset, reverse_valid
from lcsm.testing import assert_close

D = 16


def x_of(B, T, seed=0):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("mixer", ["gla", "mamba", "hgrn"])
def test_bidirectional_equals_prefix_plus_suffix_maps(mixer):
    torch.manual_seed(0)
    f, g = build(mixer, D).double(), build(mixer, D).double()
    bi = Bidirectional(f, g)
    x = x_of(2, 7)
    y = bi(x)
    T = x.shape[1]
    zero = torch.zeros(2, 1, D, dtype=torch.float64)
    rows = []
    for m in range(T):
        prefix = f(x[:, : m + 1])[:, -1]
        # g reads a zero vector, then x_{T-1}, ..., x_{m+1} (the suffix after m, reversed).
        suffix_seq = torch.cat([zero, x[:, m + 1 :].flip(1)], dim=1)
        rows.append(prefix + g(suffix_seq)[:, -1])
    assert_close({"y": y}, {"y": torch.stack(rows, 1)}, context=mixer)


def test_bidirectional_is_non_causal_and_forward_only_is_causal():
    torch.manual_seed(0)
    bi = Bidirectional(build("gla", D), build("gla", D)).double()
    x = x_of(1, 8)
    x2 = x.clone()
    x2[:, -1] += 1.0
    assert (bi(x2)[:, 0] - bi(x)[:, 0]).abs().max() > 1e-6
    assert torch.equal(bi.forward_map(x2)[:, :-1], bi.forward_map(x)[:, :-1])


def test_reverse_valid_keeps_padding_at_the_end():
    x = torch.arange(10.0).view(2, 5, 1)
    r = reverse_valid(x, torch.tensor([3, 5]))
    assert r[..., 0].tolist() == [[2, 1, 0, 3, 4], [9, 8, 7, 6, 5]]
    assert torch.equal(reverse_valid(r, torch.tensor([3, 5])), x)


@pytest.mark.parametrize("mixer", ["gla", "ces"])
def test_bidirectional_classifier_is_non_causal(mixer):
    torch.manual_seed(0)
    cfg = ModelConfig(
        mixer=mixer,
        vocab_size=11,
        d_model=D,
        n_layers=2,
        head=HeadConfig("classifier", n_classes=3, pooling="last"),
        bidirectional=True,
    )
    model = build_model(cfg, verbose=False).double()
    if mixer == "ces":
        assert model.backbone.blocks[0].mixer.bidirectional  # the native two-sided kernel
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))
    hidden = model.backbone(ids)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % 11
    assert (model.backbone(ids2)[:, 0] - hidden[:, 0]).abs().max() > 1e-6


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("mixer", ["gla", "ces", "etsmlp preset"])
def test_bidirectional_classifier_ignores_right_padding(mixer, pooling):
    """Two causal maps reverse within each length; CES's native two-sided kernel (and the ETSMLP
    preset built on it) reads padded positions as zeros, as the official CETS masks them."""
    torch.manual_seed(0)
    if mixer == "etsmlp preset":
        cfg = preset(
            "etsmlp", task="text", vocab_size=11, d_model=D, mixer_hidden=D, n_layers=2, head={"pooling": pooling}
        )
    else:
        cfg = ModelConfig(
            mixer=mixer,
            vocab_size=11,
            d_model=D,
            n_layers=2,
            head=HeadConfig("classifier", n_classes=3, pooling=pooling),
            bidirectional=True,
        )
    model = build_model(cfg, verbose=False).double().eval()
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 1]]
    alone = torch.cat([model(torch.tensor([s])) for s in seqs])
    padded = torch.full((3, 6), 5)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    for b, s in enumerate(seqs):
        padded[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
    assert_close({"logits": model(padded, mask=mask)}, {"logits": alone})
    assert_close({"logits": model(padded, lengths=mask.sum(1))}, {"logits": alone})


def test_bidirectional_has_no_state():
    cfg = ModelConfig(
        mixer="gla",
        vocab_size=11,
        d_model=D,
        n_layers=1,
        head=HeadConfig("classifier", n_classes=2),
        bidirectional=True,
    )
    model = build_model(cfg, verbose=False)
    with pytest.raises(ValueError, match="no recurrent state"):
        model.backbone(torch.zeros(1, 3, dtype=torch.long), return_state=True)
