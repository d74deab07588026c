"""Multi-query associative recall (MQAR), the Zoology protocol.

Source: Arora, Eyuboglu, Timalsina, Johnson, Poli, Zou, Rudra, Ré, "Zoology: Measuring and
Improving Recall in Efficient Language Models" (arXiv 2312.04927, 2023), and its generator
``zoology/data/multiquery_ar.py`` (https://github.com/HazyResearch/zoology). Used by LCSM §3.2
and MetaLA §6 ("we follow default settings in zoology").

One example of length L (= input length T) with kv key-value pairs, vocabulary V::

    position   0   1   2   3  ... 2kv-1 | 2kv ...                                L-1
    input      k1  v1  k2  v2 ...  v_kv |  0 .. k_j 0 .. k_i 0 ..   (query region, L - 2kv)
    label     -100 ...                  | -100 .. v_j .. v_i ..     (-100 elsewhere)

- keys: kv distinct tokens from [1, V//2); values: kv distinct tokens from [V//2, V);
- the query region (length L - 2kv) is 0 except at one position per key; key j sits at offset
  2·g_j of the query region, where the g_j are kv distinct "gaps" from {0, ..., space-1},
  space = (L - 2kv) // 2, drawn without replacement with P(g = i-1) ∝ a·i^(a-1), a = 0.01
  (a power law: short offsets are much likelier);
- the label of the position holding a queried key is that key's value, so a causal LM trained on
  (inputs, labels) predicts the value right after reading the key (Zoology builds a sequence of
  L+1 tokens, then takes inputs = seq[:-1] and labels = seq[1:]; the value itself is never
  written into the query region, only into the labels);
- every key is queried exactly once.

Accuracy follows Zoology's ``compute_metrics``: per example, the fraction of its labelled (query)
positions whose argmax is the value; reported numbers are means over examples (overall, per
(seq_len, kv_pairs) segment, per kv_pairs).

Randomness: numpy ``Generator(PCG64)`` seeded from ``SeedSequence([seed, split, seq_len,
kv_pairs])`` and consumed only through ``random()`` (uniform doubles), whose stream numpy keeps
stable across platforms, so the same config gives the same tensors on any machine. Zoology calls
``np.random.choice`` (global legacy state); the distributions here are the same (see
``_distinct`` and ``_power_law_gaps``), the exact draws are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lcsm._checks import check_bool, check_float, check_int

from .base import Task, register
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment

Grid = tuple[tuple[int, int], ...]

STANDARD_GRID: Grid = ((64, 4), (128, 8), (256, 16), (512, 64))
"""(seq_len, kv_pairs) of Zoology Figure 2 (arXiv 2312.04927)."""

_SPLIT_CODE = {"train": 0, "test": 1, "validation": 2}
_CHUNK = 1024  # rows generated per step (bounds the temporaries; fixed, so the data is too)
# Rejection's least chance of a row without a repeat, P(no repeat) = prod_i (1 - i / n): about
# 1 / 0.001 redraws a row at most; the demo's 16 keys of 31 (vocabulary 64) have 0.0086.
MIN_NO_REPEAT = 1e-3


def parse_grid(name: str, value) -> Grid:
    """``"64:4,128:8"`` or ``[(64, 4), (128, 8)]`` -> ((64, 4), (128, 8))."""
    if isinstance(value, str):
        pairs = []
        for item in value.replace(" ", "").split(","):
            parts = item.split(":")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise ValueError(
                    f"{name}: expected 'seq_len:kv_pairs' pairs separated by commas, e.g. '64:4,128:8', got {value!r}"
                )
            pairs.append((int(parts[0]), int(parts[1])))
        value = pairs
    try:
        pairs = [tuple(p) for p in value]
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of (seq_len, kv_pairs) pairs, got {value!r}") from None
    if not pairs or any(len(p) != 2 for p in pairs):
        raise ValueError(f"{name}: expected a non-empty sequence of (seq_len, kv_pairs) pairs, got {value!r}")
    for seq_len, kv in pairs:
        check_int(f"{name} seq_len", seq_len, 4)
        check_int(f"{name} kv_pairs", kv, 1)
        if seq_len % 2:
            # Zoology asserts an even length: the query region holds a key every other position.
            raise ValueError(f"{name}: seq_len must be even, got ({seq_len}, {kv})")
        if 4 * kv > seq_len:
            # kv distinct gaps must fit in space = (seq_len - 2 kv) // 2, i.e. 4 kv <= seq_len.
            raise ValueError(
                f"{name}: kv_pairs must satisfy 4 * kv_pairs <= seq_len (kv distinct query "
                f"slots), got ({seq_len}, {kv})"
            )
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"{name}: duplicate (seq_len, kv_pairs) pairs in {pairs}")
    return tuple(pairs)


@dataclass(frozen=True)
class MQARConfig(TaskConfig):
    """Options of the ``mqar`` task.

    vocab_size: V (Zoology: 8192); keys come from [1, V//2), values from [V//2, V).
    train_grid / test_grid: (seq_len, kv_pairs) segments of each split ("64:4,128:8" also works).
    train_examples / test_examples: examples per segment (Zoology Figure 2: 100000 / 3000; the
        defaults are small enough for CPU training).
    validation_examples: examples per segment of a "validation" split drawn like the test split
        (its grid, its own random stream), on which runs evaluate, early-stop and pick their best
        checkpoint, and sweeps select the learning rate; the test split is then scored once, on the
        best checkpoint. 0 (default): no validation split; runs evaluate and select on test, as
        Zoology's training loop does.
    power_a: the power law's a (0.01 in Zoology; 1.0 makes the gaps uniform).
    random_non_queries: fill the query region's non-query positions with uniform tokens from
        [0, V) instead of 0 (Zoology's generator default; its Figure 2 configs set False).
    seed: master seed; each (split, segment) derives its own stream from it.
    """

    vocab_size: int = 8192
    train_grid: Grid = STANDARD_GRID
    test_grid: Grid = STANDARD_GRID
    train_examples: int = 2000
    test_examples: int = 250
    validation_examples: int = 0
    power_a: float = 0.01
    random_non_queries: bool = False
    seed: int = 0

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, 4)
        object.__setattr__(self, "train_grid", parse_grid("train_grid", self.train_grid))
        object.__setattr__(self, "test_grid", parse_grid("test_grid", self.test_grid))
        check_int("train_examples", self.train_examples, 1)
        check_int("test_examples", self.test_examples, 1)
        check_int("validation_examples", self.validation_examples, 0)
        object.__setattr__(self, "power_a", check_float("power_a", self.power_a, 0, low_open=True))
        check_bool("random_non_queries", self.random_non_queries)
        check_int("seed", self.seed, 0)
        n_keys, n_values = self.vocab_size // 2 - 1, self.vocab_size - self.vocab_size // 2
        most = max(kv for _, kv in self.train_grid + self.test_grid)
        if most > n_keys:
            raise ValueError(
                f"vocab_size: {self.vocab_size} gives {n_keys} keys ([1, {self.vocab_size // 2})) "
                f"and {n_values} values, fewer than the {most} distinct keys a sequence needs"
            )


def power_law(space: int, power_a: float) -> np.ndarray:
    """P(gap = i - 1) ∝ a·i^(a-1), i = 1..space (float64, sums to 1). Where a·i^(a-1) leaves
    float64's range (power_a from ~136 at seq_len 512 overflows it), the law is computed in log
    space, and a gap whose probability is below float64's range gets 0: ``log_power_law`` ranks
    those. Elsewhere the direct formula stays, so the data of those settings do not change."""
    p = _direct_power_law(space, power_a)
    if p is not None:
        return p
    with np.errstate(under="ignore"):
        return np.exp(log_power_law(space, power_a))


def _direct_power_law(space: int, power_a: float) -> np.ndarray | None:
    """``power_law`` by its direct formula, or None where that leaves float64's range."""
    with np.errstate(all="ignore"):
        p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
        p = p / p.sum()
    return p if np.isfinite(p).all() and (p > 0).all() else None


def log_power_law(space: int, power_a: float) -> np.ndarray:
    """The log of ``power_law``'s probabilities, finite for every power_a > 0."""
    log_w = (power_a - 1) * np.log(np.arange(1, space + 1, dtype=np.float64))
    top = log_w.max()
    with np.errstate(under="ignore"):
        return log_w - (top + np.log(np.exp(log_w - top).sum()))


def _distinct(rng: np.random.Generator, low: int, high: int, rows: int, k: int) -> np.ndarray:
    """[rows, k] draws from [low, high), distinct within a row, uniform over ordered k-tuples
    (what ``np.random.choice(range, k, replace=False)`` samples): i.i.d. uniform rows, a row with
    a repeat redrawn whole (rejection keeps the conditional law uniform). Where a row is unlikely
    to have no repeat (below ``MIN_NO_REPEAT``: 20 keys of 20 would take ~4e7 redraws a row, and
    ran for ever), each row is instead the first k of a uniform random permutation of the range:
    the same law from other draws. The rule depends on (high - low, k) alone, so every setting the
    rejection served keeps its data."""
    n = high - low
    if np.prod(1 - np.arange(k) / n) < MIN_NO_REPEAT:
        return np.argsort(rng.random((rows, n)), axis=1)[:, :k] + low
    out = np.floor(rng.random((rows, k)) * n).astype(np.int64)
    while True:
        srt = np.sort(out, axis=1)
        bad = np.nonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))[0]
        if bad.size == 0:
            return out + low
        out[bad] = np.floor(rng.random((bad.size, k)) * n).astype(np.int64)


