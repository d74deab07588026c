"""word_problems: the group tables, the running products against a direct fold, the options and
the per-length metrics (per token and per whole word)."""

import functools
import itertools

import numpy as np
import pytest
import torch

from lcsm import tasks
from lcsm.tasks.word_problems import group_elements, multiplication_table, running_products


@pytest.mark.parametrize("group, order", [("z2", 2), ("s3", 6), ("a5", 60)])
def test_group_tables_are_groups(group, order):
    table = multiplication_table(group)
    assert table.shape == (order, order)
    elements = group_elements(group)
    assert elements[0] == tuple(range(len(elements[0])))  # 0 is the identity
    assert (table[0] == np.arange(order)).all() and (table[:, 0] == np.arange(order)).all()
    for row in table:  # a Latin square: every element has an inverse, products are closed
        assert sorted(row) == list(range(order))
    a, b, c = np.meshgrid(*[np.arange(order)] * 3, indexing="ij")
    assert (table[table[a, b], c] == table[a, table[b, c]]).all()  # associative


def test_group_structure():
    assert (multiplication_table("z2") == np.array([[0, 1], [1, 0]])).all()  # XOR
    s3 = multiplication_table("s3")
    assert (s3 != s3.T).any()  # S3 is not abelian
    # A5 is the even permutations of 5 points, each once
    a5 = group_elements("a5")
    assert len(set(a5)) == 60 and set(a5) <= set(itertools.permutations(range(5)))
    # composition: (g · h)[i] = h[g[i]]
    g, h = group_elements("s3")[1], group_elements("s3")[3]
    assert group_elements("s3")[s3[1, 3]] == tuple(h[g[i]] for i in range(3))


@pytest.mark.parametrize("group", ["z2", "s3", "a5"])
def test_labels_are_the_running_product(group):
    task = tasks.build("word_problems", group=group, train_examples=7, test_lengths="5,40", use_cache=False)
    table = multiplication_table(group)
    for split in ("train", "test"):
        for seg in task.dataset(split).segments:
            words, labels = seg.inputs.long().numpy(), seg.labels.numpy()
            assert words.min() >= 0 and words.max() < len(table)
            for word, label in zip(words, labels, strict=True):
                fold = [functools.reduce(lambda p, g: table[p, g], word[: t + 1]) for t in range(len(word))]
                assert list(label) == fold
    assert [s.name for s in task.dataset("test").segments] == ["L5", "L40"]
    assert tasks.config_model_fields("word_problems", group=group)["vocab_size"] == len(table)


def test_running_products_parity():
    words = np.array([[1, 0, 1, 1, 0]])
    assert running_products(words, multiplication_table("z2")).tolist() == [[1, 1, 0, 1, 1]]


def test_deterministic_and_seeded():
    def data(seed):
        t = tasks.build("word_problems", group="s3", train_examples=20, seed=seed, use_cache=False)
        return t.dataset("train").segments[0].inputs

    assert torch.equal(data(0), data(0)) and not torch.equal(data(0), data(1))


def test_one_length_may_be_a_number():
    task = tasks.build("word_problems", train_lengths=16, test_lengths=32, use_cache=False)
    assert task.config.train_lengths == (16,) and task.config.test_lengths == (32,)


@pytest.mark.parametrize(
    "option, value, pattern",
    [
        ("group", "s4", "group: expected one of 'z2', 's3', 'a5', got 's4'"),
        ("train_lengths", "16,x", "train_lengths: expected lengths separated by commas"),
        ("test_lengths", [], "test_lengths: expected a non-empty sequence of lengths"),
        ("test_lengths", True, "test_lengths: expected a non-empty sequence of lengths"),
        ("test_lengths", [16, 16], "test_lengths: duplicate lengths"),
        ("train_lengths", [0], "train_lengths length: expected an integer >= 1, got 0"),
        ("train_examples", 0, "train_examples: expected an integer >= 1, got 0"),
    ],
)
def test_bad_options(option, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        tasks.build("word_problems", use_cache=False, **{option: value})


def test_metrics_per_token_and_per_word():
    task = tasks.build("word_problems", group="z2", test_examples=2, test_lengths="4,8", use_cache=False)
    ev = task.evaluator()
    data = task.dataset("test")
    for batch in data.loader(batch_size=4):
        labels = batch["labels"]
        logits = torch.nn.functional.one_hot(labels, 2).double()
        # first word of each length: one wrong token; second: all right
        logits[0, 0] = logits[0, 0].flip(0)
        ev.update(logits, labels, batch)
    m = ev.compute()
    assert m["accuracy/L4"] == pytest.approx((3 / 4 + 1) / 2)
    assert m["accuracy/L8"] == pytest.approx((7 / 8 + 1) / 2)
    assert m["sequence_accuracy/L4"] == m["sequence_accuracy/L8"] == m["sequence_accuracy"] == 0.5
    assert set(ev.metric_names(data)) == set(m)
