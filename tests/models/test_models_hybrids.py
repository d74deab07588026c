"""Hybrid stacks: a mixer per layer (a list or a pattern) with options per mixer or per layer,
validated at build; a single name unchanged (bit-identical); generation with recurrent states
and KV caches together == greedy by full forwards, ragged and left-padded; the hybrid presets."""

import pytest
import torch

from lcsm.engine.sweep.reuse import _equivalence_key
from lcsm.layers.attention import Attention
from lcsm.layers.gla import GLA
from lcsm.layers.mamba import Mamba
from lcsm.models import ModelConfig, build_model, model_revisions, preset
from lcsm.models.config import expand_mixers
from lcsm.testing import assert_close

VOCAB = 13
# Mamba and GLA recurrences with a windowed and a full KV cache, options per mixer name as written
# ("mha", an alias of attention, is its own entry).
HYBRID = dict(
    mixer=["mamba", "attention", "gla", "mha"],
    mixer_options={"attention": {"window": 3, "positions": "rotary", "heads": 2}, "gla": {"num_heads": 2}},
)


def make_lm(**fields):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**dict(vocab_size=VOCAB, d_model=16, n_layers=4), **fields})
    model = build_model(cfg, verbose=False).double().eval()
    with torch.no_grad():  # sharper logits than the 0.02 init, so greedy choices are not near-ties
        model.backbone.embedding.weight.mul_(50)
    return model


def greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_patterns_expand_per_layer():
    assert expand_mixers("gla", 3) == ["gla"] * 3
    assert expand_mixers({"default": "mamba", "every": {"k": 4, "mixer": "attention", "offset": 3}}, 8) == [
        "mamba", "mamba", "mamba", "attention"
    ] * 2  # fmt: skip
    # offset defaults to k - 1; later rules win where they meet
    rules = {"default": "gla", "every": [{"k": 2, "mixer": "mamba"}, {"k": 3, "mixer": "attention", "offset": 0}]}
    assert expand_mixers(rules, 6) == ["attention", "mamba", "gla", "attention", "gla", "mamba"]
    cfg = ModelConfig(mixer={"default": "mamba", "every": {"k": 4, "mixer": "attention"}}, n_layers=8, vocab_size=VOCAB)
    assert cfg.stack_summary() == "3 x mamba, attention, 3 x mamba, attention"
    assert ModelConfig(mixer="gla", n_layers=2, vocab_size=VOCAB).stack_summary() == "2 x gla"


def test_layers_get_their_mixer_and_options():
    model = make_lm(**HYBRID)
    kinds = [type(b.mixer) for b in model.backbone.blocks]
    assert kinds == [Mamba, Attention, GLA, Attention]
    attn = model.backbone.blocks[1].mixer
    assert (attn.window, attn.positions, attn.heads) == (3, "rotary", 2)
    assert model.backbone.blocks[3].mixer.window is None
    per_layer = make_lm(mixer=HYBRID["mixer"], mixer_options=[{}, {"window": 2}, {}, {}])
    assert [getattr(b.mixer, "window", "-") for b in per_layer.backbone.blocks] == ["-", 2, "-", None]


