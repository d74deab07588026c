"""Heads, pooling, the ETSMLP block equations, weight-decay groups and the block options."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lcsm.models import DualClassifier, HeadConfig, ModelConfig, build_model, preset
from lcsm.testing import assert_close

D = 16


def classifier(**head):
    torch.manual_seed(0)
    values = dict(mixer="gla", vocab_size=11, d_model=D, n_layers=2, head=HeadConfig("classifier", n_classes=3, **head))
    return build_model(ModelConfig(**values), verbose=False).double()


def padded_batch(seqs, T, pad=7):
    ids = torch.full((len(seqs), T), pad)
    mask = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = True
    return ids, mask


SEQS = [[1, 2, 3, 4, 5], [6, 8, 9], [10]]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_classifier_pooling_ignores_padding(pooling):
    model = classifier(pooling=pooling)
    ids, mask = padded_batch(SEQS, 6)
    out = model(ids, mask=mask)
    assert out.shape == (3, 3)
    alone = torch.cat([model(torch.tensor([s])) for s in SEQS])
    assert_close({"logits": out}, {"logits": alone})
    other_pad, _ = padded_batch(SEQS, 6, pad=2)
    assert_close({"logits": model(other_pad, lengths=mask.sum(1))}, {"logits": alone})
    assert_close({"logits": model(other_pad, lengths=[len(s) for s in SEQS])}, {"logits": alone})
    with pytest.raises(ValueError, match=r"lengths: expected \[B\] = \[3\] integers in \[1, 6\], got torch.float32"):
        model(other_pad, lengths=torch.tensor([5.0, 3.0, 1.0]))


def test_mean_and_last_pooling_are_what_they_say():
    model = classifier(pooling="mean", hidden=8)
    ids, mask = padded_batch(SEQS, 6)
    hidden = model.backbone(ids)
    pooled = model.encode(ids, mask=mask)
    for b, s in enumerate(SEQS):
        assert_close({"mean": pooled[b]}, {"mean": hidden[b, : len(s)].mean(0)})
    last = classifier(pooling="last")
    pooled = last.encode(ids, mask=mask)
    hidden = last.backbone(ids)
    for b, s in enumerate(SEQS):
        assert_close({"last": pooled[b]}, {"last": hidden[b, len(s) - 1]})
    # LRA MLP head: Linear(h) -> ReLU -> Linear(C).
    assert [type(m).__name__ for m in model.head] == ["Linear", "ReLU", "Linear"]
    assert model.head[0].out_features == 8


def test_bad_masks_are_rejected():
    model = classifier()
    ids, mask = padded_batch(SEQS, 6)
    with pytest.raises(ValueError, match="right padding"):
        model(ids, mask=mask.flip(1))
    with pytest.raises(ValueError, match="mask"):
        model(ids, mask=mask[:, :4])
    with pytest.raises(ValueError, match="not both"):
        model(ids, mask=mask, lengths=mask.sum(1))


def test_dual_classifier_combines_as_lra_retrieval():
    torch.manual_seed(0)
    cfg = ModelConfig(
        mixer="gla", vocab_size=11, d_model=D, n_layers=1, head=HeadConfig("dual", n_classes=2, hidden=12)
    )
    model = build_model(cfg, verbose=False).double()
    a, mask_a = padded_batch(SEQS, 6)
    b, mask_b = padded_batch([[3, 3], [1, 2, 3, 4, 5, 6], [9, 9, 9]], 6)
    out = model(a, b, mask1=mask_a, mask2=mask_b)
    assert out.shape == (3, 2)
    u, v = model.encode(a, mask=mask_a), model.encode(b, mask=mask_b)
    features = torch.cat([u, v, u * v, u - v], dim=-1)
    assert features.shape == (3, 4 * D)
    h1, h2, final = model.head[0], model.head[2], model.head[4]
    assert (h1.in_features, h1.out_features, h2.out_features, final.out_features) == (4 * D, 12, 6, 2)
    expected = final(F.relu(h2(F.relu(h1(features)))))
    assert_close({"logits": out}, {"logits": expected})
    assert torch.equal(model.combine(u, v), features)


def test_dual_classifier_concat_combination():
    torch.manual_seed(0)
    cfg = ModelConfig(
        mixer="gla", vocab_size=11, d_model=D, n_layers=1, head=HeadConfig("dual", n_classes=2, combine="concat")
    )
    model = build_model(cfg, verbose=False).double()
    a, b = torch.randint(0, 11, (2, 5)), torch.randint(0, 11, (2, 7))
    u, v = model.encode(a), model.encode(b)
    assert model.head[0].in_features == 2 * D
    assert_close({"logits": model(a, b)}, {"logits": model.head(torch.cat([u, v], -1))})
    assert isinstance(model, DualClassifier)


def test_continuous_inputs_and_batchnorm():
    torch.manual_seed(0)
    cfg = ModelConfig(
        mixer="ces",
        input_dim=1,
        d_model=D,
        n_layers=2,
        head=HeadConfig("classifier", n_classes=10),
        norm="batchnorm",
        mixer_hidden=24,
        channel_mixer="none",
        bidirectional=True,
    )
    model = build_model(cfg, verbose=False)
    pixels = torch.rand(4, 20, 1)
    assert model(pixels).shape == (4, 10)
    model.eval()
    assert model(pixels).shape == (4, 10)
    with pytest.raises(ValueError, match="input_dim"):
        model(torch.zeros(4, 20, dtype=torch.long))


def test_etsmlp_block_equations():
    """ETSMLP section 3.2: X = LN(X_i), Z = W_2 relu(CES(W_1 X)), X_{i+1} = X_i + sigmoid(W_g X) * Z."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        mixer="ces",
        vocab_size=11,
        d_model=D,
        n_layers=1,
        mixer_hidden=24,
        channel_mixer="none",
        gate=True,
        final_norm=False,
    )
    model = build_model(cfg, verbose=False).double()
    block = model.backbone.blocks[0]
    assert block.channel is None and block.norm2 is None
    x = torch.randn(2, 9, D, dtype=torch.float64)
    u = block.norm1(x)
    z = block.mixer_out(F.relu(block.mixer(block.mixer_in(u))))
    expected = x + torch.sigmoid(block.gate(u)) * z
    assert_close({"block": block(x)}, {"block": expected})
    # The CES runs on the H = 24 hidden channels.
    assert block.mixer.d_model == 24


