"""The task registry and typed configs: names, options, validation errors, the Task interface."""

import dataclasses

import pytest
import torch

from lcsm import tasks
from lcsm._checks import check_int
from lcsm.tasks import base, cache, config
from lcsm.tasks.mqar import STANDARD_GRID, MQARConfig


def test_mqar_is_registered_with_its_interface():
    assert "mqar" in tasks.available()
    task = tasks.build("mqar", use_cache=False)
    assert isinstance(task, tasks.Task) and task.registry_name == "mqar"
    assert task.default_head == "lm" and task.vocab_size == 8192 and task.max_len == 512
    assert task.splits == ("train", "test")
    assert task.config.train_grid == STANDARD_GRID == ((64, 4), (128, 8), (256, 16), (512, 64))
    text = task.describe()
    for needle in ("Zoology", "8192", "L512-kv64", "a=0.01", "head lm", "seed 0"):
        assert needle in text, needle


def test_unknown_task_lists_valid_names_and_suggests():
    with pytest.raises(ValueError, match=r"unknown task 'mqr'\. Did you mean mqar\? Valid names: .*mqar"):
        tasks.build("mqr")
    with pytest.raises(TypeError, match="task name"):
        tasks.build(3)


def test_unknown_option_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown option\(s\) 'train_exampels' \(did you mean 'train_examples'\?\)"):
        tasks.build("mqar", train_exampels=10)
    with pytest.raises(ValueError, match=r"'zzz'\. Valid options: vocab_size, train_grid, test_grid"):
        tasks.build("mqar", zzz=1)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(vocab_size=0), r"vocab_size: expected an integer >= 4, got 0"),
        (dict(vocab_size=8192.0), r"vocab_size: expected an integer"),
        (dict(train_examples=0), r"train_examples: expected an integer >= 1"),
        (dict(test_examples=True), r"test_examples: expected an integer"),
        (dict(seed=-1), r"seed: expected an integer >= 0"),
        (dict(power_a=0), r"power_a: expected a positive finite number, got 0"),
        (dict(power_a=float("nan")), r"power_a: expected a positive finite number"),
        (dict(power_a=float("inf")), r"power_a: expected a positive finite number"),
        (dict(random_non_queries="yes"), r"random_non_queries: expected True or False"),
        (dict(train_grid=[(63, 4)]), r"train_grid: seq_len must be even"),
        (dict(test_grid=[(64, 17)]), r"test_grid: kv_pairs must satisfy 4 \* kv_pairs <= seq_len"),
        (dict(train_grid=[(64, 4), (64, 4)]), r"train_grid: duplicate"),
        (dict(train_grid=[]), r"train_grid: expected a non-empty sequence"),
        (dict(train_grid=[(64, 4, 1)]), r"train_grid: expected a non-empty sequence of \(seq_len, kv_pairs\)"),
        (dict(train_grid=5), r"train_grid: expected a sequence"),
        (dict(train_grid="64x4"), r"train_grid: expected 'seq_len:kv_pairs' pairs"),
        (dict(train_grid=[(64, 0)]), r"train_grid kv_pairs: expected an integer >= 1"),
        (dict(vocab_size=100, train_grid="64:4", test_grid="256:64"), r"vocab_size: 100 gives 49 keys"),
    ],
)
def test_bad_options_name_the_argument(options, match):
    with pytest.raises(ValueError, match=match):
        tasks.build("mqar", **options)


def test_grid_strings_and_lists_are_the_same_config():
    a = tasks.build("mqar", train_grid="64:4, 128:8", use_cache=False)
    b = tasks.build("mqar", train_grid=[[64, 4], [128, 8]], use_cache=False)
    assert a.config == b.config and a.config.train_grid == ((64, 4), (128, 8))
    assert a.cache_key("train") == b.cache_key("train")
    assert a.cache_key("train") != a.cache_key("test")
    # the config round-trips through its JSON view, and cache settings are not part of the data
    assert MQARConfig(**a.config.to_dict()) == a.config
    c = tasks.build("mqar", train_grid="64:4,128:8", cache_dir="/nonexistent")
    assert c.cache_key("train") == a.cache_key("train")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.config.seed = 3


