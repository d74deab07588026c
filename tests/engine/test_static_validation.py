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
    with pytest.raises(ValueError, match=rf"model.n_classes: task '{name}' fixes it to \d+, got 7"):
        RunConfig.from_dict(run({"name": name}, n_classes=7))
