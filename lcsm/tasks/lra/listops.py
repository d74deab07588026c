"""ListOps (Nangia & Bowman 2018) as in the Long Range Arena (Tay et al. 2020, section 3.1).

An example is a nested prefix expression over the digits 0-9 and four list operators; the label
is its value (10 classes)::

    [MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]   ->   5

    MAX, MIN   maximum / minimum of the arguments
    MED        median, truncated to an integer (the mean of the two middle values, rounded down)
    SM         sum modulo 10

Generator (our own, following the LRA recipe): a node at depth < max_depth is a digit with
probability 0.75, else an operator with 2..max_args arguments, each a node one level deeper; nodes
at max_depth are digits. Whole expressions are drawn until their token count lies in
[min_length, max_length], bounds included (LRA's generator keeps min_length < length <
max_length, bounds excluded: 501-1999 tokens at its options; with ours, min_length: 501,
max_length: 1999 gives the same range). LRA: depth 10, up to 10 arguments; the defaults here are
CPU-sized, see docs/tasks.md. Each expression belongs to one split, chosen by a hash
of its text (80 / 10 / 10 % train / validation / test), so splits are disjoint by construction.

Tokens (vocabulary 16): 0 pad, 1-10 the digits 0-9, 11-14 "[MIN" "[MAX" "[MED" "[SM", 15 "]".
LRA's files also carry the parentheses of the tree printer, which we never emit. LRA's published
input pipeline (a tfds text tokenizer that keeps alphanumeric tokens) drops the brackets as well,
"]" included, so its models see no nesting; its maintainers call that a bug
(https://github.com/google-research/long-range-arena/issues/6 and /issues/14). We keep "]", the task as intended.
Sequences are right-padded to max_length with ``extras["lengths"]``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lcsm._checks import check_int

from ..base import Task, register
from ..config import TaskConfig
from ..data import Segment, Uniforms

PAD, CLOSE = 0, 15
OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VOCAB = ["<pad>"] + [str(d) for d in range(10)] + list(OPERATORS) + ["]"]
TOKEN = {t: i for i, t in enumerate(VOCAB)}
LEAF_PROBABILITY = 0.75  # LRA's VALUE_P = 0.25 is the probability of an operator node
SPLIT_SHARES = (("train", 0.8), ("validation", 0.1), ("test", 0.1))


def apply(op: str, args: Sequence[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        ordered = sorted(args)
        # numpy's median (the mean of the two middle values), truncated to an integer class
        return (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) // 2
    return sum(args) % 10


class _TooLong(Exception):
    pass


def draw(u: Uniforms, depth: int, max_depth: int, max_args: int, out: list[str], limit: int) -> int:
    """Append one random node's tokens to ``out``; return its value. Gives up (``_TooLong``) as
    soon as ``out`` passes ``limit`` tokens: such an expression would be rejected anyway, and the
    deep trees of the recipe can grow to many thousands of tokens."""
    if len(out) >= limit:
        raise _TooLong
    if depth >= max_depth or u() < LEAF_PROBABILITY:
        value = u.below(10)
        out.append(str(value))
        return value
    op = OPERATORS[u.below(len(OPERATORS))]
    out.append(op)
    args = [draw(u, depth + 1, max_depth, max_args, out, limit) for _ in range(2 + u.below(max_args - 1))]
    out.append("]")
    return apply(op, args)


def split_of(tokens: Sequence[str]) -> str:
    u = int.from_bytes(hashlib.sha256(" ".join(tokens).encode()).digest()[:8], "big") / 2**64
    for split, share in SPLIT_SHARES:
        if u < share:
            return split
        u -= share
    return SPLIT_SHARES[-1][0]


@dataclass(frozen=True)
class ListOpsConfig(TaskConfig):
    """Options of ``listops``: max_depth, max_args, min_length / max_length (tokens of an
    expression; LRA: 10, 10, 500, 2000), examples per split, seed."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 32
    max_length: int = 256
    train_examples: int = 4000
    validation_examples: int = 500
    test_examples: int = 500
    seed: int = 0

    def __post_init__(self):
        check_int("max_depth", self.max_depth, 1)
        check_int("max_args", self.max_args, 2)
        check_int("min_length", self.min_length, 1)
        check_int("max_length", self.max_length, max(self.min_length, 4))
        for name in ("train_examples", "validation_examples", "test_examples", "seed"):
            check_int(name, getattr(self, name), 0 if name == "seed" else 1)


@register("listops")
class ListOps(Task):
    """ListOps: one segment per split, labels per sequence (10 classes), head "classifier"."""

    Config = ListOpsConfig
    default_head = "classifier"
    splits = ("train", "validation", "test")
    generator_version = 1

    @classmethod
    def config_model_fields(cls, config: ListOpsConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head, "n_classes": 10}, "vocab_size": len(VOCAB)}

    @property
    def max_len(self) -> int:
        return self.config.max_length

    def expressions(self, split: str) -> list[tuple[list[str], int]]:
        """(tokens, value) of every example of ``split``."""
        c = self.config
        self._check_split(split)
        n = {"train": c.train_examples, "validation": c.validation_examples, "test": c.test_examples}[split]
        u = Uniforms(np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, self.splits.index(split)]))))
        out: list[tuple[list[str], int]] = []
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 10_000 + 1_000 * n:
                raise ValueError(
                    f"min_length / max_length: [{c.min_length}, {c.max_length}] is rarely hit by "
                    f"expressions of depth <= {c.max_depth} with <= {c.max_args} arguments; "
                    f"found {len(out)} of {n} in {attempts} draws"
                )
            tokens: list[str] = []
            try:
                value = draw(u, 1, c.max_depth, c.max_args, tokens, c.max_length)
            except _TooLong:
                continue
            if c.min_length <= len(tokens) <= c.max_length and split_of(tokens) == split:
                out.append((tokens, value))
        return out

    def generate(self, split: str) -> list[Segment]:
        examples = self.expressions(split)
        L = self.config.max_length
        ids = torch.full((len(examples), L), PAD, dtype=torch.int64)
        for row, (tokens, _) in enumerate(examples):
            ids[row, : len(tokens)] = torch.tensor([TOKEN[t] for t in tokens])
        labels = torch.tensor([v for _, v in examples])
        lengths = torch.tensor([len(t) for t, _ in examples])
        return [Segment(f"L{L}", ids, labels, {"max_length": L}, {"lengths": lengths})]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(VOCAB[i] for i in ids if i != PAD)

    def describe(self) -> str:
        c = self.config
        return "\n".join(
            [
                "listops: ListOps (Nangia & Bowman 2018) as in LRA (Tay et al. 2020): MIN MAX MED SM over digits",
                f"  depth <= {c.max_depth}, <= {c.max_args} arguments, {c.min_length}-{c.max_length} tokens; "
                f"{c.train_examples} / {c.validation_examples} / {c.test_examples} train / validation / test; "
                f"seed {c.seed}",
                "  head classifier (10 classes); accuracy",
            ]
        )
