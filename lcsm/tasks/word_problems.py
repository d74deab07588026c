"""Word problems over finite groups: the state-tracking task (Merrill, Petty & Sabharwal, "The
Illusion of State in State-Space Models", ICML 2024; Grazzi et al., "Unlocking State-Tracking in
Linear RNNs Through Negative Eigenvalues", ICLR 2025).

An example is a word g_1 g_2 ... g_T of group elements (one token each, the element's id); the
label at every position t is the id of the running product p_t = g_1 · g_2 · ... · g_t. The
product g · h is "apply g, then h" on the permuted points: (g · h)[i] = h[g[i]].

Groups: ``z2`` (parity: elements {0, 1}, the product is XOR), ``s3`` (the 6 permutations of 3
points, the smallest non-abelian group) and ``a5`` (the 60 even permutations of 5 points, the
smallest non-solvable group: its word problem is NC^1-complete, so no constant-depth model with
diagonal transitions solves it at every length). Elements are numbered in lexicographic order of
their permutation tuples, so 0 is the identity.

Training uses short words and testing longer ones: length generalisation is the point, so each
test length is its own segment (``accuracy/L<length>``, per-token accuracy) and the evaluator adds
``sequence_accuracy`` (the fraction of words whose every running product is right), overall and
per segment.

Randomness: numpy ``Generator(PCG64)`` seeded from ``SeedSequence([seed, split, length])``; the
tokens are uniform over the group, drawn through ``random()`` (stable across platforms).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from lcsm._checks import check_choice, check_int

from .base import Task, register
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment, SegmentedDataset, Tensor
from .metrics import Evaluator

GROUPS = ("z2", "s3", "a5")
_SPLIT_CODE = {"train": 0, "test": 1}


def _parity(perm: tuple[int, ...]) -> int:
    inversions = sum(a > b for a, b in itertools.combinations(perm, 2))
    return inversions % 2


def group_elements(group: str) -> list[tuple[int, ...]]:
    """The group's elements as permutation tuples, in lexicographic order (identity first)."""
    check_choice("group", group, GROUPS)
    if group == "z2":
        return [(0, 1), (1, 0)]
    if group == "s3":
        return list(itertools.permutations(range(3)))
    return [p for p in itertools.permutations(range(5)) if _parity(p) == 0]


def multiplication_table(group: str) -> np.ndarray:
    """[n, n] int64: table[a, b] = id of a · b, with (a · b)[i] = b[a[i]]."""
    elements = group_elements(group)
    index = {p: i for i, p in enumerate(elements)}
    table = np.empty((len(elements), len(elements)), dtype=np.int64)
    for a, pa in enumerate(elements):
        for b, pb in enumerate(elements):
            table[a, b] = index[tuple(pb[pa[i]] for i in range(len(pa)))]
    return table


def running_products(words: np.ndarray, table: np.ndarray) -> np.ndarray:
    """[N, T] prefix products p_t = p_{t-1} · g_t (p_0 the identity), vectorised over N."""
    out = np.empty_like(words)
    acc = words[:, 0]
    out[:, 0] = acc
    for t in range(1, words.shape[1]):
        acc = table[acc, words[:, t]]
        out[:, t] = acc
    return out


def parse_lengths(name: str, value) -> tuple[int, ...]:
    """``"16,32"`` or ``[16, 32]`` -> (16, 32), ``16`` -> (16,): distinct lengths >= 1."""
    if isinstance(value, str):
        items = value.replace(" ", "").split(",")
        if not all(i.isdigit() for i in items):
            raise ValueError(f"{name}: expected lengths separated by commas, e.g. '16,64', got {value!r}")
        value = [int(i) for i in items]
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]  # one length, as a YAML file gives it
    if not hasattr(value, "__iter__"):
        raise ValueError(f"{name}: expected a non-empty sequence of lengths, got {value!r}")
    lengths = tuple(value)
    if not lengths:
        raise ValueError(f"{name}: expected a non-empty sequence of lengths, got {value!r}")
    for length in lengths:
        check_int(f"{name} length", length, 1)
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"{name}: duplicate lengths in {lengths}")
    return lengths