def test_a_single_name_is_unchanged_and_a_list_of_it_builds_the_same_model():
    one, listed = make_lm(mixer="gla"), make_lm(mixer=["gla"] * 4)
    assert one.config.to_dict()["mixer"] == "gla" and not one.config.hybrid
    sa, sb = one.state_dict(), listed.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = torch.randint(0, VOCAB, (2, 9))
    assert torch.equal(one(x), listed(x))

    def run(**model):
        return {"task": {"name": "mqar"}, "model": {"n_layers": 4, **model}, "train": {"max_steps": 4}}

    assert _equivalence_key(run(mixer="gla")) == _equivalence_key(run(mixer=["gla"] * 4))
    # A pattern and the list it expands to train the same weights; options per name or per layer too.
    pattern = {"default": "gla", "every": {"k": 2, "mixer": "attention"}}
    assert _equivalence_key(run(mixer=pattern, mixer_options={"attention": {"window": 2}})) == _equivalence_key(
        run(mixer=["gla", "attention"] * 2, mixer_options=[{}, {"window": 2}, {}, {"window": 2}])
    )
    assert _equivalence_key(run(mixer=pattern)) != _equivalence_key(run(mixer=["attention", "gla"] * 2))


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(mixer=["gla", "mamba"]),
            r"mixer: a list gives one mixer per layer: expected 4 names \(n_layers\), got 2",
        ),
        (dict(mixer=["gla", "mamba", "atention", "gla"]), r"unknown mixer 'atention'. Did you mean attention"),
        (dict(mixer={"default": "gla", "evry": {}}), r"mixer: unknown key\(s\) 'evry'"),
        (dict(mixer={"every": {"k": 2, "mixer": "gla"}}), r"mixer.default: a mixer pattern needs"),
        (dict(mixer={"default": "gla", "every": {"k": 2, "mixer": "gla", "offset": 2}}), r"offset: expected 0 <="),
        (dict(mixer={"default": "gla", "every": {"k": 0, "mixer": "gla"}}), r"mixer.every\[0\].k: expected an integer"),
        (dict(mixer=["gla"] * 4, mixer_options={"mamba": {}}), r"'mamba' not in the stack \(mixers: gla\)"),
        (dict(mixer=["gla"] * 4, mixer_options=[{}]), r"expected 4 mappings \(n_layers\), got 1"),
        (dict(mixer=["gla", "attention"] * 2, mixer_options={"attention": {"windw": 2}}), r"has no option.*windw"),
        (dict(mixer=["gla", "attention"] * 2, mixer_options={"attention": {"window": 0}}), r"window: expected"),
        (dict(mixer=7), r"mixer: expected a registered mixer name, a list"),
        # RWKV-7's value residual reads layer 0's values: refused when nothing would make them
        (
            dict(mixer=["gla", "rwkv7"] * 2),
            r"layer 1's 'rwkv7' mixes in layer 0's values \(value_residual\), but layer 0's mixer 'gla' makes none",
        ),
        (
            dict(mixer="rwkv7", head={"kind": "classifier", "n_classes": 2}, bidirectional=True),
            r"layer 1's 'rwkv7' mixes in layer 0's values .* a bidirectional model passes no values",
        ),
    ],
)
def test_bad_stacks_are_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        build_model(ModelConfig(**{**dict(vocab_size=VOCAB, d_model=16, n_layers=4), **fields}), verbose=False)


def test_rwkv7_without_its_value_residual_follows_any_layer_0():
    options = {"rwkv7": {"value_residual": False}}
    model = build_model(
        ModelConfig(mixer=["gla", "rwkv7"] * 2, mixer_options=options, vocab_size=VOCAB, d_model=16, n_layers=4),
        verbose=False,
    )
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, VOCAB)


def test_revisions_name_every_mixer_of_the_stack():
    revisions = model_revisions({"mixer": HYBRID["mixer"], "n_layers": 4, "mixer_options": HYBRID["mixer_options"]})
    assert set(revisions) == {"mixer:mamba", "mixer:attention", "mixer:gla"}
    assert model_revisions({"mixer": "gla"}) == {"mixer:gla": 1}


def test_prefill_then_steps_equals_full_forward():
    model = make_lm(**HYBRID)
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    full = model(x)
    logits, state = model(x[:, :5], return_state=True)
    pieces = [logits]
    for t in range(5, 11):
        logits, state = model(x[:, t : t + 1], state=state, return_state=True)
        pieces.append(logits)
        assert state[1].keys.shape[2] <= 2 and state[3].keys.shape[2] == t + 1  # window 3; full cache
    assert_close({"logits": torch.cat(pieces, 1)}, {"logits": full})


