"""A causal LM over packed documents equals each document alone, and over padded rows equals each
row alone (padding on either side is as if absent)."""

import pytest
import torch

from lcsm.models import HeadConfig, ModelConfig, build_model
from lcsm.testing import assert_close

# One mixer of each way a mixer serves cu_seqlens: the EOS operator (with a short convolution and
# with a token shift), the delta rule, an FFT convolution and softmax attention; and RWKV-7, whose
# layer 1 reads layer 0's values (ValueFirst).
MIXERS = ["gla", "mamba", "rwkv4", "fwp", "s4d", "attention", "rwkv7"]


def lm(mixer):
    torch.manual_seed(0)
    config = ModelConfig(mixer=mixer, vocab_size=32, d_model=16, n_layers=2)
    return build_model(config, verbose=False).double().eval()


def ids(*shape, seed=1):
    return torch.randint(0, 32, shape, generator=torch.Generator().manual_seed(seed))


def rows(states, n):
    """Row n of every layer's state: one document's (or one padded row's) state."""
    return [s.map(lambda t: t[n : n + 1]) for s in states]


@pytest.mark.parametrize("mixer", MIXERS)
def test_packed_documents_equal_each_document_alone(mixer):
    model = lm(mixer)
    bounds = [0, 1, 8, 9, 20]
    x = ids(1, bounds[-1])
    logits, states = model(x, return_state=True, cu_seqlens=torch.tensor(bounds))
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        ref, ref_states = model(x[:, a:b], return_state=True)
        assert_close({"logits": logits[:, a:b]}, {"logits": ref}, context=f"{mixer} document {n}")
        more = ids(1, 3, seed=10 + n)
        assert_close(
            {"next": model(more, state=rows(states, n))},
            {"next": model(more, state=ref_states)},
            context=f"{mixer} document {n} continued",
        )


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_padded_rows_equal_each_row_alone(mixer, side):
    model = lm(mixer)
    lengths, T = [7, 3, 1], 7
    x = ids(len(lengths), T)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, L in enumerate(lengths):
        mask[b, T - L :] = 1 if side == "left" else 0
        if side == "right":
            mask[b, :L] = 1
    logits, states = model(x, return_state=True, attention_mask=mask)
    for b in range(len(lengths)):
        keep = mask[b].bool()
        ref, ref_states = model(x[b : b + 1, keep], return_state=True)
        assert_close({"logits": logits[b : b + 1, keep]}, {"logits": ref}, context=f"{mixer} {side} row {b}")
        more = ids(1, 2, seed=20 + b)
        assert_close(
            {"next": model(more, state=rows(states, b))},
            {"next": model(more, state=ref_states)},
            context=f"{mixer} {side} row {b} continued",
        )


def test_mask_and_cu_seqlens_together_are_refused():
    with pytest.raises(ValueError, match="either cu_seqlens"):
        lm("gla")(ids(1, 5), cu_seqlens=torch.tensor([0, 2, 5]), attention_mask=torch.ones(1, 5))


def test_a_row_of_only_padding_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        lm("gla")(ids(2, 5), attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]))


def test_packing_a_bidirectional_model_is_refused():
    config = ModelConfig(
        mixer="gla",
        vocab_size=32,
        d_model=16,
        n_layers=1,
        bidirectional=True,
        head=HeadConfig("classifier", n_classes=2),
    )
    model = build_model(config, verbose=False)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences are for causal models"):
        model.backbone(ids(1, 5), cu_seqlens=torch.tensor([0, 2, 5]))
