"""The lm task: corpora readers, document splits, token windows, tokenizers, perplexity, training."""

import json
import math

import pytest
import torch

from lcsm import tasks
from lcsm.models import ModelConfig, build_model
from lcsm.tasks import IGNORE_INDEX
from lcsm.tasks.base import packed_cu_seqlens
from lcsm.tasks.lm import (
    ByteTokenizer,
    LMConfig,
    LMEvaluator,
    moby_dick_documents,
    sotu_documents,
    split_of,
    wikitext_documents,
)
from lcsm.testing import assert_close


@pytest.fixture
def corpus(tmp_path, make_corpus):
    return make_corpus(tmp_path / "corpus")


def build(tmp_path, corpus, **options):
    return tasks.build(
        "lm",
        cache_dir=tmp_path / "cache",
        corpus=f"path:{corpus}",
        seq_len=32,
        validation_fraction=0.2,
        test_fraction=0.2,
        **options,
    )


def test_documents_split_disjointly_and_stably(tmp_path, corpus):
    task = build(tmp_path, corpus)
    docs = task.documents()
    ids = {s: {d for d, _ in docs[s]} for s in task.splits}
    assert all(ids.values())
    assert not (ids["train"] & ids["validation"] or ids["train"] & ids["test"] or ids["validation"] & ids["test"])
    assert sum(map(len, ids.values())) == 40
    # the split of a document does not depend on the others
    assert all(split_of(d, 0, 0.2, 0.2) == s for s, group in ids.items() for d in group)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_windows_cover_the_stream_once(tmp_path, corpus, tokenizer):
    task = build(tmp_path, corpus, tokenizer=tokenizer, bpe_vocab=300)
    for split in task.splits:
        stream = torch.from_numpy(task.stream(split).astype("int64"))
        seg = task.dataset(split).segments[0]
        x, y = seg.inputs.long(), seg.labels.long()
        assert x.shape[1] == 32 and torch.equal(x[:, 1:], y[:, :-1])
        covered = torch.cat([x.reshape(-1), y[-1, -1:]])
        assert torch.equal(covered, stream[: len(covered)]) and len(stream) - len(covered) < 32
        # one end-of-document token after every document of the split
        assert int((stream == task.tokenizer.eod).sum()) == len(task.documents()[split])


def test_byte_and_bpe_round_trip(tmp_path, corpus):
    byte = build(tmp_path, corpus)
    assert byte.vocab_size == 257 and byte.decode(byte.encode("Call me Ishmael — ok")) == "Call me Ishmael — ok"
    bpe = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300)
    text = "the ship sailed on"
    assert bpe.decode(bpe.encode(text)) == text and len(bpe.encode(text)) < len(text)
    assert 256 < bpe.vocab_size <= 300
    saved = list((tmp_path / "cache" / "lm").glob("bpe-*.json"))
    assert len(saved) == 1
    again = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300)
    assert again.encode(text) == bpe.encode(text)


def test_bpe_is_trained_once_per_process_without_the_cache(tmp_path, corpus, monkeypatch):
    # Validating a sweep builds every run's task without the cache; each needs the vocabulary size.
    from lcsm.tasks.lm import BPETokenizer

    trained = []
    train = BPETokenizer.train.__func__
    monkeypatch.setattr(BPETokenizer, "train", classmethod(lambda cls, *a: trained.append(1) or train(cls, *a)))
    first, second = (build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300, use_cache=False) for _ in range(2))
    assert first.vocab_size == second.vocab_size and len(trained) == 1
    assert not (tmp_path / "cache").exists()
    cached = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300)
    assert cached.vocab_size == first.vocab_size and len(trained) == 1
    assert len(list((tmp_path / "cache" / "lm").glob("bpe-*.json"))) == 1