def test_bad_split_and_config_type():
    task = tasks.build("mqar", use_cache=False)
    with pytest.raises(ValueError, match=r"split: expected one of train, test, got 'valid'"):
        task.dataset("valid")
    with pytest.raises(ValueError, match=r"config: expected a MQARConfig"):
        type(task)(config.TaskConfig())
    with pytest.raises(ValueError, match=r"use_cache: expected True or False"):
        tasks.build("mqar", use_cache="no")


REAL_DATA = {"text", "bbc_news", "retrieval", "spam", "rotten_tomatoes", "image"}  # see test_classification


@pytest.mark.parametrize("name", sorted(set(tasks.available()) - REAL_DATA))
def test_the_fields_a_config_fixes_are_those_of_the_built_task(name):
    task = tasks.build(name, use_cache=False)
    assert task.model_fields() == tasks.config_model_fields(name)
    assert task.vocab_size == task.model_fields()["vocab_size"]


def test_register_rejects_duplicates_and_non_tasks():
    with pytest.raises(ValueError, match="registered twice"):
        tasks.register("mqar")(type("Other", (tasks.Task,), {}))
    with pytest.raises(TypeError, match="expected a Task subclass"):
        tasks.register("not-a-task")(object)
    assert "not-a-task" not in tasks.available()


def test_a_new_task_registers_and_builds_generically():
    @dataclasses.dataclass(frozen=True)
    class ToyConfig(tasks.TaskConfig):
        n: int = 3

        def __post_init__(self):
            check_int("n", self.n, 1)

    try:

        @tasks.register("toy-test-only")
        class Toy(tasks.Task):
            Config = ToyConfig
            default_head = "classifier"

        assert "toy-test-only" in tasks.available()
        toy = tasks.build("toy-test-only", n=5, use_cache=False)
        assert toy.config.n == 5 and toy.registry_name == "toy-test-only"
        with pytest.raises(ValueError, match=r"'nn' \(did you mean 'n'\?\)\. Valid options: n"):
            tasks.build("toy-test-only", nn=5)
        with pytest.raises(ValueError, match="n: expected an integer >= 1"):
            tasks.build("toy-test-only", n=0)
    finally:
        base._REGISTRY.pop("toy-test-only", None)


def test_segments_and_datasets_reject_inconsistent_shapes():
    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"segment 's': expected inputs \[N, T, \.\.\.\]"):
        tasks.Segment("s", x, torch.zeros(4, 7, dtype=torch.long), {})
    with pytest.raises(ValueError, match=r"segment 's'"):
        tasks.Segment("s", x, torch.zeros(3, dtype=torch.long), {})
    ok = tasks.Segment("s", x, torch.zeros(4, dtype=torch.long), {})  # one label per sequence
    with pytest.raises(ValueError, match="names must be unique"):
        tasks.SegmentedDataset([ok, ok])
    with pytest.raises(ValueError, match="at least one segment"):
        tasks.SegmentedDataset([])
    with pytest.raises(IndexError, match="out of range"):
        tasks.SegmentedDataset([ok])[4]
    with pytest.raises(ValueError, match="batch_size: expected an integer >= 1, got 0"):
        tasks.SegmentedDataset([ok]).loader(0)


def test_compact_storage_is_lossless():
    for values, dtype in [([-100, 0, 32767], torch.int16), ([-100, 40000], torch.int32), ([0, 2**40], torch.int64)]:
        t = torch.tensor(values)
        c = cache.compact(t)
        assert c.dtype == dtype and torch.equal(c.long(), t)
    f = torch.tensor([0.5, 1.5])
    assert cache.compact(f) is f


def test_per_sequence_labels_give_classification_metrics():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    labels = torch.tensor([0, 0, 0])
    ev = tasks.Evaluator()
    ev.update(logits, labels, {"segment": ["a", "a", "b"]})
    m = ev.compute()
    assert m["accuracy"] == pytest.approx(2 / 3) and m["accuracy/a"] == 0.5 and m["accuracy/b"] == 1.0
    expected = torch.nn.functional.cross_entropy(logits, labels).item()
    assert m["loss"] == pytest.approx(expected)
