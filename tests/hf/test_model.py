"""LcsmForCausalLM: transformers' generate equals lcsm's own, save / load is bit-exact, the cache
feeds one token per step, and bad inputs fail clearly."""

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (lcsm's 'hf' extra: pip install -e '.[hf]')")

import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lcsm.hf import LcsmCache, LcsmConfig, LcsmForCausalLM
from lcsm.models import ModelConfig, preset

# Families of mixers (and the quadratic baseline) that run as causal LMs.
MIXERS = [
    "gla",
    "retnet",
    "mamba",
    "mamba2",
    "hgrn",
    "metala",
    "fwp",
    "gated_deltanet",
    "rwkv7",
    "s4d",
    "rwkv4",
    "lcsm",
    "attention",
]


def tiny(mixer="gla", **changes) -> LcsmForCausalLM:
    torch.manual_seed(0)
    config = LcsmConfig(lcsm={**dict(mixer=mixer, vocab_size=32, d_model=16, n_layers=2), **changes})
    return LcsmForCausalLM(config).eval()


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def trainer_args(out, **options):
    """transformers' TrainingArguments for a short CPU run that writes nothing but its output dir."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], save_strategy="no", **options)


@pytest.mark.parametrize("mixer", MIXERS)
def test_greedy_generate_equals_lcsm_generate(mixer):
    model = tiny(mixer)
    ids = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out[:, :6], ids)
    assert torch.equal(out[:, 6:], model.model.generate(ids, max_new_tokens=8, temperature=0))


@pytest.mark.parametrize("mixer", ["gla", "attention"])
def test_after_the_prompt_each_step_feeds_one_token(mixer):
    model = tiny(mixer)
    fed = []
    model.register_forward_pre_hook(lambda m, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    model.generate(torch.zeros(2, 7, dtype=torch.long), max_new_tokens=5, do_sample=False)
    assert fed == [7, 1, 1, 1, 1]


def test_linear_cache_is_constant_size_and_attention_grows():
    for mixer, grows in (("gla", False), ("attention", True)):
        model = tiny(mixer)
        out = model(torch.zeros(1, 4, dtype=torch.long), use_cache=True)
        cache = out.cache
        assert isinstance(cache, LcsmCache) and cache.get_seq_length() == 4
        assert cache.is_linear == [not grows] * 2
        size = sum(t.numel() for s in cache.states for t in s.tensors().values())
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        assert cache.get_seq_length() == 7
        assert (sum(t.numel() for s in cache.states for t in s.tensors().values()) > size) == grows


def test_forward_with_cache_equals_one_forward():
    model = tiny("metala")
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(2))
    whole = model(ids).logits
    first = model(ids[:, :5], use_cache=True)
    rest = model(ids[:, 5:], cache=first.cache)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), whole, rtol=1e-5, atol=1e-5)
    # the cache's older transformers name
    again = model(ids[:, :5], use_cache=True)
    torch.testing.assert_close(model(ids[:, 5:], past_key_values=again.cache).logits, rest.logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cache / past_key_values: one cache under two names"):
        model(ids[:, 5:], cache=again.cache, past_key_values=again.cache)


def test_labels_give_the_shifted_cross_entropy():
    model = tiny()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 32), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 1, 2], [3]]

# documents one after another in a row (transformers' DataCollatorWithFlattening: padding-free)
DOCUMENTS = [[1, 2, 3, 4, 5], [6], [7, 8, 9, 10, 11, 12, 13]]


def left_padded(prompts, T, pad=0):
    """As a tokenizer with padding_side="left" gives them: ids and attention_mask [B, T]."""
    ids = torch.full((len(prompts), T), pad)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("mixer", MIXERS)
def test_left_padded_generate_equals_lcsm_generate_per_prompt(mixer):
    model = tiny(mixer).double()
    ids, mask = left_padded(PROMPTS, 7)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[:, :7], ids)
    alone = [model.model.generate([p], max_new_tokens=6, temperature=0)[0].tolist() for p in PROMPTS]
    assert out[:, 7:].tolist() == alone, mixer


def test_left_padded_generate_from_a_tokenizer():
    """The usual transformers way: a tokenizer padding on the left, its ids and mask to generate."""
    from lcsm.hf.export import byte_tokenizer

    tok = byte_tokenizer()
    tok.padding_side, tok.pad_token = "left", tok.eos_token
    model = tiny(vocab_size=len(tok)).double()
    texts = ["The whale", "Ahab", "all hands on deck!"]
    batch = tok(texts, padding=True, return_tensors="pt")
    assert not bool(batch.attention_mask.all())
    out = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    T = batch.input_ids.shape[1]
    alone = [model.model.generate([tok(t).input_ids], max_new_tokens=5, temperature=0)[0].tolist() for t in texts]
    assert out[:, T:].tolist() == alone
    # without a cache generate rereads the whole padded sequence each step, packed again: the same
    again = model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id, use_cache=False)
    assert torch.equal(again, out)


def test_left_padded_decoding_feeds_one_token_with_a_constant_cache():
    model = tiny("gla")
    fed, sizes = [], []

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        fed.append((kwargs["input_ids"].shape[1], None if mask is None else int(mask[:, -1:].min())))
        if kwargs.get("cache") is not None:
            sizes.append(sum(t.numel() for s in kwargs["cache"].states for t in s.tensors().values()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    ids, mask = left_padded(PROMPTS, 7)
    model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    # the padded prompt once, then one token a step with its mask column (generate's growing mask) all 1
    assert fed == [(7, 1)] + [(1, 1)] * 4
    assert len(sizes) == 4 and len(set(sizes)) == 1


def test_left_padded_forward_without_cache_equals_each_row_alone():
    model = tiny().double()
    ids, mask = left_padded(PROMPTS, 7)
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    for b, p in enumerate(PROMPTS):
        torch.testing.assert_close(logits[b, 7 - len(p) :], model(torch.tensor([p])).logits[0])


def test_right_padding_without_cache_leaves_valid_positions_exact():
    model = tiny()
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6])
    for use_cache in (False, None):
        out = model(ids, attention_mask=mask, use_cache=use_cache)
        assert (out.cache is None) == (use_cache is False)
        torch.testing.assert_close(out.logits[0, :4], model(ids[:1, :4]).logits[0])
        torch.testing.assert_close(out.logits[1], model(ids[1:]).logits[0])
    # the cache holds each row's state after its own last token
    more = torch.tensor([[7], [8]])
    step = model(more, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1), cache=out.cache)
    torch.testing.assert_close(step.logits[0], model(torch.cat([ids[:1, :4], more[:1]], 1)).logits[0, -1:])
    torch.testing.assert_close(step.logits[1], model(torch.cat([ids[1:], more[1:]], 1)).logits[0, -1:])


def test_padding_after_the_prompt_is_refused_naming_attention_mask():
    model = tiny()
    ids, mask = left_padded(PROMPTS, 7)
    cache = model(ids, attention_mask=mask).cache
    step = torch.ones(4, 1, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"attention_mask: has zeros \(padding\) in the columns of the 1 token\(s\) fed"
    ):
        model(step, attention_mask=torch.cat([mask, torch.tensor([[1], [0], [1], [1]])], 1), cache=cache)
    assert cache.seen == 7  # the refused step read nothing
    model(step, attention_mask=torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1), cache=cache)
    assert cache.seen == 8


def test_generate_refuses_right_padding():
    """transformers appends the new tokens after the last column: with right padding the first one
    would be predicted at a pad, so generate asks for left padding instead of returning that."""
    model = tiny()
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match="attention_mask: generate needs left padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("mixer", ["hgrn", "attention"])
def test_beam_search_reorders_the_states(mixer):
    model = tiny(mixer)
    ids = torch.randint(0, 32, (2, 4), generator=torch.Generator().manual_seed(5))
    out = model.generate(ids, max_new_tokens=4, num_beams=3, do_sample=False)
    assert out.shape == (2, 8)
    # One beam and greedy agree (a sanity check of reorder_cache's bookkeeping).
    one = model.generate(ids, max_new_tokens=4, num_beams=1, do_sample=False)
    assert torch.equal(one[:, 4:], model.model.generate(ids, max_new_tokens=4, temperature=0))


@pytest.mark.parametrize("mixer", ["gla", "attention"])
def test_beam_search_on_a_left_padded_batch_equals_each_prompt_alone(mixer):
    model = tiny(mixer).double()
    ids, mask = left_padded(PROMPTS, 7)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
    for b, p in enumerate(PROMPTS):
        alone = model.generate(torch.tensor([p]), max_new_tokens=4, num_beams=3, do_sample=False, pad_token_id=0)
        assert torch.equal(out[b, 7:], alone[0, len(p) :]), f"{mixer} prompt {b}"


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("mixer", ["gla", "s4d", "attention"])
def test_save_and_load_are_bit_exact(tmp_path, mixer, tie):
    model = tiny(mixer, tie_embeddings=tie)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, LcsmForCausalLM)
    assert same_weights(model, loaded)
    assert loaded.model.config == model.model.config
    # a tied head is the embedding matrix itself after loading as before
    assert (loaded.model.lm_head is None) == tie
    ids = torch.randint(0, 32, (2, 5))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LcsmConfig)


def test_preset_round_trip(tmp_path):
    config = preset("metala_transformer", vocab_size=64, d_model=32, n_layers=2)
    torch.manual_seed(0)
    model = LcsmForCausalLM(LcsmConfig(lcsm=config)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert same_weights(model, loaded) and loaded.model.config == config


def test_config_checks():
    with pytest.raises(ValueError, match=r"head.kind 'lm'\), got head.kind 'classifier'"):
        LcsmConfig(lcsm=dict(mixer="gla", vocab_size=8, head={"kind": "classifier", "n_classes": 2}))
    with pytest.raises(ValueError, match="vocab_size: the lcsm config gives 8, got 9"):
        LcsmConfig(lcsm=dict(mixer="gla", vocab_size=8), vocab_size=9)
    with pytest.raises(ValueError, match="lcsm: expected an lcsm ModelConfig or its dict"):
        LcsmConfig(lcsm="gla")
    with pytest.raises(ValueError, match="n_layer' \\(did you mean 'n_layers'"):
        LcsmConfig(lcsm=dict(mixer="gla", vocab_size=8, n_layer=2))
    with pytest.raises(ValueError, match="carries no lcsm model config"):
        LcsmForCausalLM(LcsmConfig())
    assert LcsmConfig(lcsm=ModelConfig(mixer="gla", vocab_size=8)).vocab_size == 8


def test_bad_inputs():
    model = tiny()
    with pytest.raises(ValueError, match=r"input_ids: token ids must lie in \[0, vocab_size=32\), got 40"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match=r"input_ids: expected token ids \[B, T\], got \[3\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="cache: expected an LcsmCache"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=(1, 2))
    with pytest.raises(ValueError, match="inputs_embeds: lcsm models read token ids"):
        model(inputs_embeds=torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="output_attentions: not supported"):
        model(torch.zeros(1, 2, dtype=torch.long), output_attentions=True)
    with pytest.raises(ValueError, match=r"attention_mask: expected \[B, seen \+ T\] = \[1, 2\].*got \[1, 1\]"):
        model(torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"attention_mask: expected \[B, seen \+ T\] = \[1, 2\].*got \[1, 4\]"):
        model(torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0, 0]]))
    with pytest.raises(
        ValueError, match=r"attention_mask: expected 1 \(a token\) or 0 \(padding\), got values \[1, 2\]"
    ):
        model(torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.tensor([[2, 1]]))
    with pytest.raises(ValueError, match="output_hidden_states: not supported"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), max_new_tokens=2, output_hidden_states=True)
    with pytest.raises(ValueError, match=r"labels: expected the shape of input_ids \[1, 2\], got \[1, 3\]"):
        model(torch.zeros(1, 2, dtype=torch.long), labels=torch.zeros(1, 3, dtype=torch.long))


def test_missing_weights_are_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.backbone.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the checkpoint lacks 1 weight.*model.backbone.norm.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_copied_fields_given_after_construction_are_checked(tmp_path):
    # the model is built from lcsm alone: another value given later described another model, and
    # a saved model then failed to load
    tiny().save_pretrained(tmp_path)
    for name, value in (("num_hidden_layers", 1), ("vocab_size", 40), ("hidden_size", 8)):
        with pytest.raises(ValueError, match=f"{name}: the lcsm config gives .*, got {value}"):
            AutoModelForCausalLM.from_pretrained(tmp_path, **{name: value})
    config = AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab_size: the lcsm config gives 32, got 50"):
        config.update({"vocab_size": 50})
    with pytest.raises(ValueError, match="hidden_size: the lcsm config gives 16, got 8"):
        config.hidden_size = 8
    config.vocab_size = 32  # the same value is no change
    assert AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=2).config.num_hidden_layers == 2


def test_the_copies_follow_a_new_lcsm_config_and_are_checked_whatever_lcsm_is_given_as(tmp_path):
    with pytest.raises(ValueError, match="vocab_size: the lcsm config gives 8, got 9"):
        LcsmConfig(lcsm=ModelConfig(mixer="gla", vocab_size=8), vocab_size=9)
    with pytest.raises(ValueError, match="hidden_size: the lcsm config gives 64, got 12"):
        LcsmConfig(lcsm=dict(mixer="gla", vocab_size=8), hidden_size=12)  # d_model's default
    for lcsm in (None, ModelConfig(mixer="gla", vocab_size=8)):  # (was an AttributeError)
        with pytest.raises(ValueError, match="tie_word_embeddings: .*got True"):
            LcsmConfig(lcsm=lcsm, tie_word_embeddings=True)
    model = tiny()
    model.config.lcsm = {**model.config.lcsm, "n_layers": 3}
    assert model.config.num_hidden_layers == 3


def test_tie_word_embeddings_is_refused_naming_lcsm_tie_embeddings(tmp_path):
    for tie in (True, False):
        with pytest.raises(ValueError, match=f"tie_word_embeddings: .*here {tie}\\), so this stays False; got True"):
            LcsmConfig(lcsm=dict(mixer="gla", vocab_size=8, tie_embeddings=tie), tie_word_embeddings=True)
    tiny().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tie_word_embeddings: .*got True"):
        AutoModelForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=True)


def test_weights_the_model_does_not_have_are_an_error(tmp_path):
    # an untied head's matrix loaded under a config that ties it was dropped with a warning
    tiny(tie_embeddings=False).save_pretrained(tmp_path)
    tied = LcsmConfig(lcsm=dict(mixer="gla", vocab_size=32, d_model=16, n_layers=2, tie_embeddings=True))
    with pytest.raises(ValueError, match="holds 1 weight.*not have.*model.lm_head.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=tied)


@pytest.mark.parametrize("tie", [True, False])
def test_a_new_output_head_is_saved_and_loaded(tmp_path, tie):
    model = tiny(tie_embeddings=tie)
    head = torch.nn.Linear(16, 32, bias=False)
    model.set_output_embeddings(head)
    ids = torch.tensor([[1, 5, 9]])
    logits = model(ids).logits
    assert torch.allclose(logits, head(model.model.backbone(ids))) and not model.config.lcsm["tie_embeddings"]
    model.save_pretrained(tmp_path)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, logits)
    model.set_output_embeddings(None)
    assert model.config.lcsm["tie_embeddings"] and model.get_output_embeddings() is None
    with pytest.raises(ValueError, match=r"nn.Linear\(16, 32, bias=False\), got Linear\(16, 32, bias=True\)"):
        model.set_output_embeddings(torch.nn.Linear(16, 32))


def test_config_return_dict_false_gives_tuples():
    model = tiny()
    ids = torch.tensor([[1, 2, 3]])
    logits = model(ids).logits
    model.config.return_dict = False
    loss, tuple_logits, _ = model(ids, labels=ids, use_cache=True)
    assert torch.equal(tuple_logits, logits) and loss.dim() == 0
    assert model(ids, return_dict=True).logits is not None


def test_weights_of_other_shapes_are_an_error_not_uninitialised_memory(tmp_path):
    tiny().save_pretrained(tmp_path)
    other = LcsmConfig(lcsm=dict(mixer="gla", vocab_size=48, d_model=16, n_layers=2))
    with pytest.raises(ValueError, match="other shapes.*model.backbone.embedding.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path, config=other, ignore_mismatched_sizes=True)


@pytest.mark.parametrize("tie", [True, False])
def test_resized_embeddings_take_the_new_ids_and_round_trip(tmp_path, tie):
    model = tiny(tie_embeddings=tie)
    model.resize_token_embeddings(40)
    ids = torch.tensor([[35, 3, 39]])
    logits = model(ids).logits
    assert logits.shape == (1, 3, 40) and model.config.lcsm["vocab_size"] == model.config.vocab_size == 40
    model.save_pretrained(tmp_path)
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, logits)


def test_the_trainer_trains_with_the_loss_over_the_accumulated_batch(tmp_path):
    from transformers import Trainer

    model = tiny().train()
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = trainer_args(
        tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=0.0
    )
    result = Trainer(model=model, args=args, train_dataset=data).train()
    # the two micro-batches' sums over all 4 x 7 labelled tokens: the whole batch's mean
    expected = model(ids, labels=ids).loss.item()
    assert result.training_loss == pytest.approx(expected, rel=1e-5)
    summed = model(ids[:2], labels=ids[:2], num_items_in_batch=torch.tensor(28)).loss
    assert summed.item() == pytest.approx(model(ids[:2], labels=ids[:2]).loss.item() * 14 / 28, rel=1e-6)


def test_the_trainer_trains_on_a_flattened_batch(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer

    model = tiny().train()
    data = [{"input_ids": d} for d in DOCUMENTS]
    args = trainer_args(tmp_path, max_steps=1, per_device_train_batch_size=3, learning_rate=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    # the mean over the documents' next-token predictions, each document alone
    alone = [model(torch.tensor([d]), labels=torch.tensor([d])).loss.item() * (len(d) - 1) for d in DOCUMENTS if d[1:]]
    assert result.training_loss == pytest.approx(sum(alone) / sum(len(d) - 1 for d in DOCUMENTS), rel=1e-5)


def test_trainer_activation_checkpointing_recomputes_the_blocks_and_changes_no_number(tmp_path):
    from transformers import Trainer

    ids = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(5))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trained, recomputed = [], []
    for checkpointing in (False, True):
        # rwkv7: later layers read layer 0's values (a tensor handed to each Block), with dropout
        model = tiny("rwkv7", n_layers=3, dropout=0.1).train()
        runs = [0] * 3
        for i, block in enumerate(model.model.backbone.blocks):
            block.mixer.register_forward_hook(lambda *_, i=i, runs=runs: runs.__setitem__(i, runs[i] + 1))
        args = trainer_args(
            tmp_path / str(checkpointing),
            max_steps=2,
            per_device_train_batch_size=4,
            seed=3,
            activation_checkpointing=checkpointing,
        )
        Trainer(model=model, args=args, train_dataset=data).train()
        trained.append(model.state_dict())
        recomputed.append(runs)
    # each step runs every mixer once forward, and once more in the backward pass when checkpointed
    assert recomputed == [[2, 2, 2], [4, 4, 4]]
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_reentrant_checkpointing_is_refused_by_name_and_never_the_fallback():
    model = tiny()
    with pytest.raises(ValueError, match="use_reentrant=True is not supported"):
        model.activation_checkpointing_enable({"use_reentrant": True})
    # kwargs without use_reentrant: torch's checkpoint would take its reentrant form (and fail on
    # the Blocks' keyword arguments)
    with pytest.raises(ValueError, match=r"gradient_checkpointing_kwargs: unknown option\(s\) \['bogus'\]"):
        model.activation_checkpointing_enable({"bogus": 1})
    model.train().activation_checkpointing_enable({"preserve_rng_state": True})
    ids = torch.randint(0, 32, (2, 6))
    model(ids, labels=ids).loss.backward()


def test_built_for_half_precision_the_float32_parameters_are_those_of_float32():
    config = LcsmConfig(lcsm=dict(mixer="s4d", vocab_size=32, d_model=16, n_layers=1))
    torch.manual_seed(0)
    full = LcsmForCausalLM(config)
    torch.manual_seed(0)
    half = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert same_weights(full.to(torch.bfloat16), half)


def test_import_without_transformers_names_the_extra(monkeypatch):
    for name in [n for n in sys.modules if n == "lcsm.hf" or n.startswith(("lcsm.hf.", "transformers"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"install lcsm's 'hf' extra: pip install 'lcsm\[hf\]'"):
        import lcsm.hf  # noqa: F401


@pytest.mark.parametrize("mixer", ["s4d", "mamba"])
def test_half_precision_loading_keeps_the_float32_parameters(tmp_path, mixer):
    model = tiny(mixer)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    # the same weights as lcsm's own cast (Mixer._apply keeps a mixer's float32_parameters float32)
    cast = model.to(torch.bfloat16)
    assert same_weights(cast, loaded)
    assert any(p.dtype == torch.float32 for p in loaded.parameters())
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(
        loaded.generate(ids, max_new_tokens=4, do_sample=False), cast.generate(ids, max_new_tokens=4, do_sample=False)
    )


# A hybrid stack: Mamba and GLA recurrent states beside a windowed and a full KV cache.
HYBRID = dict(
    mixer={"default": "mamba", "every": [{"k": 2, "mixer": "attention"}, {"k": 4, "mixer": "gla", "offset": 2}]},
    mixer_options={"attention": {"window": 3, "positions": "rotary"}},
    n_layers=4,
)


def test_hybrid_config_round_trips_and_generates_as_lcsm(tmp_path):
    model = tiny(**HYBRID).double()
    assert [type(b.mixer).__name__ for b in model.model.backbone.blocks] == ["Mamba", "Attention", "GLA", "Attention"]
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).double()
    assert loaded.config.lcsm == model.config.lcsm and loaded.model.config == model.model.config
    assert same_weights(model, loaded)
    ids = torch.randint(0, 32, (3, 6), generator=torch.Generator().manual_seed(1))
    out = loaded.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out[:, 6:], model.model.generate(ids, max_new_tokens=8, temperature=0))
    ids, mask = left_padded(PROMPTS, 7)
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = [model.model.generate([p], max_new_tokens=6, temperature=0)[0].tolist() for p in PROMPTS]
    assert out[:, 7:].tolist() == alone


@pytest.mark.parametrize("mixer", ["gla", "mamba", "rwkv7", "attention"])
def test_a_flattened_batch_runs_each_document_alone(mixer):
    from transformers import DataCollatorWithFlattening

    model = tiny(mixer).double()
    features = [{"input_ids": d} for d in DOCUMENTS]
    batch = DataCollatorWithFlattening(return_tensors="pt")(features)
    out = model(**batch)
    alone = torch.cat([model(torch.tensor([d])).logits[0] for d in DOCUMENTS])
    torch.testing.assert_close(out.logits[0], alone, rtol=1e-12, atol=1e-12)
    # the collator's labels (-100 at each document's first token): the next-token loss inside documents
    targets = torch.cat([torch.tensor(d[1:], dtype=torch.long) for d in DOCUMENTS])
    inside = torch.cat([model(torch.tensor([d])).logits[0, :-1] for d in DOCUMENTS])
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(inside, targets), rtol=1e-12, atol=1e-12)
    assert out.cache is None
    # the flash-attention offsets and the sequence index mark the same documents
    for options in ({"return_flash_attn_kwargs": True}, {"return_seq_idx": True, "return_position_ids": False}):
        other = DataCollatorWithFlattening(return_tensors="pt", **options)(features)
        assert torch.equal(model(**other).logits, out.logits), options


def test_flattened_rows_of_a_batch_and_their_refusals():
    model = tiny().double()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    positions = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])
    logits = model(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(logits[0, 2:], model(ids[:1, 2:]).logits[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits[1], model(ids[1:]).logits[0], rtol=1e-12, atol=1e-12)
    # positions of one sequence a row are lcsm's own: nothing changes (None: as not given)
    assert torch.equal(model(ids, position_ids=torch.arange(4).expand(2, 4)).logits, model(ids).logits)
    assert torch.equal(model(ids, position_ids=None, cu_seq_lens_q=None, seq_idx=None).logits, model(ids).logits)
    with pytest.raises(ValueError, match=r"position_ids: expected positions counted from 0 .* starting at 2 \(row 0"):
        model(ids, position_ids=torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3]]))
    with pytest.raises(ValueError, match="use_cache: a batch of documents one after another"):
        model(ids, position_ids=positions, use_cache=True)
    with pytest.raises(ValueError, match=r"position_ids: expected \[B, T\] = \[2, 4\]"):
        model(ids, position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="position_ids / cu_seq_lens_q: they mark different documents"):
        model(ids[:1], position_ids=positions[:1], cu_seq_lens_q=torch.tensor([0, 4]), use_cache=False)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected the document offsets .* from 0 to T = 4"):
        model(ids[:1], cu_seq_lens_q=torch.tensor([0, 2, 5]), use_cache=False)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(
        ValueError, match="position_ids: expected lcsm's own positions, \\[0, 1, 2\\] at the tokens of row 0"
    ):
        model(ids, attention_mask=mask, position_ids=positions)


def test_generate_with_position_ids_from_the_mask_equals_generate_without():
    model = tiny().double()
    ids, mask = left_padded(PROMPTS, 7)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, position_ids=positions, **kwargs), model.generate(ids, **kwargs))