def test_bpe_is_trained_on_the_training_split_only(tmp_path, make_corpus):
    root = make_corpus(tmp_path / "c", n_docs=30)
    task = build(tmp_path, root, tokenizer="bpe", bpe_vocab=400)
    held_out = " ".join(t for s in ("validation", "test") for _, t in task.documents()[s])
    marker = next(w for w in ("zyzzyva",) if w not in held_out)
    # a word placed only in held-out documents must not have become a learned merge
    (root / task.documents()["test"][0][0]).write_text((marker + " ") * 500)
    retrained = build(tmp_path, root, tokenizer="bpe", bpe_vocab=400)
    assert len(retrained.encode(marker)) > 1


def test_stdlib_corpus_layouts(tmp_path):
    sotu = tmp_path / "sotu" / "package" / "data"
    sotu.mkdir(parents=True)
    (sotu / "1790_george_washington_n.json").write_text(json.dumps({"year": 1790, "text": "Fellow-Citizens"}))
    (sotu / "1790_george_washington_n.txt").write_text("Fellow-Citizens")
    moby = tmp_path / "moby_dick" / "package" / "data"
    moby.mkdir(parents=True)
    (moby / "chapter_1.json").write_text(json.dumps({"chapter": "1", "title": "Loomings.", "text": "Call me Ishmael."}))
    (moby / "file_list.json").write_text(json.dumps(["chapter_1"]))
    assert sotu_documents(tmp_path / "sotu") == [("sotu/1790_george_washington_n", "Fellow-Citizens")]
    assert moby_dick_documents(tmp_path / "moby_dick") == [("moby_dick/chapter_1", "Loomings.\n\nCall me Ishmael.")]
    task = tasks.build("lm", data_dir=str(tmp_path), corpus="moby_dick", use_cache=False)
    with pytest.raises(ValueError, match="leave split"):
        task.documents()


def test_wikitext_records_group_into_articles():
    records = [
        {"text": ""},
        {"text": " = Valkyria = \n"},
        {"text": " Senjō no Valkyria \n"},
        {"text": " = = Gameplay = = \n"},
        {"text": " text \n"},
        {"text": " = Tower Building = \n"},
        {"text": " built \n"},
    ]
    docs = wikitext_documents(records)
    assert len(docs) == 2 and docs[0][1].count("Gameplay") == 1 and docs[1][1].startswith(" = Tower")


def test_one_file_is_cut_at_line_breaks_into_the_three_splits(tmp_path):
    lines = [f"line {i}: " + "word " * (i % 7 + 1) + "\n" for i in range(400)]
    path = tmp_path / "one.txt"
    path.write_text("".join(lines))
    task = tasks.build("lm", corpus=f"path:{path}", seq_len=16, use_cache=False)
    docs = task.documents()
    parts = [docs[split][0][1] for split in task.splits]
    assert all(len(docs[split]) == 1 for split in task.splits) and "".join(parts) == path.read_text()
    assert all(part.endswith("\n") for part in parts)  # whole lines, in the file's order
    shares = [len(part) / len(path.read_text()) for part in parts]
    assert shares[1] == pytest.approx(0.05, abs=0.01) and shares[2] == pytest.approx(0.05, abs=0.01)
    assert len(task.dataset("test")) > 0
    (tmp_path / "short.txt").write_text("a single line\n")
    with pytest.raises(ValueError, match=r"one file's lines leave split\(s\) \['validation', 'test'\] empty"):
        tasks.build("lm", corpus=f"path:{tmp_path / 'short.txt'}", use_cache=False).documents()


def test_bpe_reads_the_end_of_document_text_in_a_document_as_text(tmp_path, corpus):
    bpe = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300)
    ids = bpe.encode("a<|endoftext|>b")
    assert bpe.tokenizer.eod not in ids and bpe.decode(ids) == "a<|endoftext|>b"


def test_a_damaged_bpe_file_is_trained_again_with_a_warning(tmp_path, corpus):
    from lcsm.tasks import lm

    text = "the ship sailed on"
    ids = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300).encode(text)
    (saved,) = (tmp_path / "cache" / "lm").glob("bpe-*.json")
    saved.write_text(saved.read_text()[:2000])
    lm._TRAINED_BPE.clear()  # as a new process
    with pytest.warns(RuntimeWarning, match="ignoring corrupt BPE tokenizer file"):
        assert build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300).encode(text) == ids
    lm._TRAINED_BPE.clear()
    assert build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300).encode(text) == ids  # the file replaced