@dataclass(frozen=True)
class WordProblemsConfig(TaskConfig):
    """Options of the ``word_problems`` task.

    group: ``z2`` (parity), ``s3`` or ``a5``.
    train_lengths / test_lengths: word lengths of each split ("16,64" also works), one segment each.
    train_examples / test_examples: words per length.
    seed: master seed; each (split, length) derives its own stream from it.
    """

    group: str = "z2"
    train_lengths: tuple[int, ...] = (16,)
    test_lengths: tuple[int, ...] = (16, 64, 128, 256)
    train_examples: int = 4000
    test_examples: int = 200
    seed: int = 0

    def __post_init__(self):
        check_choice("group", self.group, GROUPS)
        object.__setattr__(self, "train_lengths", parse_lengths("train_lengths", self.train_lengths))
        object.__setattr__(self, "test_lengths", parse_lengths("test_lengths", self.test_lengths))
        check_int("train_examples", self.train_examples, 1)
        check_int("test_examples", self.test_examples, 1)
        check_int("seed", self.seed, 0)


def segment_name(length: int) -> str:
    return f"L{length}"


class WordProblemsEvaluator(Evaluator):
    """The standard metrics (per-token accuracy, overall and per segment) plus
    ``sequence_accuracy`` and ``sequence_accuracy/<segment>``: the fraction of words whose every
    labelled position is predicted right."""

    def __init__(self, slice_keys=()):
        super().__init__(slice_keys)
        self._seq: dict[str, list[int]] = {}

    @torch.no_grad()
    def update(self, logits: Tensor, labels: Tensor, batch_meta: Mapping[str, object] | None = None) -> None:
        super().update(logits, labels, batch_meta)
        labels = labels.to(logits.device)
        mask = labels != IGNORE_INDEX
        right = ((logits.argmax(-1) == labels) | ~mask).all(-1).cpu().tolist()
        keys = [["sequence_accuracy"] * len(right)]
        if batch_meta is not None and "segment" in batch_meta:
            keys.append([f"sequence_accuracy/{n}" for n in batch_meta["segment"]])
        for row in keys:
            for key, ok in zip(row, right, strict=True):
                slot = self._seq.setdefault(key, [0, 0])
                slot[0] += int(ok)
                slot[1] += 1

    def metric_names(self, dataset: SegmentedDataset | None = None) -> list[str]:
        names = super().metric_names(dataset) + ["sequence_accuracy"]
        if dataset is not None:
            names += [f"sequence_accuracy/{s.name}" for s in dataset.segments]
        return names

    def compute(self) -> dict[str, float]:
        out = super().compute()
        for key, (right, n) in self._seq.items():
            out[key] = right / n
        return out


@register("word_problems")
class WordProblems(Task):
    """Group word problems (state tracking). Splits "train" and "test", one segment per length;
    head "lm" over the group's elements; metrics per length, per token and per whole word."""

    Config = WordProblemsConfig
    default_head = "lm"
    generator_version = 1

    @classmethod
    def config_model_fields(cls, config: WordProblemsConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head}, "vocab_size": len(group_elements(config.group))}

    @classmethod
    def evaluator(cls) -> Evaluator:
        return WordProblemsEvaluator(cls.slice_keys)

    @property
    def max_len(self) -> int:
        return max(self.config.train_lengths + self.config.test_lengths)

    def generate(self, split: str) -> list[Segment]:
        c = self.config
        table = multiplication_table(c.group)
        n = c.train_examples if split == "train" else c.test_examples
        lengths = c.train_lengths if split == "train" else c.test_lengths
        segments = []
        for length in lengths:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, _SPLIT_CODE[split], length])))
            words = np.floor(rng.random((n, length)) * len(table)).astype(np.int64)
            labels = running_products(words, table)
            segments.append(
                Segment(segment_name(length), torch.from_numpy(words), torch.from_numpy(labels), {"seq_len": length})
            )
        return segments

    def describe(self) -> str:
        c = self.config
        n = len(group_elements(c.group))
        return "\n".join(
            [
                f"word_problems: running products over {c.group} ({n} elements), state tracking "
                "(Merrill et al. 2024; Grazzi et al. 2025)",
                f"  train lengths {', '.join(map(str, c.train_lengths))} ({c.train_examples} words each)",
                f"  test lengths {', '.join(map(str, c.test_lengths))} ({c.test_examples} words each)",
                f"  seed {c.seed}; head {self.default_head}; loss: cross-entropy at every position; "
                "accuracy per token and per whole word (sequence_accuracy), overall / per length",
            ]
        )
