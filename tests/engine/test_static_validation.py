"""Validating a run config reads no data: the task's options, the fields it fixes in the model and
the early-stop metric are checked from the configs alone; the corpus is read when the run is built."""

import pytest

from lcsm.engine.config import RunConfig
from lcsm.tasks._real_data import _DocumentTask
from lcsm.tasks.lm import LanguageModelling


def run(task: dict, **model) -> dict:
    return {
        "task": task,
        "model": {"mixer": "gla", "d_model": 16, "n_layers": 1, **model},
        "train": {"max_steps": 1, "batch_size": 2},
    }


@pytest.fixture
def no_corpus(monkeypatch, tmp_path):
    """Any read of a task's documents fails the test (and the cache is the test's own)."""
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))

    def read(self):
        pytest.fail(f"validating a run config read the corpus of task {self.registry_name!r}")

    monkeypatch.setattr(LanguageModelling, "documents", read)
    monkeypatch.setattr(_DocumentTask, "documents", read)


def test_validating_an_lm_run_config_does_not_read_the_corpus(no_corpus):
    config = RunConfig.from_dict(run({"name": "lm", "tokenizer": "bpe", "bpe_vocab": 512}))
    assert config.task["bpe_vocab"] == 512
    with pytest.raises(ValueError, match=r"model.vocab_size: task 'lm' fixes it to 512, got 300"):
        RunConfig.from_dict(run({"name": "lm", "tokenizer": "bpe", "bpe_vocab": 512}, vocab_size=300))
    with pytest.raises(ValueError, match="bpe_vocab: expected an integer >= 300"):
        RunConfig.from_dict(run({"name": "lm", "tokenizer": "bpe", "bpe_vocab": 2}))


@pytest.mark.parametrize("name", ["text", "bbc_news", "rotten_tomatoes", "spam", "retrieval"])
def test_validating_a_document_run_config_does_not_read_the_corpus(no_corpus, name):
    RunConfig.from_dict(run({"name": name}))
    with pytest.raises(ValueError, match=rf"model.head.n_classes: task '{name}' fixes it to \d+, got 7"):
        RunConfig.from_dict(run({"name": name}, n_classes=7))
    with pytest.raises(ValueError, match=rf"model.head.n_classes: task '{name}' fixes it to \d+, got 7"):
        RunConfig.from_dict(run({"name": name}, head={"n_classes": 7}))


def test_the_task_fixes_the_heads_kind_and_classes_in_either_spelling(no_corpus):
    """The nested head, its kind's name alone and the older flat fields build the same model;
    the fields the task fixes are checked in each, named by their nested key."""
    listops = {"name": "listops"}
    nested = RunConfig.from_dict(run(listops, head={"kind": "classifier", "hidden": 8}))
    flat = RunConfig.from_dict(run(listops, head="classifier", head_hidden=8))
    fixed = {"head": {"kind": "classifier", "n_classes": 10}, "vocab_size": 17}
    assert nested.model_config_with(fixed) == flat.model_config_with(fixed)
    assert nested.model_config_with(fixed).head.hidden == 8
    assert RunConfig.from_dict(run(listops)).model_config_with(fixed).head.n_classes == 10
    with pytest.raises(ValueError, match=r"model.head.kind: task 'listops' fixes it to 'classifier', got 'dual'"):
        RunConfig.from_dict(run(listops, head={"kind": "dual"}))
    with pytest.raises(ValueError, match=r"model.head.kind: task 'listops' fixes it to 'classifier', got 'lm'"):
        RunConfig.from_dict(run(listops, head="lm"))
    with pytest.raises(ValueError, match=r"model.head_hidden: the older spelling of model.head.hidden, and both"):
        RunConfig.from_dict(run(listops, head={"hidden": 8}, head_hidden=8))
    # MAD's compression fixes the pooling too.
    with pytest.raises(ValueError, match=r"model.head.pooling: task 'mad_compression' fixes it to 'last', got 'mean'"):
        RunConfig.from_dict(run({"name": "mad_compression"}, head={"pooling": "mean"}))


def test_a_preset_head_is_overridden_field_by_field(no_corpus):
    values = run({"name": "retrieval"}, preset="etsmlp", preset_options={"task": "retrieval"}, head={"hidden": 12})
    values["model"] = {k: v for k, v in values["model"].items() if k not in ("mixer", "d_model", "n_layers")}
    config = RunConfig.from_dict(values)
    head = config.model_config_with({"head": {"kind": "dual", "n_classes": 2}, "vocab_size": 257}).head
    # The preset's combine and mlp stay; the config's hidden replaces the preset's d_model.
    assert (head.kind, head.n_classes, head.hidden, head.combine, head.mlp) == ("dual", 2, 12, "concat", "etsmlp")


def test_the_eval_split_is_checked_from_the_config(no_corpus):
    """train.eval_split is a split of the task as its options make it (MQAR has a validation split
    only with validation_examples), checked before any data is made: a sweep refuses the run before
    its first run starts, not after generating its data."""
    mqar = {"name": "mqar", "train_grid": "16:2", "test_grid": "16:2", "train_examples": 8, "test_examples": 8}
    values = {**run(mqar), "train": {"max_steps": 1, "batch_size": 2, "eval_split": "validation"}}
    with pytest.raises(
        ValueError, match=r"train.eval_split: task 'mqar' has splits \['train', 'test'\], got 'validation'"
    ):
        RunConfig.from_dict(values)
    assert RunConfig.from_dict({**values, "task": {**mqar, "validation_examples": 4}}).train.eval_split == "validation"
    lm = {**run({"name": "lm", "tokenizer": "bpe", "bpe_vocab": 512}, vocab_size=512)}
    assert RunConfig.from_dict({**lm, "train": {**lm["train"], "eval_split": "test"}}).train.eval_split == "test"
