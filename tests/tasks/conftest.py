"""Shared fixtures of the task tests."""

import pytest

WORDS = [
    "the",
    "sea",
    "was",
    "calm",
    "and",
    "the",
    "ship",
    "sailed",
    "on",
    "through",
    "the",
    "long",
    "night",
    "while",
    "the",
    "crew",
    "slept",
]


def _write_corpus(root, n_docs=40, words=120):
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        text = " ".join(WORDS[(d * 7 + i) % len(WORDS)] for i in range(words)) + f" [doc {d}]"
        (root / f"doc{d:03d}.txt").write_text(text)
    return root


@pytest.fixture
def make_corpus():
    """A function writing a small plain-text corpus: n_docs files, each ending with "[doc <i>]"."""
    return _write_corpus


@pytest.fixture
def train_tiny(tmp_path, monkeypatch):
    """Train a one-layer GLA on a task through the engine; returns (result, training losses)."""
    import json

    from lcsm.engine import RunConfig, train

    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "lcsm"))

    def run(task, steps, batch_size, lr=3e-3, d_model=32):
        result = train(
            RunConfig.from_dict(
                {
                    "out_dir": str(tmp_path / "run"),
                    "task": task,
                    "model": {"mixer": "gla", "d_model": d_model, "n_layers": 1},
                    "optim": {"lr": lr},
                    "train": {"max_steps": steps, "batch_size": batch_size},
                    "run": {"log_every": 1, "threads": 1},
                }
            ),
            quiet=True,
        )
        records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        return result, [r["loss"] for r in records if r["kind"] == "train"]

    return run


@pytest.fixture
def check_metric_names():
    """A function asserting that ``task.evaluator().metric_names`` lists exactly the metrics an
    evaluation of each split gives (random logits), and without data those of them without a '/'."""
    import torch

    def check(task):
        for split in task.splits:
            dataset, evaluator = task.dataset(split), task.evaluator()
            for batch in dataset.loader(16):
                logits = torch.randn(*batch["labels"].shape, task.n_classes or task.vocab_size)
                evaluator.update(logits, batch["labels"], batch)
            computed = sorted(evaluator.compute())
            assert sorted(task.evaluator().metric_names(dataset)) == computed, split
            assert sorted(task.evaluator().metric_names()) == [k for k in computed if "/" not in k], split

    return check
