"""Config validation, parameter counts, per-layer mixer options and the presets."""

import pytest
import torch

from lcsm.models import HeadConfig, ModelConfig, build_model, preset

BASE = dict(mixer="gla", vocab_size=11, d_model=16, n_layers=2)


def test_unknown_keys_name_the_closest_valid_key():
    with pytest.raises(ValueError, match=r"'n_layer' \(did you mean 'n_layers'\?\)"):
        ModelConfig.from_dict({**BASE, "n_layer": 3})
    with pytest.raises(ValueError, match=r"'chanel_mixer' \(did you mean 'channel_mixer'\?\)"):
        build_model({**BASE, "chanel_mixer": "glu"})
    # the constructors too (the dataclass's own TypeError named the keyword alone)
    with pytest.raises(TypeError, match=r"ModelConfig: unknown field\(s\) 'n_layer' \(did you mean 'n_layers'\?\)"):
        ModelConfig(**BASE, n_layer=3)
    with pytest.raises(TypeError, match=r"HeadConfig: unknown field\(s\) 'n_clases' \(did you mean 'n_classes'\?\)"):
        HeadConfig(kind="classifier", n_clases=3)


def test_unknown_mixer_and_mixer_options_name_the_closest():
    with pytest.raises(ValueError, match="Did you mean gla"):
        ModelConfig(**{**BASE, "mixer": "glaa"})
    with pytest.raises(ValueError, match=r"'num_head' \(did you mean 'num_heads'\?\)"):
        ModelConfig(**{**BASE, "mixer_options": {"num_head": 2}})


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(d_model=0), "d_model"),
        (dict(n_layers=2.5), "n_layers"),
        (dict(norm="groupnorm"), "norm"),
        (dict(channel_mixer="swiglu"), "channel_mixer"),
        (dict(dropout=1.0), "dropout"),
        (dict(head={"kind": "seq2seq"}), "head.kind"),
        (dict(head={"kind": "classifier"}), "head.n_classes"),
        (dict(head={"kind": "classifier", "n_classes": 2, "pooling": "max"}), "head.pooling"),
        (dict(bidirectional=True), "bidirectional"),
        (dict(input_dim=3), "vocab_size / input_dim"),
        (dict(vocab_size=None, input_dim=3), "vocab_size"),  # lm needs tokens
        (dict(channel_mixer="none", channel_hidden=8), "channel_hidden"),
        (dict(head={"kind": "classifier", "n_classes": 2, "hidden": 1}), "head.hidden"),
        (dict(mixer="rwkv4", mixer_options={"layer_id": 1}), "set by the model"),
        (dict(mixer="ces", mixer_options={"bidirectional": True}), "set by the model"),
        (dict(head={"hidden": 64}), r"head.hidden: only for the classifier heads, got 64 with head.kind='lm'"),
        (
            dict(head={"pooling": "last"}),
            r"head.pooling: only for the classifier heads, got 'last' with head.kind='lm'",
        ),
        (dict(mixer_activation="gelu"), r"mixer_activation: acts between the mixer_hidden projections"),
        (
            dict(mixer="lcsm:1-9-1-0", mixer_options={"code": "0-0-0-0"}),
            r"mixer 'lcsm:1-9-1-0' sets code='1-9-1-0', got code='0-0-0-0'",
        ),
        (dict(tie_embeddings="yes"), "tie_embeddings"),
        (dict(head={"kind": "dual", "n_classes": 2, "combine": "sum"}), "head.combine"),
        (dict(embed_norm="yes"), "embed_norm"),
        (dict(head={"kind": "classifier", "n_classes": 2, "mlp": "mlp"}), "head.mlp"),
        (dict(head={"mlp": "etsmlp"}), r"head.mlp: only for the classifier heads, got 'etsmlp' with head.kind='lm'"),
    ],
)
def test_bad_values_fail_with_the_field_named(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**BASE, **changes})


def test_the_head_is_a_nested_config():
    cfg = ModelConfig.from_dict({**BASE, "head": {"kind": "classifier", "n_classes": 3, "hidden": 8}})
    assert cfg.head == HeadConfig(kind="classifier", n_classes=3, hidden=8)
    assert cfg.to_dict()["head"] == {
        "kind": "classifier",
        "n_classes": 3,
        "pooling": "mean",
        "hidden": 8,
        "combine": "nli",
        "mlp": "lra",
    }
    assert ModelConfig(**BASE, head=cfg.head) == cfg
    # A kind's name alone is shorthand for {kind: <name>}.
    assert ModelConfig.from_dict({**BASE, "head": "lm"}) == ModelConfig(**BASE)
    with pytest.raises(ValueError, match=r"model.head: unknown key\(s\) 'hiden' \(did you mean 'hidden'\?\)"):
        ModelConfig.from_dict({**BASE, "head": {"kind": "classifier", "n_classes": 3, "hiden": 8}})
    with pytest.raises(ValueError, match=r"model.head: expected a mapping of head fields or a head kind's name"):
        ModelConfig.from_dict({**BASE, "head": 3})
    # The constructor takes the typed head only: the spellings a file may use go through from_dict.
    with pytest.raises(ValueError, match=r"head: expected a HeadConfig"):
        ModelConfig(**BASE, head="lm")
    with pytest.raises(AttributeError):
        cfg.head.hidden = 16  # frozen: a change goes through replace


