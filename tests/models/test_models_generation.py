"""Recurrent generation of the causal LM: prefill + steps == full forward, generate == greedy by
full forward passes, ragged and padded batches == one prompt at a time."""

import pytest
import torch

from lcsm.models import ModelConfig, build_model, sample_next
from lcsm.testing import assert_close

VOCAB = 13
MIXERS = ["gla", "metala", "mamba", "attention", "ces", "lcsm", "rwkv4", "hgrn", "retnet", "s4d", "rwkv7"]


def make_lm(mixer, **fields):
    torch.manual_seed(0)
    cfg = ModelConfig(mixer=mixer, vocab_size=VOCAB, d_model=16, n_layers=2, **fields)
    model = build_model(cfg, verbose=False).double().eval()
    # Sharper logits than the 0.02 init gives, so greedy choices are not near-ties.
    with torch.no_grad():
        model.backbone.embedding.weight.mul_(50)
    return model


def tokens(B, T, seed=1):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("mixer", MIXERS)
def test_prefill_then_steps_equals_full_forward(mixer):
    model, x = make_lm(mixer), tokens(2, 9)
    full = model(x)
    logits, state = model(x[:, :5], return_state=True)
    pieces = [logits]
    for t in range(5, 9):
        logits, state = model(x[:, t : t + 1], state=state, return_state=True)
        pieces.append(logits)
    assert_close({"logits": torch.cat(pieces, 1)}, {"logits": full}, context=mixer)
    # A carried state from init_state is the same as no state.
    from_zero, _ = model(x, state=model.init_state(2), return_state=True)
    assert_close({"logits": from_zero}, {"logits": full}, context=mixer)


@pytest.mark.parametrize("mixer", MIXERS)
def test_generate_greedy_matches_full_forward_and_ragged_batch(mixer):
    model = make_lm(mixer)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2]]
    n = 6
    expected = [greedy_by_full_forward(model, p, n) for p in prompts]
    batched = model.generate(prompts, n, temperature=0)
    assert batched.shape == (3, n)
    assert batched.tolist() == expected, mixer
    one_by_one = [model.generate([p], n, temperature=0)[0].tolist() for p in prompts]
    assert one_by_one == expected
    # Right-padded tensor + lengths is the same request.
    padded = torch.full((3, 6), 12)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = torch.tensor(p)
    assert model.generate(padded, n, temperature=0, lengths=torch.tensor([3, 2, 6])).tolist() == expected


def pad_prompts(prompts, T, side, pad=12):
    """Prompts padded to T on one side (as a tokenizer with that padding_side) and their mask."""
    ids = torch.full((len(prompts), T), pad)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        where = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[b, where], mask[b, where] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mixer", MIXERS)
def test_padded_batch_with_attention_mask_equals_each_prompt_alone(mixer, side):
    model = make_lm(mixer)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2], [3]]
    n = 5
    alone = [model.generate([p], n, temperature=0)[0].tolist() for p in prompts]
    ids, mask = pad_prompts(prompts, 7, side)
    assert model.generate(ids, n, temperature=0, attention_mask=mask).tolist() == alone, f"{mixer} {side}"


@pytest.mark.parametrize("mixer", ["gla", "retnet", "mamba", "attention"])
def test_left_padded_sampling_draws_as_the_ragged_list(mixer):
    """The same generator seed gives the same samples whether the prompts come left-padded with a
    mask or as a list (one packed prefill, the same draws), and one left-padded prompt samples as
    that prompt alone."""
    model = make_lm(mixer)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2]]
    ids, mask = pad_prompts(prompts, 6, "left")

    def sample(*args, **kwargs):
        return model.generate(*args, 6, temperature=1.5, top_k=8, generator=torch.Generator().manual_seed(7), **kwargs)

    assert torch.equal(sample(ids, attention_mask=mask), sample(prompts))
    assert torch.equal(sample(ids[1:2], attention_mask=mask[1:2]), sample([prompts[1]]))


def test_generate_padding_arguments_are_checked():
    model = make_lm("gla")
    ids, mask = pad_prompts([[1, 2, 3], [4]], 3, "left", pad=-100)
    # ids at the padding are never read, whatever they are
    assert model.generate(ids, 2, temperature=0, attention_mask=mask).tolist() == [
        model.generate([p], 2, temperature=0)[0].tolist() for p in ([1, 2, 3], [4])
    ]
    with pytest.raises(ValueError, match="lengths / attention_mask: give one of them"):
        model.generate(ids, 2, attention_mask=mask, lengths=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="attention_mask: only for a padded"):
        model.generate([[1, 2]], 2, attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"attention_mask: expected \[B, T\] = \[2, 3\]"):
        model.generate(ids, 2, attention_mask=mask[:, :2])
    with pytest.raises(ValueError, match="attention_mask: every row needs at least one token"):
        model.generate(ids, 2, attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))
    # an integer mask of other values is no mask (a 2 had been read as a token)
    for bad in (torch.tensor([[1, 1, 2], [0, 0, 1]]), torch.tensor([[1, 1, 1], [-1, 0, 1]]), mask * 0.5):
        with pytest.raises(ValueError, match=r"attention_mask: expected 0 \(padding\) and 1 \(token\) entries only"):
            model.generate(ids, 2, attention_mask=bad)