def test_generate_equals_greedy_by_full_forward_ragged_and_left_padded():
    model = make_lm(**HYBRID)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2], [3]]
    n = 6
    expected = [greedy_by_full_forward(model, p, n) for p in prompts]
    assert model.generate(prompts, n, temperature=0).tolist() == expected
    ids, mask = torch.full((4, 7), 12), torch.zeros(4, 7, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 7 - len(p) :], mask[b, 7 - len(p) :] = torch.tensor(p), 1
    assert model.generate(ids, n, temperature=0, attention_mask=mask).tolist() == expected


TINY = dict(d_model=16, n_layers=4, vocab_size=VOCAB, head_dim=8)


@pytest.mark.parametrize("name", ["samba", "jamba"])
def test_hybrid_presets_build_generate_and_follow_their_papers(name):
    cfg = preset(name, **TINY, **({"every": 2, "offset": 1} if name == "jamba" else {}))
    assert cfg.hybrid and cfg.norm == "rmsnorm" and cfg.channel_mixer == "glu"
    torch.manual_seed(0)
    model = build_model(cfg, verbose=False).double().eval()
    kinds = [type(b.mixer) for b in model.backbone.blocks]
    assert kinds == [Mamba, Attention, Mamba, Attention]
    assert model.generate([[1, 2, 3]], 3, temperature=0).tolist() == [greedy_by_full_forward(model, [1, 2, 3], 3)]
    full = preset(name)
    layers = [n for n, _ in full.layer_mixers()]
    if name == "samba":  # Mamba and SWA (window 2048, RoPE) alternating
        assert layers == ["mamba", "attention"] * 9 and full.layer_mixers()[1][1]["window"] == 2048
        # the official Samba_1.3B: d 2304, 18 heads of width 128, SwiGLU width 6144
        assert (full.d_model, full.layer_mixers()[1][1]["heads"], full.resolved_channel_hidden()) == (2304, 18, 6144)
    else:  # one attention layer per 8, at offset 4 (a : m = 1 : 7)
        assert layers == (["mamba"] * 4 + ["attention"] + ["mamba"] * 3) * 4


@pytest.mark.parametrize(
    "name, fields, match",
    [
        ("jamba", dict(n_layers=4), r"jamba: attention every 8 layers from layer 4 needs .* got n_layers=4"),
        ("qwen3_next", dict(n_layers=3), r"qwen3_next: attention every 4 layers from layer 3 .* n_layers=3"),
        ("samba", dict(n_layers=1), r"samba: attention every 2 layers from layer 1 .* n_layers=1"),
        ("jamba", dict(every=2, offset=2), r"needs 0 <= offset < every .* every=2, offset=2"),
        ("samba", dict(head_dim=0), r"head_dim: expected an integer >= 1, got 0"),
        ("jamba", dict(head_dim=-4), r"head_dim: expected an integer >= 1, got -4"),
    ],
)
def test_hybrid_presets_refuse_a_stack_without_attention_by_name(name, fields, match):
    """A depth below the first attention layer failed as options of a mixer "not in the stack"."""
    with pytest.raises(ValueError, match=match):
        preset(name, **{**dict(d_model=32, head_dim=16), **fields})


def test_jamba_puts_its_attention_halfway_through_each_group_by_default():
    assert preset("jamba", **{**TINY, "n_layers": 8}, every=4).mixer["every"]["offset"] == 2
    assert preset("jamba").mixer["every"] == {"k": 8, "mixer": "attention", "offset": 4}


def test_qwen3_next_preset_builds_with_gated_deltanet():
    cfg = preset("qwen3_next", **TINY)
    assert [n for n, _ in cfg.layer_mixers()] == ["gated_deltanet"] * 3 + ["attention"]
    model = build_model(cfg, verbose=False).double().eval()
    assert model.generate([[1, 2, 3]], 3, temperature=0).tolist() == [greedy_by_full_forward(model, [1, 2, 3], 3)]