def test_the_old_flat_head_fields_are_read_as_the_nested_head():
    """Committed run configs and checkpoints spell the head flat at the model level."""
    old = {**BASE, "head": "dual", "n_classes": 2, "pooling": "last", "head_hidden": 8}
    old |= {"dual_combine": "concat", "head_mlp": "etsmlp"}
    nested = HeadConfig(kind="dual", n_classes=2, pooling="last", hidden=8, combine="concat", mlp="etsmlp")
    assert ModelConfig.from_dict(old).head == nested
    assert ModelConfig.from_dict({**BASE, "head": {"kind": "dual"}, "n_classes": 2}).head.n_classes == 2
    with pytest.raises(
        ValueError,
        match=r"model.head_hidden: the older spelling of model.head.hidden, and both are given "
        r"\(model.head_hidden: 8, model.head.hidden: 4\); give model.head.hidden alone",
    ):
        ModelConfig.from_dict({**BASE, "head": {"kind": "classifier", "n_classes": 2, "hidden": 4}, "head_hidden": 8})
    with pytest.raises(ValueError, match=r"model.n_classes: the older spelling of model.head.n_classes"):
        ModelConfig.from_dict({**BASE, "head": HeadConfig("classifier", 2), "n_classes": 2})
    # The old messages' checks hold under the new names.
    with pytest.raises(ValueError, match=r"head.hidden: only for the classifier heads, got 64 with head.kind='lm'"):
        ModelConfig.from_dict({**BASE, "head_hidden": 64})


def test_replace_changes_the_head_field_by_field():
    cfg = ModelConfig(**BASE, head=HeadConfig("classifier", n_classes=3))
    assert cfg.replace(head={"hidden": 8}).head == HeadConfig("classifier", n_classes=3, hidden=8)
    assert cfg.replace(head_hidden=8) == cfg.replace(head={"hidden": 8})
    assert cfg.replace(head="dual").head == HeadConfig("dual", n_classes=3)
    assert cfg.replace(head=HeadConfig("classifier", 5)).head == HeadConfig("classifier", 5)


def test_bad_mixer_option_values_fail_when_built():
    cfg = ModelConfig(**{**BASE, "mixer_options": {"num_heads": 3}})
    with pytest.raises(ValueError, match="num_heads"):
        build_model(cfg, verbose=False)


def test_round_trip_and_replace():
    cfg = ModelConfig(**BASE)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(n_layers=3).n_layers == 3
    with pytest.raises(ValueError, match="n_layers"):
        cfg.replace(n_layerz=3)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_count_is_the_sum_of_numel(tie, caplog):
    cfg = ModelConfig(**BASE, tie_embeddings=tie)
    with caplog.at_level("INFO", logger="lcsm.models"):
        model = build_model(cfg)
    unique = {id(p): p.numel() for p in model.parameters()}
    assert model.num_parameters() == sum(unique.values())
    emb = 11 * 16
    by_name = sum(p.numel() for _, p in model.named_parameters())
    assert model.num_parameters() == by_name
    assert (model.lm_head is None) == tie
    untied_extra = 0 if tie else emb
    blocks = sum(p.numel() for p in model.backbone.blocks.parameters())
    assert model.num_parameters() == emb + blocks + 2 * 16 + untied_extra  # + final LayerNorm
    assert f"{model.num_parameters():,} parameters" in caplog.text


def test_hgrn_gets_increasing_lower_bounds_and_rwkv_its_layer_position():
    model = build_model(ModelConfig(**{**BASE, "mixer": "hgrn", "n_layers": 4}), verbose=False)
    assert [b.mixer.lower_bound for b in model.backbone.blocks] == [0.0, 0.25, 0.5, 0.75]
    fixed = build_model(ModelConfig(**{**BASE, "mixer": "hgrn", "mixer_options": {"lower_bound": 0.3}}), verbose=False)
    assert [b.mixer.lower_bound for b in fixed.backbone.blocks] == [0.3, 0.3]
    rwkv = build_model(ModelConfig(**{**BASE, "mixer": "rwkv4", "n_layers": 3}), verbose=False)
    assert [(b.mixer.layer_id, b.mixer.n_layers) for b in rwkv.backbone.blocks] == [(0, 3), (1, 3), (2, 3)]


