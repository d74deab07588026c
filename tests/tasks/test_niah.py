"""niah: the needle sits at the stated depth, the answer is the needle's number, splits disjoint."""

import re

import pytest
import torch

from lcsm import tasks
from lcsm.tasks.niah import QUESTION, SNAP, NIAHEvaluator


@pytest.fixture
def task(tmp_path, make_corpus):
    corpus = make_corpus(tmp_path / "corpus", n_docs=60, words=200)
    return tasks.build(
        "niah",
        cache_dir=tmp_path / "cache",
        corpus=f"path:{corpus}",
        contexts=[160, 320],
        depths=[0.0, 0.5, 1.0],
        train_examples=20,
        test_examples=10,
    )


def _find(seq, sub):
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub)


def test_needle_at_depth_and_answer_derivable(task):
    prefix, question = task.encode(" The special magic number is "), task.encode(QUESTION)
    for split in task.splits:
        for seg in task.dataset(split).segments:
            L, depth = seg.meta["context"], seg.meta["depth_pct"] / 100
            for row in range(len(seg)):
                ids = seg.inputs[row].long().tolist()
                labels = seg.labels[row].long()
                at = _find(ids, prefix)
                number = ids[at + len(prefix) : at + len(prefix) + 4]
                assert ids[at + len(prefix) + 4 : at + len(prefix) + 6] == task.encode(". ")
                answer = labels[labels != -100].tolist()
                assert answer == number  # derivable from the input alone
                assert ids[-len(question) - 3 :] == question + answer[:3]
                haystack = L + 1 - len(task.encode(" The special magic number is 0000. ")) - len(question) - 4
                assert at == int(seg.extras["needle_position"][row])
                assert round(depth * haystack) <= at <= round(depth * haystack) + SNAP + 1
                assert labels.shape == (L,) and int((labels != -100).sum()) == 4


def test_train_and_test_haystacks_are_disjoint(task):
    def docs(split):
        found = set()
        for seg in task.dataset(split).segments:
            for row in seg.inputs:
                found |= set(re.findall(r"\[doc (\d+)\]", task.decode(row.long().tolist())))
        return found

    train, test = docs("train"), docs("test")
    assert train and test and not train & test


def test_exact_metric_and_slices():
    ev = NIAHEvaluator(("context", "depth_pct"))
    labels = torch.full((2, 6), -100)
    labels[:, -2:] = torch.tensor([[49, 50], [51, 52]])
    logits = torch.zeros(2, 6, 257)
    logits[0, -2, 49] = logits[0, -1, 50] = 1.0  # example 0: both digits right
    logits[1, -2, 51] = 1.0  # example 1: one digit right
    ev.update(logits, labels, {"context": torch.tensor([8, 8]), "depth_pct": torch.tensor([0, 50])})
    out = ev.compute()
    assert out["exact"] == 0.5 and out["accuracy"] == 0.75
    assert out["exact/depth_pct=0"] == 1.0 and out["exact/depth_pct=50"] == 0.0 and out["accuracy/context=8"] == 0.75


def test_metric_names_are_known_without_evaluating(task, check_metric_names):
    check_metric_names(task)  # exact and its slices besides the base metrics


def test_deterministic_and_config_errors(tmp_path, task):
    again = tasks.build("niah", use_cache=False, **{k: v for k, v in task.config.to_dict().items()})
    again.cache_dir = task.cache_dir
    assert all(
        torch.equal(a.inputs, b.inputs)
        for a, b in zip(again.generate("test"), task.dataset("test").segments, strict=False)
    )
    with pytest.raises(ValueError, match="depths: expected fractions in \\[0, 1\\]"):
        tasks.build("niah", depths=[1.5])
    with pytest.raises(ValueError, match="contexts: expected an integer >= "):
        tasks.build("niah", contexts=[32])
    # more digits than the longest context holds (10**30 could not even be made a string)
    with pytest.raises(ValueError, match=r"^digits: expected an integer from 1 to 457 .* 1024 tokens\), got 10{30}"):
        tasks.build("niah", digits=10**30)
    for depths in ("0,0.5", ["x"], [None], [True]):
        with pytest.raises(ValueError, match=r"depths: expected fractions in \[0, 1\] \(a list of numbers\)"):
            tasks.build("niah", depths=depths)
    for option in ("contexts", "depths"):
        with pytest.raises(ValueError, match=f"{option}: expected at least one value"):
            tasks.build("niah", **{option: []})


def test_cache_key_follows_the_haystack_generator(task, monkeypatch):
    from lcsm.tasks.lm import LanguageModelling

    key = task.cache_key("test")
    monkeypatch.setattr(LanguageModelling, "generator_version", LanguageModelling.generator_version + 1)
    assert task.cache_key("test") != key


def test_the_byte_tokenizer_is_the_task_s(task):
    from lcsm.tasks.lm import ByteTokenizer

    assert isinstance(task.tokenizer, ByteTokenizer) and task.decode(task.encode("Ahab 1234")) == "Ahab 1234"


def test_cache_follows_the_corpus_files(tmp_path, task):
    key, first = task.cache_key("test"), task.dataset("test").segments[0].inputs
    corpus = tmp_path / "corpus"
    for f in corpus.glob("*.txt"):
        f.write_text(f.read_text().upper())
    again = tasks.build("niah", **{"cache_dir": tmp_path / "cache", **task.config.to_dict()})
    assert again.cache_key("test") != key
    assert not torch.equal(again.dataset("test").segments[0].inputs, first)


def test_trains_end_to_end(tmp_path, make_corpus, train_tiny):
    corpus = make_corpus(tmp_path / "corpus", n_docs=40, words=200)
    result, losses = train_tiny(
        {
            "name": "niah",
            "corpus": f"path:{corpus}",
            "contexts": [128],
            "depths": [0.5],
            "train_examples": 64,
            "test_examples": 16,
        },
        steps=30,
        batch_size=16,
        lr=1e-2,
    )
    # from ln 257 = 5.55 (uniform bytes) to the ten digits (ln 10 = 2.30) at least
    assert losses[0] > 5 and sum(losses[-5:]) / 5 < 3.0
    assert {"exact", "exact/context=128", "accuracy/depth_pct=50"} <= set(result["metrics"])


def test_depths_equal_in_whole_percents_are_an_error():
    with pytest.raises(ValueError, match=r"^depths: segments are named and seeded by whole percents.*\[50, 50\]"):
        tasks.build("niah", depths=(0.5, 0.504))


def test_contexts_may_be_a_comma_string_as_mqar_grids_are():
    assert tasks.build("niah", contexts="256, 512").config.contexts == (256, 512)
    with pytest.raises(
        ValueError, match=r"^contexts: expected lengths separated by commas, e.g. '16,64', got '256;512'"
    ):
        tasks.build("niah", contexts="256;512")


def test_repeated_contexts_are_an_error():
    with pytest.raises(ValueError, match=r"^contexts: expected distinct lengths, got \(256, 256\)"):
        tasks.build("niah", contexts=(256, 256))
