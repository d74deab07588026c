"""ListOps: labels equal an independent evaluator, LRA's limits hold, splits are disjoint."""

import statistics

import pytest
import torch

from lcsm import tasks

SMALL = dict(max_length=96, min_length=16, train_examples=300, validation_examples=60, test_examples=60)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return tasks.build("listops", cache_dir=tmp_path_factory.mktemp("cache"), **SMALL)


def evaluate(tokens):
    """A recursive-descent evaluator written from the task's definition, independent of the generator."""

    def node(i):
        tok = tokens[i]
        if tok.isdigit():
            return int(tok), i + 1, 1
        args, i, depth = [], i + 1, 0
        while tokens[i] != "]":
            value, i, d = node(i)
            args.append(value)
            depth = max(depth, d)
        assert len(args) >= 2
        result = {"[MIN": min, "[MAX": max, "[SM": lambda a: sum(a) % 10, "[MED": lambda a: int(statistics.median(a))}[
            tok
        ](args)
        return result, i + 1, depth + 1

    value, end, depth = node(0)
    assert end == len(tokens)
    return value, depth


def test_labels_equal_a_direct_evaluation(task):
    for split in task.splits:
        seg = task.dataset(split).segments[0]
        for row in range(len(seg)):
            n = int(seg.extras["lengths"][row])
            ids = seg.inputs[row].long()
            assert bool((ids[n:] == 0).all()) and bool((ids[:n] != 0).all())
            tokens = task.decode(ids.tolist()).split()
            value, depth = evaluate(tokens)
            assert value == int(seg.labels[row])
            assert SMALL["min_length"] <= n <= SMALL["max_length"] and depth <= 10


def test_splits_disjoint_and_classes_spread(task):
    seen = {}
    for split in task.splits:
        seg = task.dataset(split).segments[0]
        seen[split] = {tuple(seg.inputs[r, : int(seg.extras["lengths"][r])].tolist()) for r in range(len(seg))}
    assert not (seen["train"] & seen["test"] or seen["train"] & seen["validation"] or seen["validation"] & seen["test"])
    labels = task.dataset("train").segments[0].labels.long()
    assert len(set(labels.tolist())) == 10


def test_deterministic_and_errors(tmp_path, task):
    again = tasks.build("listops", use_cache=False, **SMALL)
    assert torch.equal(again.generate("test")[0].inputs.long(), task.dataset("test").segments[0].inputs.long())
    with pytest.raises(ValueError, match="max_args: expected an integer >= 2"):
        tasks.build("listops", max_args=1)
    with pytest.raises(ValueError, match="rarely hit"):
        tasks.build("listops", use_cache=False, max_depth=2, min_length=50, max_length=60, train_examples=5).dataset(
            "train"
        )


def test_trains_end_to_end(train_tiny):
    result, losses = train_tiny({"name": "listops", **SMALL}, steps=30, batch_size=20)
    assert result["eval_split"] == "validation" and all(loss == loss for loss in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # learns the label prior at least