@pytest.fixture
def per_layer_mixer():
    """A mixer registered for one test only, whose options depend on its layer through the Mixer
    hooks alone: the model must honour them without naming it."""
    from lcsm.layers import base, register

    hgrn = base.resolve("hgrn")[0]

    class EveryOtherBound(hgrn):
        model_owned_options = ("lower_bound",)

        @classmethod
        def layer_options(cls, options, layer, n_layers):
            return {**options, "lower_bound": 0.5 * (layer % 2)}

    register("every-other-bound-test-only")(EveryOtherBound)
    yield "every-other-bound-test-only"
    del base._REGISTRY["every-other-bound-test-only"]


def test_a_new_mixer_sets_per_layer_options_through_the_hooks_alone(per_layer_mixer):
    model = build_model(ModelConfig(**{**BASE, "mixer": per_layer_mixer, "n_layers": 3}), verbose=False)
    assert [b.mixer.lower_bound for b in model.backbone.blocks] == [0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="mixer_options: lower_bound of mixer 'every-other-bound-test-only' are set"):
        ModelConfig(**{**BASE, "mixer": per_layer_mixer, "mixer_options": {"lower_bound": 0.1}})


def test_glu_default_width_and_model_owned_init():
    model = build_model(ModelConfig(**{**BASE, "d_model": 48}), verbose=False)
    glu = model.backbone.blocks[0].channel
    assert glu.up_proj.out_features == 128  # 8 * 48 / 3
    torch.manual_seed(0)
    big = build_model(ModelConfig(mixer="gla", vocab_size=4000, d_model=64, n_layers=1), verbose=False)
    assert abs(big.backbone.embedding.weight.std().item() - 0.02) < 1e-3


TINY = dict(d_model=16, n_layers=2)


@pytest.mark.parametrize(
    "name, task, kwargs",
    [
        ("etsmlp", "listops", dict(mixer_hidden=24)),
        ("etsmlp_gate", "retrieval", dict(mixer_hidden=24)),
        ("etsmlp", "image", dict(mixer_hidden=24)),
        ("metala_transformer", "text", dict(channel_hidden=32)),
        ("metala_transformer", None, dict(vocab_size=50, mixer_options=dict(heads=2))),
        ("lcsm_lm", None, dict(vocab_size=50, channel_hidden=32, mixer_options=dict(code="1-9-1-0", expand=8))),
        ("lra_encoder", "listops", dict(mixer="s4d", mixer_options=dict(d_state=8))),
        ("lra_encoder", "retrieval", dict(mixer="attention", mixer_options=dict(heads=2, positions="rotary"))),
    ],
)
def test_presets_build_and_run_at_tiny_width(name, task, kwargs):
    torch.manual_seed(0)
    extra = {} if task is None else {"task": task}
    cfg = preset(name, **extra, **TINY, **kwargs)
    model = build_model(cfg, verbose=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    if cfg.head.kind == "lm":
        out = model(ids)
        assert out.shape == (2, 12, cfg.vocab_size)
        assert model.generate([[1, 2, 3]], 3, temperature=0).shape == (1, 3)
    elif cfg.head.kind == "dual":
        out = model(ids, ids.flip(0))
        assert out.shape == (2, cfg.head.n_classes)
    else:
        out = model(ids)
        assert out.shape == (2, cfg.head.n_classes)
    assert torch.isfinite(out).all()
    out.sum().backward()


def test_preset_fields_follow_the_papers():
    ets = preset("etsmlp", task="listops")
    assert (ets.mixer, ets.channel_mixer, ets.mixer_hidden, ets.n_layers, ets.gate, ets.bidirectional) == (
        "ces",
        "none",
        160,
        12,
        False,
        True,
    )
    assert preset("etsmlp_gate", task="image").gate and preset("etsmlp", task="image").norm == "batchnorm"
    # (an override of the gate itself was a TypeError, "multiple values for keyword argument")
    assert preset("etsmlp_gate", gate=False) == preset("etsmlp")
    assert preset("etsmlp", task="retrieval").head.combine == "concat"
    meta = preset("metala_transformer", task="retrieval")
    assert (meta.n_layers, meta.d_model, meta.channel_hidden, meta.dropout, meta.head.kind) == (
        2,
        256,
        512,
        0.1,
        "dual",
    )
    with pytest.raises(ValueError, match="did you mean 'etsmlp'"):
        preset("etsmpl")
    with pytest.raises(ValueError, match="did you mean 'text'"):
        preset("etsmlp", task="texts")


def test_lcsm_lm_preset_matches_the_papers_parameter_count():
    model = build_model(preset("lcsm_lm"), verbose=False)
    # LCSM Tables 4-9 report 43.45M parameters for the 1-9-1-0 model.
    assert abs(model.num_parameters() / 43.45e6 - 1) < 0.005