def _power_law_gaps(
    rng: np.random.Generator, p: np.ndarray, rows: int, k: int, log_p: np.ndarray | None = None
) -> np.ndarray:
    """[rows, k] distinct gaps, in the order of successive draws without replacement with
    probabilities p (renormalised over what is left) — the law of ``np.random.choice(space, k,
    replace=False, p=p)``. Sampled as an exponential race: with E_i ~ Exp(1), sorting E_i / p_i
    ascending yields exactly that sequential (Plackett-Luce) order; with ``log_p`` (where p has
    zeros), log E_i - log p_i, the same order."""
    race = -np.log1p(-rng.random((rows, p.size)))
    if log_p is None:
        race /= p
    else:
        # p has zeros (an extreme power_a): E / 0 would tie them all at inf, in index order.
        with np.errstate(divide="ignore"):
            race = np.log(race) - log_p
    return np.argsort(race, axis=1, kind="stable")[:, :k]


def mqar_segment(
    rng: np.random.Generator,
    *,
    vocab_size: int,
    seq_len: int,
    kv_pairs: int,
    num_examples: int,
    power_a: float = 0.01,
    random_non_queries: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (seq_len, kv_pairs) block: (inputs, labels), both [num_examples, seq_len] int64."""
    ctx = 2 * kv_pairs
    half = vocab_size // 2
    space = (seq_len - ctx) // 2
    p = power_law(space, power_a)
    log_p = None if (p > 0).all() else log_power_law(space, power_a)
    inputs_all, labels_all = [], []
    for start in range(0, num_examples, _CHUNK):
        rows = min(_CHUNK, num_examples - start)
        keys = _distinct(rng, 1, half, rows, kv_pairs)
        values = _distinct(rng, half, vocab_size, rows, kv_pairs)
        gaps = _power_law_gaps(rng, p, rows, kv_pairs, log_p)
        inputs = np.zeros((rows, seq_len), dtype=np.int64)
        inputs[:, 0:ctx:2] = keys
        inputs[:, 1:ctx:2] = values
        # Zoology puts key j at 2·g_j of the query region and the label one step later in the
        # (L+1)-token sequence; after the seq[:-1] / seq[1:] shift both sit at 2kv + 2·g_j.
        query_pos = ctx + 2 * gaps
        np.put_along_axis(inputs, query_pos, keys, axis=1)
        labels = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
        np.put_along_axis(labels, query_pos, values, axis=1)
        if random_non_queries:
            noise = np.floor(rng.random((rows, seq_len)) * vocab_size).astype(np.int64)
            empty = inputs == 0
            inputs[empty] = noise[empty]
        inputs_all.append(inputs)
        labels_all.append(labels)
    return torch.from_numpy(np.concatenate(inputs_all)), torch.from_numpy(np.concatenate(labels_all))


def segment_name(seq_len: int, kv_pairs: int) -> str:
    return f"L{seq_len}-kv{kv_pairs}"


@register("mqar")
class MQAR(Task):
    """Multi-query associative recall (Zoology). Splits "train" and "test" (and "validation" with
    ``validation_examples``), one segment per (seq_len, kv_pairs) of ``train_grid`` / ``test_grid``
    (validation: the test grid); head "lm"; metrics sliced per segment and per kv_pairs."""

    Config = MQARConfig
    default_head = "lm"
    slice_keys = ("kv_pairs",)
    generator_version = 1

    @classmethod
    def config_model_fields(cls, config: MQARConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head}, "vocab_size": config.vocab_size}

    @property
    def max_len(self) -> int:
        return max(L for L, _ in self.config.train_grid + self.config.test_grid)

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", "validation", "test") if self.config.validation_examples else ("train", "test")

    def grid(self, split: str) -> Grid:
        self._check_split(split)
        return self.config.train_grid if split == "train" else self.config.test_grid

    def cache_fields(self, split: str) -> dict[str, object]:
        # Before the log-space law, a power_a past float64's range generated degenerate gaps:
        # such settings get a key of their own so that those caches are not served.
        c = self.config
        spaces = [(L - 2 * kv) // 2 for L, kv in self.grid(split)]
        return {"power_law": "log-space"} if any(_direct_power_law(n, c.power_a) is None for n in spaces) else {}

    def generate(self, split: str) -> list[Segment]:
        c = self.config
        n = {"train": c.train_examples, "validation": c.validation_examples}.get(split, c.test_examples)
        segments = []
        for seq_len, kv in self.grid(split):
            rng = np.random.Generator(
                np.random.PCG64(np.random.SeedSequence([c.seed, _SPLIT_CODE[split], seq_len, kv]))
            )
            inputs, labels = mqar_segment(
                rng,
                vocab_size=c.vocab_size,
                seq_len=seq_len,
                kv_pairs=kv,
                num_examples=n,
                power_a=c.power_a,
                random_non_queries=c.random_non_queries,
            )
            segments.append(Segment(segment_name(seq_len, kv), inputs, labels, {"seq_len": seq_len, "kv_pairs": kv}))
        return segments

    def describe(self) -> str:
        c = self.config
        half = c.vocab_size // 2

        def grid(g: Grid, n: int) -> str:
            return ", ".join(segment_name(L, kv) for L, kv in g) + f" ({n} examples each)"

        return "\n".join(
            [
                "mqar: multi-query associative recall, Zoology protocol (Arora et al. 2023)",
                f"  vocab {c.vocab_size}: keys [1, {half}), values [{half}, {c.vocab_size}); "
                f"query gaps ~ power law a={c.power_a:g}; non-query tokens "
                + ("uniform random" if c.random_non_queries else "0"),
                f"  train: {grid(c.train_grid, c.train_examples)}",
                f"  test:  {grid(c.test_grid, c.test_examples)}",
                *([f"  validation: {grid(c.test_grid, c.validation_examples)}"] if c.validation_examples else []),
                f"  seed {c.seed}; head {self.default_head}; loss: cross-entropy over query positions; "
                "accuracy: mean over examples of accuracy over query positions, overall / per segment / per kv_pairs",
            ]
        )
