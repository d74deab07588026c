"""LRA retrieval (substitute): byte-level matching of two BBC News articles, 1 when they share a
topic, balanced classes (LRA, Tay et al. 2020: AAN citation links; the AAN corpus needs the hub).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from lcsm._checks import check_bool, check_int

from .._real_data import SPLITS, TextConfig, _DocumentTask, _padded, byte_ids
from ..base import register
from ..data import Segment


@dataclass(frozen=True)
class RetrievalConfig(TextConfig):
    """pairs: training pairs (validation and test get pairs // 8), half of them matching; seed:
    the pairing; distinct_pairs: a matching pair never pairs a document with itself (by default
    it may: see ``LRARetrieval``)."""

    max_length: int = 1024
    pairs: int = 2000
    seed: int = 0
    distinct_pairs: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.max_examples is not None and self.max_examples < 2:
            raise ValueError(
                f"max_examples: expected at least 2 for retrieval (a non-matching pair needs documents "
                f"of two topics), got {self.max_examples!r}"
            )
        check_int("pairs", self.pairs, 2)
        check_int("seed", self.seed, 0)
        check_bool("distinct_pairs", self.distinct_pairs)


@register("retrieval")
class LRARetrieval(_DocumentTask):
    """LRA retrieval (substitute): do two BBC News articles share a topic? Byte-level, dual head.

    Each pair draws its first document uniformly from the split, its second from the documents of
    the same topic (matching pairs, every other pair) or of the other topics. By default the
    same-topic pool still holds the first document, so a matching pair is now and then one article
    twice, which a model can answer by comparing bytes: 1 of 1000 training, 4 of 125 validation and
    8 of 125 test matching pairs at the default options (one in a topic's number of documents). LRA's label
    is a citation link between two papers of the ACL
    Anthology Network (Tay et al. 2020, "Byte-level document retrieval"), so its matching pairs
    are two different papers: self-pairs are our sampler's, not the protocol's. ``distinct_pairs``
    leaves the first document out of the pool. It is off by default: the committed LRA results
    (results/etsmlp_lra) were trained without it, and without it every other option's data
    stay bit for bit as they were before it existed (tested).
    """

    Config = RetrievalConfig
    default_head = "dual"
    source = "bbc_news"
    byte_level = True

    @classmethod
    def config_model_fields(cls, config: RetrievalConfig) -> dict[str, object]:
        fields = super().config_model_fields(config)
        return {**fields, "head": {**fields["head"], "n_classes": 2}}

    @property
    def n_classes(self) -> int:  # match or not, whatever the topics: not read from the documents
        return 2

    def generate(self, split: str) -> list[Segment]:
        c = self.config
        docs = self.examples(split)
        by_label: dict[int, list[int]] = collections.defaultdict(list)
        for i, (_, label) in enumerate(docs):
            by_label[label].append(i)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, SPLITS.index(split)])))
        if len(by_label) < 2:
            kept = " that max_examples keeps" if c.max_examples else ""
            raise ValueError(
                f"max_examples: the {split} split's {len(docs)} document(s){kept} are all of topic "
                f"{self.classes[docs[0][1]]!r}, so no non-matching pair can be made; expected documents of "
                f"at least 2 topics{'; raise max_examples' if c.max_examples else ''}"
            )
        n = c.pairs if split == "train" else max(2, c.pairs // 8)
        first, second, labels = [], [], []
        for k in range(n):
            a = int(rng.integers(len(docs)))
            match = k % 2 == 0
            pool = by_label[docs[a][1]] if match else [i for i in range(len(docs)) if docs[i][1] != docs[a][1]]
            if match and c.distinct_pairs:  # a pair of one article twice is matched by comparing bytes
                pool = [i for i in pool if i != a]
                if not pool:
                    kept = f" of the {len(docs)} that max_examples keeps" if c.max_examples else ""
                    raise ValueError(
                        f"distinct_pairs: the {split} split holds one document of topic "
                        f"{self.classes[docs[a][1]]!r}{kept}, so no matching pair of two distinct "
                        f"documents starts from it; expected at least 2 per topic; "
                        f"{'raise max_examples or ' if c.max_examples else ''}set distinct_pairs false"
                    )
            b = pool[int(rng.integers(len(pool)))]
            first.append(byte_ids(docs[a][0]))
            second.append(byte_ids(docs[b][0]))
            labels.append(int(match))
        ids1, len1 = _padded(first, c.max_length)
        ids2, len2 = _padded(second, c.max_length)
        return [
            Segment(
                f"L{c.max_length}",
                ids1,
                torch.tensor(labels),
                {"max_length": c.max_length},
                {"lengths": len1, "input_ids2": ids2, "lengths2": len2},
            )
        ]