def test_generate_state_does_not_grow_and_restores_train_mode():
    model = make_lm("gla")
    _, state = model(tokens(1, 4), return_state=True)
    sizes = [sum(t.numel() for t in s.tensors().values()) for s in state]
    for t in range(20):
        _, state = model(tokens(1, 1, seed=t), state=state, return_state=True)
    assert [sum(t.numel() for t in s.tensors().values()) for s in state] == sizes
    model.train()
    model.generate([[1, 2]], 2, temperature=0)
    assert model.training
    # each module's own mode: norms held in eval while the rest trains stay so (all were trained)
    for block in model.backbone.blocks:
        block.norm1.eval()
    model.generate([[1, 2]], 2, temperature=0)
    assert model.training and not any(b.norm1.training for b in model.backbone.blocks)


def test_sampling_options():
    torch.manual_seed(0)
    logits = torch.randn(4, 10, dtype=torch.float64)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, 0.0), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_k=1), greedy)
    assert torch.equal(sample_next(logits, 1.0, top_p=1e-6), greedy)
    # top_k = 3: every sample is one of the 3 best tokens of its row.
    top3 = logits.topk(3, -1).indices
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        s = sample_next(logits, 2.0, top_k=3, generator=g)
        assert bool((top3 == s[:, None]).any(-1).all())
    # top_p: the kept set is the smallest prefix of the ranking reaching p.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    seen = {int(sample_next(probs.log(), 1.0, top_p=0.7, generator=g)) for _ in range(200)}
    assert seen == {0, 1}
    # a tiny temperature is all but greedy (the logits divided by it overflowed to inf: an error)
    assert torch.equal(sample_next(logits, 1e-40), greedy)
    # Same generator seed, same samples.
    model = make_lm("gla")
    a = model.generate([[1, 2, 3]], 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = model.generate([[1, 2, 3]], 5, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
        (dict(max_new_tokens=2, temperature=float("inf")), "temperature: expected a finite number"),
        (dict(max_new_tokens=2, top_k=0), "top_k"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p"),
    ],
)
def test_generate_rejects_bad_arguments(kwargs, match):
    model = make_lm("gla")
    with pytest.raises(ValueError, match=match):
        model.generate([[1, 2]], **kwargs)


def test_generate_rejects_bad_prompts():
    model = make_lm("gla")
    with pytest.raises(ValueError, match="input_ids"):
        model.generate([[1, 2], []], 2)
    with pytest.raises(ValueError, match="lengths"):
        model.generate(torch.tensor([[1, 2]]), 2, lengths=torch.tensor([3]))
    # not rounded or read as 1 (2.5 ran as 3, True as 1)
    for lengths in ([2.5], torch.tensor([True])):
        with pytest.raises(ValueError, match=r"lengths: expected \[B\] = \[1\] integers"):
            model.generate(torch.tensor([[1, 2, 3]]), 2, lengths=lengths)
    with pytest.raises(ValueError, match="input_ids: expected integer token ids, got torch.float32"):
        model.generate([[1, 2], [1.7, 2.2]], 2)
    # a mask as a nested list, as the lengths may be
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]])
    assert torch.equal(
        model.generate(ids, 2, temperature=0, attention_mask=[[0, 1, 1], [1, 1, 1]]),
        model.generate(ids, 2, temperature=0, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]])),
    )


def test_token_ids_outside_the_vocabulary_are_named():
    model = make_lm("gla")
    V = model.config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids: token ids must lie in \[0, vocab_size={V}\), got {V + 3}"):
        model(torch.tensor([[1, 2, V + 3]]))
    with pytest.raises(ValueError, match=r"got -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match=rf"vocab_size={V}\), got {V}"):
        model.generate([[1, V]], 2)


def test_the_id_check_is_no_graph_break():
    """The check's bool() is eager only: a compiled model is one graph (run.compile traces the
    forward of every step)."""
    model = make_lm("attention")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids), model(ids))


def test_attention_learned_positions_through_mixer_options():
    model = make_lm("attention", mixer_options=dict(positions="learned", max_len=12))
    prompts = [[1, 2, 3], [4, 5]]
    assert model.generate(prompts, 4, temperature=0).tolist() == [greedy_by_full_forward(model, p, 4) for p in prompts]


def test_vocab_size_keeps_samples_among_the_data_ids():
    """A model with more ids than its data (padding rows) samples among the data's ids only when
    told their number (``lcsm generate`` passes the task's)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="gla", vocab_size=VOCAB, d_model=16, n_layers=2), verbose=False).eval()
    g = torch.Generator().manual_seed(3)
    free = model.generate([[1, 2, 3]], 40, generator=g)
    assert int(free.max()) >= 5  # unrestricted, it samples beyond
    kept = model.generate([[1, 2, 3]], 40, generator=g, vocab_size=5)
    assert int(kept.max()) < 5
    assert (
        model.generate([[1, 2, 3]], 4, temperature=0, vocab_size=VOCAB).tolist()
        == model.generate([[1, 2, 3]], 4, temperature=0).tolist()
    )
    for bad in (0, VOCAB + 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"^vocab_size: expected None or an integer in \[1, {VOCAB}\]"):
            model.generate([[1]], 1, vocab_size=bad)


def test_forward_returns_the_states_only_when_asked_as_a_mixer_does():
    model = make_lm("gla")
    ids = torch.tensor([[1, 2, 3]])
    state = model.init_state(1)
    assert isinstance(model(ids, state=state), torch.Tensor)
    logits, states = model(ids, state=state, return_state=True)
    assert torch.equal(logits, model(ids, state=state)) and len(states) == len(state)