def test_glu_and_mlp_channel_mixers():
    torch.manual_seed(0)
    for kind in ("glu", "mlp"):
        cfg = ModelConfig(
            mixer="gla", vocab_size=11, d_model=D, n_layers=1, channel_mixer=kind, channel_hidden=20, norm="rmsnorm"
        )
        block = build_model(cfg, verbose=False).double().backbone.blocks[0]
        x = torch.randn(2, 5, D, dtype=torch.float64)
        h = x + block.mixer(block.norm1(x))
        c, n = block.channel, block.norm2(h)
        if kind == "glu":
            expected = h + c.down_proj(F.silu(c.gate_proj(n)) * c.up_proj(n))
        else:
            expected = h + c.fc2(F.gelu(c.fc1(n)))
        assert_close({kind: block(x)}, {kind: expected})


def test_dropout_is_applied_in_training_only():
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="gla", vocab_size=11, d_model=D, n_layers=2, dropout=0.5), verbose=False)
    ids = torch.randint(0, 11, (2, 6))
    model.train()
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


@pytest.mark.parametrize("mixer", ["gla", "mamba", "hgrn", "metala"])
def test_no_weight_decay_is_tagged_plus_norms_plus_biases(mixer):
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(mixer=mixer, vocab_size=11, d_model=D, n_layers=2, tie_embeddings=False, channel_mixer="mlp"),
        verbose=False,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)] for p in model.no_weight_decay_parameters()}
    expected = {n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)}
    expected |= {n for n in names.values() if n.endswith(".bias")}
    for i in range(2):
        expected |= {
            f"backbone.blocks.{i}.norm1.weight",
            f"backbone.blocks.{i}.norm1.bias",
            f"backbone.blocks.{i}.norm2.weight",
            f"backbone.blocks.{i}.norm2.bias",
        }
    expected |= {"backbone.norm.weight", "backbone.norm.bias"}
    assert got == expected
    for decayed in ("backbone.embedding.weight", "lm_head.weight", "backbone.blocks.0.channel.fc1.weight"):
        assert decayed not in got
    groups = model.parameter_groups(0.1)
    assert sum(p.numel() for g in groups for p in g["params"]) == model.num_parameters()
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == len(got)


