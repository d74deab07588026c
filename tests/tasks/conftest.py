"""Shared fixtures of the task tests."""
import pytest

WORDS = "the sea was calm and the ship sailed on through the long night while the crew slept".split()


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