def test_wikitext_offline_says_what_to_do(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from lcsm.data import SourceUnavailable

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SourceUnavailable, match="corpus 'wikitext-2': the Hugging Face hub could not serve"):
        tasks.build("lm", corpus="wikitext-2", use_cache=False).documents()


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="corpus: expected one of default"):
        tasks.build("lm", corpus="wikitext")
    with pytest.raises(ValueError, match="tokenizer: expected 'byte' or 'bpe'"):
        tasks.build("lm", tokenizer="bytes")
    with pytest.raises(ValueError, match="corpus: expected 'path:<file or directory>' with a path"):
        tasks.build("lm", corpus="path:")
    with pytest.raises(ValueError, match="no such file or directory"):
        tasks.build("lm", corpus=f"path:{tmp_path / 'none'}").documents()
    with pytest.raises(ValueError, match="data_dir: expected the source directory"):
        tasks.build("lm", data_dir=str(tmp_path)).documents()


def test_perplexity_is_exp_loss():
    ev = LMEvaluator()
    logits = torch.randn(2, 5, 257)
    labels = torch.randint(0, 257, (2, 5))
    ev.update(logits, labels)
    out = ev.compute()
    assert out["perplexity"] == pytest.approx(math.exp(out["loss"]))


def test_perplexity_of_a_diverged_model_is_inf():
    ev = LMEvaluator()
    logits = torch.zeros(1, 4, 3)
    logits[..., 0] = 1000.0  # every token wrong by a margin of 1000 nats
    ev.update(logits, torch.ones(1, 4, dtype=torch.long))
    out = ev.compute()
    assert out["loss"] == pytest.approx(1000.0) and out["perplexity"] == math.inf


def test_metric_names_are_known_without_evaluating(tmp_path, corpus, check_metric_names):
    check_metric_names(build(tmp_path, corpus))  # perplexity besides the base metrics


def test_cache_follows_the_corpus_files(tmp_path, corpus):
    before = build(tmp_path, corpus)
    key, n = before.cache_key("train"), sum(len(before.dataset(s)) for s in before.splits)
    (corpus / "extra.txt").write_text("more text " * 400)
    after = build(tmp_path, corpus)
    assert after.cache_key("train") != key
    assert sum(len(after.dataset(s)) for s in after.splits) > n


def test_cache_follows_the_data_dir_files(tmp_path):
    moby = tmp_path / "moby_dick" / "package" / "data"
    moby.mkdir(parents=True)
    for i in range(30):
        (moby / f"chapter_{i}.json").write_text(
            json.dumps({"chapter": str(i), "title": "T.", "text": "Call me. " * 50})
        )
    (moby / "file_list.json").write_text(json.dumps([f"chapter_{i}" for i in range(30)]))

    def build():
        return tasks.build(
            "lm",
            cache_dir=tmp_path / "cache",
            data_dir=str(tmp_path),
            corpus="moby_dick",
            seq_len=32,
            validation_fraction=0.2,
            test_fraction=0.2,
        )

    before = build()
    key, n = before.cache_key("train"), sum(len(before.dataset(s)) for s in before.splits)
    (moby / "chapter_0.json").write_text(json.dumps({"chapter": "0", "title": "T.", "text": "Call me. " * 500}))
    after = build()
    assert after.cache_key("train") != key
    assert sum(len(after.dataset(s)) for s in after.splits) > n


def test_trains_end_to_end(corpus, train_tiny):
    result, losses = train_tiny(
        {"name": "lm", "corpus": f"path:{corpus}", "seq_len": 32, "validation_fraction": 0.2, "test_fraction": 0.2},
        steps=40,
        batch_size=8,
        lr=1e-2,
    )
    assert result["eval_split"] == "validation" and "perplexity" in result["metrics"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0  # from ln 257 = 5.55 towards the word structure
    assert result["metrics"]["perplexity"] < 60


def test_byte_tokenizer_skips_end_of_document_when_decoding():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("ab") + [tok.eod] + tok.encode("c")) == "abc"