def test_no_weight_decay_survives_copies_and_assigned_weights():
    """The tags sit on Parameter objects, which deepcopy, load_state_dict(assign=True) and a
    meta-built model's to_empty replace: the names the backbone kept still pick them out."""
    config = ModelConfig(mixer="mamba", vocab_size=11, d_model=D, n_layers=1)
    model = build_model(config, verbose=False)
    names = {id(p): n for n, p in model.named_parameters()}
    expected = {names[id(p)] for p in model.no_weight_decay_parameters()}
    assert {"backbone.blocks.0.mixer.A_log", "backbone.blocks.0.mixer.D"} <= expected

    def chosen(m):
        own = {id(p): n for n, p in m.named_parameters()}
        return {own[id(p)] for p in m.no_weight_decay_parameters()}

    assigned = build_model(config, verbose=False)
    assigned.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with torch.device("meta"):
        empty = build_model(config, verbose=False)
    empty.to_empty(device="cpu")
    for other in (copy.deepcopy(model), assigned, empty):
        assert chosen(other) == expected


def test_no_weight_decay_covers_untagged_mixer_norms():
    # RMSNorm weights of the block, and any LayerNorm inside a mixer, count as norms.
    model = build_model(
        ModelConfig(mixer="lcsm", vocab_size=11, d_model=D, n_layers=1, norm="rmsnorm", mixer_options=dict(expand=4)),
        verbose=False,
    )
    got = {n for n, p in model.named_parameters() if any(p is q for q in model.no_weight_decay_parameters())}
    assert {
        "backbone.blocks.0.norm1.weight",
        "backbone.blocks.0.norm2.weight",
        "backbone.norm.weight",
        "backbone.blocks.0.mixer.norm.weight",
        "backbone.blocks.0.mixer.norm.bias",
    } <= got


def test_etsmlp_preset_norms_the_embeddings_and_has_the_official_retrieval_head():
    """The official ETSMLP (PKUAI-LINGroup/ETSMLP): ``module/smlp_encoder.py`` applies
    ``emb_layer_norm`` (the task's norm kind) to the embeddings before the first layer, and
    ``architectures/LRA_model.py``'s retrieval classifier (smlp_lra_aan_complex: classifier_layers
    1, classifier_activation_fn gelu, classifier_out_dim = the embedding width) is
    Linear(2d -> d) -> GELU -> a projection without bias, on the concatenated pooled vectors."""
    torch.manual_seed(0)
    cfg = preset("etsmlp", task="retrieval", vocab_size=11, d_model=D, mixer_hidden=D, n_layers=1)
    model = build_model(cfg, verbose=False).double().eval()
    with torch.no_grad():
        for p in model.backbone.embed_norm.parameters():  # off the (1, 0) init
            p.add_(0.1 * torch.randn_like(p))
    ids1, ids2 = torch.randint(0, 11, (2, 6)), torch.randint(0, 11, (2, 6))
    seen = []
    model.backbone.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    logits = model(ids1, ids2)
    norm = model.backbone.embed_norm
    emb = model.backbone.embedding(ids1)
    first, last = model.head[0], model.head[-1]
    assert len(model.head) == 3 and first.out_features == D and last.bias is None
    uv = torch.cat([model.encode(ids1), model.encode(ids2)], -1)
    assert_close(
        {"first block input": seen[0], "logits": logits},
        {
            "first block input": F.layer_norm(emb, (D,), norm.weight, norm.bias, cfg.norm_eps),
            "logits": F.linear(F.gelu(first(uv)), last.weight),
        },
    )
    # The other tasks keep the official linear classifier (classifier_layers 0), without bias.
    listops = build_model(preset("etsmlp", task="listops", d_model=D, mixer_hidden=D, n_layers=1), verbose=False)
    assert len(listops.head) == 1 and listops.head[0].bias is None
    image = preset("etsmlp", task="image", d_model=D, mixer_hidden=D, n_layers=1)
    assert image.embed_norm and image.norm == "batchnorm"