# ----------------------------------------------------------------------------- packing


@pytest.fixture
def short_docs(tmp_path, make_corpus):
    """Documents of about 40 bytes: rows of 32 tokens hold document ends and starts."""
    return make_corpus(tmp_path / "short", words=6)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_packed_rows_carry_their_document_boundaries(tmp_path, short_docs, tokenizer):
    plain = build(tmp_path, short_docs, tokenizer=tokenizer, bpe_vocab=300)
    packed = build(tmp_path, short_docs, tokenizer=tokenizer, bpe_vocab=300, packing=True)
    eod = packed.tokenizer.eod
    assert eod is not None and eod == plain.tokenizer.eod
    for split in packed.splits:
        a, b = plain.dataset(split).segments[0], packed.dataset(split).segments[0]
        x, y, starts = b.inputs.long(), b.labels.long(), b.extras["document_starts"].long()
        # the same windows; no target where the input ends a document (its next token begins another)
        assert torch.equal(x, a.inputs.long()) and "document_starts" not in a.extras
        assert torch.equal(y == IGNORE_INDEX, x == eod)
        assert torch.equal(y[x != eod], a.labels.long()[x != eod])
        # a document starts after each end-of-document token and at every row's start
        assert torch.equal(starts[:, 1:] == 1, x[:, :-1] == eod) and bool((starts[:, 0] == 1).all())
        assert int(starts[:, 1:].sum()) > len(x) // 2  # the rows hold boundaries inside them


def test_a_batch_of_packed_rows_runs_as_one_row_with_cu_seqlens(tmp_path, short_docs):
    task = build(tmp_path, short_docs, packing=True)
    batch = task.dataset("train").__getitems__([3, 4, 5])
    x, T = batch["input_ids"], batch["input_ids"].shape[1]
    expected = []
    for r in range(3):
        expected += [r * T] + [r * T + j for j in range(1, T) if x[r, j - 1] == task.tokenizer.eod]
    cu = packed_cu_seqlens(batch["document_starts"], x)
    assert cu.dtype == torch.int32 and cu.tolist() == expected + [3 * T]
    with pytest.raises(ValueError, match=r"document_starts: expected the shape of input_ids \[B, T\] = \[3, 32\]"):
        packed_cu_seqlens(batch["document_starts"][:, 1:], x)


def test_packed_logits_are_each_document_alone(tmp_path, short_docs):
    task = build(tmp_path, short_docs, packing=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig(mixer="gla", vocab_size=task.vocab_size, d_model=16, n_layers=2), verbose=False)
    model = model.double()
    batch = task.dataset("train").__getitems__([0, 1])
    logits = task.logits(model, batch)
    cu = packed_cu_seqlens(batch["document_starts"], batch["input_ids"]).tolist()
    flat_ids, flat_logits = batch["input_ids"].reshape(-1), logits.reshape(-1, logits.shape[-1])
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        alone = model(flat_ids[a:b].unsqueeze(0))[0]
        assert_close({"logits": flat_logits[a:b]}, {"logits": alone}, context=f"document [{a}, {b})")


def test_unpacked_data_and_tokenizer_are_those_of_before_the_option(tmp_path, corpus):
    # The cache key hashes the options: an unpacked config hashes as it did without the option.
    assert "packing" not in LMConfig().to_dict() and LMConfig(packing=True).to_dict()["packing"] is True
    plain = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300)
    packed = build(tmp_path, corpus, tokenizer="bpe", bpe_vocab=300, packing=True)
    assert packed.cache_key("train") != plain.cache_key("train")
    # the packed task reads back the unpacked one's tokenizer: one file
    assert packed.encode("the ship sailed") == plain.encode("the ship sailed")
    assert len(list((tmp_path / "cache" / "lm").glob("bpe-*.json"))) == 1


def test_packing_errors():
    with pytest.raises(ValueError, match="packing: expected True or False, got 'yes'"):
        tasks.build("lm", packing="yes")
    with pytest.raises(ValueError, match="task 'mqar': option 'packing' .* only the 'lm' task has"):
        tasks.build("mqar", packing=True)
