"""Intervals for results over seeds and test examples: a hierarchical bootstrap.

A cell of an experiment (one config) has runs that differ only in their seed. Its value is the mean
over seeds of each run's metric. The noise in that value has two sources: the seed (weights at
initialisation, batch order) and the finite test set, which every run of an experiment shares (the
task's data do not depend on the training seed). The two are crossed, not nested: averaging over
seeds does not reduce the test set's noise. ``cell_interval`` resamples both: per bootstrap
replicate it draws the seeds with replacement and, once, the test examples with replacement (the
runs' ``test_examples.csv``, ``Evaluator.examples``); every drawn run's metric is recomputed on
that one draw of the examples, and the drawn runs' metrics are averaged. Runs whose example counts
differ were tested on different sets, and each count gets its own draw. Examples that are
consecutive windows of one stream (a language model's test split: ``Examples.block`` > 1) are not
independent, since neighbouring windows share a document; they are drawn in circular blocks of
``block`` consecutive windows (the circular block bootstrap of Politis and Romano, 1992), which
keeps the dependence within a block, and both sides of a difference read the same blocks. A run
without examples keeps its reported metric in every replicate (its test-set noise is then carried
only by the spread between seeds; ``Interval.over`` says which). One seed with examples gives an
interval over test examples alone; one seed without them gives no interval (an error: there is
nothing to resample).

``difference_interval`` does the same for the difference of two cells' means, with the one draw
of the examples for both cells (paired by test example), and paired by seed when both cells have
the same seeds (the replicate draws the same seeds for both), so noise the two share cancels.
``spearman_interval`` gives Spearman's rho between the cells' means and the paper's numbers with
the interval of that rho under the same resampling of our side; ``spearman_chance`` says how often
a random order would agree as well, which that interval does not.

Intervals are percentile intervals of ``N_BOOT`` replicates (95% by default), from a generator
seeded by ``seed``: the same inputs give the same interval. With 2 or more seeds an interval is
at least Student's t interval over the seeds' values (paired differences, or Welch's for two
independent cells): a percentile bootstrap over a handful of seeds runs narrow, and 3 seeds are
the common case here. ``Interval.over`` says when the t interval widened it. Neither can see a
failure that the seeds drawn happen not to show: three seeds that all succeed are consistent with
a failure in up to 63% of seeds (the 95% upper bound for 0 of 3).

``ratio_interval`` is for benchmarks: the ratio of timings taken in pairs, round after round.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

# Replicates of every interval. An end the bootstrap sets moves with the generator by about 0.001
# on an accuracy of 500 test examples and 0.2-0.5 on an LM perplexity near 120 (its sd over
# generator seeds 0-19): of the 4 significant digits the reports print, its 4th is noise and its
# 3rd good to about +-2. They print 4 all the same, as an end Student's t sets (every committed
# difference's but two) is exact to the last; 5x the replicates would halve the noise at 5x the
# time and memory of every report (an index matrix [N_BOOT, examples] a test set).
N_BOOT = 4000
LEVEL = 0.95
# Seeds a cell needs for ``spearman_interval``: with one, the interval resamples the test examples
# only and leaves the seeds' noise out; with two, there are 3 distinct resamples of the seeds and no
# t interval to widen to. Close cells still make it narrow with 3: the percentile interval of rho
# is pulled toward 0 when resampled means swap close ranks.
SPEARMAN_MIN_SEEDS = 3


@dataclass(frozen=True)
class Examples:
    """One run's test examples for one metric: the metric is ``transform(sum(numerator) /
    sum(denominator))`` over the examples (accuracy: each example's accuracy over 1; loss: its
    summed loss over its labelled positions; perplexity: the same with ``transform="exp"``).
    ``block``: 1 where the examples are independent; else they are consecutive windows of one
    stream, in its order, resampled in circular blocks of that many (``Task.example_block``)."""

    numerator: np.ndarray
    denominator: np.ndarray
    transform: str = "identity"
    block: int = 1

    def __post_init__(self):
        if self.numerator.ndim != 1 or self.numerator.shape != self.denominator.shape:
            raise ValueError(
                f"Examples: expected numerator and denominator of one shape [N], got "
                f"{list(self.numerator.shape)} and {list(self.denominator.shape)}"
            )
        if len(self.numerator) == 0:
            raise ValueError("Examples: expected at least one example, got none")
        if self.transform not in ("identity", "exp"):
            raise ValueError(f"Examples.transform: expected 'identity' or 'exp', got {self.transform!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Examples.block: expected an int >= 1, got {self.block!r}")

    def value(self, rows: np.ndarray | None = None) -> np.ndarray | float:
        """The metric over all examples (``rows`` None), or per row of the index matrix ``rows``
        [R, N] (a resample of the examples each)."""
        if rows is None:
            ratio = self.numerator.sum() / self.denominator.sum()
        else:
            ratio = self.numerator[rows].sum(1) / self.denominator[rows].sum(1)
        return np.exp(ratio) if self.transform == "exp" else ratio


@dataclass(frozen=True)
class RunScore:
    """One run of a cell: its seed (a label; cells pair by it), its reported metric and, when it
    recorded them, its test examples for that metric."""

    seed: object
    value: float
    examples: Examples | None = None


@dataclass(frozen=True)
class Interval:
    """An estimate and its ``level`` interval [low, high]; ``over`` says what was resampled."""

    estimate: float
    low: float
    high: float
    n_seeds: int
    over: str
    level: float = LEVEL

    @property
    def width(self) -> float:
        return self.high - self.low

    def excludes(self, value: float) -> bool:
        """Whether ``value`` lies outside [low, high]; never for an interval with a nan end."""
        return bool(value < self.low or value > self.high)

    def clipped(self, low: float, high: float) -> Interval:
        """This interval within [low, high], the values the metric can take: Student's t over
        seeds is symmetric and can reach past a bound (an accuracy's interval past 1)."""
        if self.low >= low and self.high <= high:
            return self
        bounds = f"[{low:g}, {high:g}]"
        return replace(
            self,
            low=max(self.low, low),
            high=min(self.high, high),
            over=f"{self.over}; clipped to the metric's range {bounds}",
        )


def _over(runs: Sequence[RunScore]) -> str:
    with_examples = sum(r.examples is not None for r in runs)
    seeds = f"{len(runs)} seed{'s' if len(runs) != 1 else ''}"
    blocks = sorted({r.examples.block for r in runs if r.examples is not None and r.examples.block > 1})
    in_blocks = f" in blocks of {', '.join(map(str, blocks))}" if blocks else ""
    if with_examples == len(runs):
        return f"{seeds} and test examples{in_blocks}" if len(runs) > 1 else f"test examples{in_blocks} (1 seed)"
    if with_examples == 0:
        return f"{seeds} only (no per-example record)"
    return f"{seeds}; test examples of {with_examples} of them" + (f",{in_blocks}" if in_blocks else "")


def _check(runs: Sequence[RunScore], what: str) -> None:
    if not runs:
        raise ValueError(f"{what}: expected at least one run, got none")
    seeds = [r.seed for r in runs]
    if len(set(map(repr, seeds))) != len(seeds):
        raise ValueError(f"{what}: expected one run per seed, got seeds {seeds}")
    if len(runs) == 1 and runs[0].examples is None:
        raise ValueError(f"{what}: one seed without test examples (test_examples.csv), nothing to resample")
    bad = [r.seed for r in runs if not math.isfinite(r.value)]
    if bad:
        raise ValueError(f"{what}: expected finite metrics, got nan or inf for seeds {bad}")
    for r in runs:
        if r.examples is not None and len(r.examples.numerator) < 2 * r.examples.block:
            # a draw of one block (and a part) only rotates the stream: every replicate's mean is
            # nearly the set's own, an interval of about no width
            raise ValueError(
                f"{what}: test examples in blocks of {r.examples.block} need at least {2 * r.examples.block} "
                f"of them (two blocks), got {len(r.examples.numerator)} for seed {r.seed!r}"
            )


def _test_set(examples: Examples) -> tuple[int, int]:
    """What a test set's draw depends on: its example count and block length."""
    return len(examples.numerator), examples.block


def _example_draws(
    cells: Sequence[Sequence[RunScore]], n_boot: int, rng: np.random.Generator
) -> dict[tuple[int, int], np.ndarray]:
    """One resample of the test examples per replicate, [n_boot, N] index rows, for each example
    count N (and block length) among the cells' runs: the runs tested on N examples share the draw
    (one test set). Blocks of b > 1 are circular: ceil(N / b) starts drawn uniformly, each followed
    by its next b - 1 examples (wrapping past the last to the first), cut to N, so that every
    example is drawn equally often and the replicates centre on the set's own mean."""
    draws = {}
    for n, block in sorted({_test_set(r.examples) for runs in cells for r in runs if r.examples is not None}):
        if block == 1:
            draws[n, block] = rng.integers(0, n, size=(n_boot, n), dtype=np.int32)
            continue
        starts = rng.integers(0, n, size=(n_boot, -(-n // block), 1), dtype=np.int32)
        draws[n, block] = ((starts + np.arange(block, dtype=np.int32)) % n).reshape(n_boot, -1)[:, :n]
    return draws


def _seed_draws(runs: Sequence[RunScore], picks: np.ndarray, rows: Mapping[tuple[int, int], np.ndarray]) -> np.ndarray:
    """[B, S] metrics of the runs ``picks`` [B, S] draws, each on its replicate's draw of the test
    examples (``rows``, from ``_example_draws``)."""
    out = np.empty(picks.shape)
    for i, run in enumerate(runs):
        where = picks == i
        if not where.any():
            continue
        if run.examples is None:
            out[where] = run.value
            continue
        per_replicate = run.examples.value(rows[_test_set(run.examples)])
        out[where] = per_replicate[np.nonzero(where)[0]]
    return out


def _percentiles(values: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(values, [tail, 100 - tail])
    return float(low), float(high)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile: the x with P(T <= x) = p for df degrees of freedom (p in (0.5, 1)),
    by bisection on the density integrated by Simpson's rule (numpy has no t distribution and
    the library does not depend on scipy)."""
    if not (0.5 < p < 1) or not df > 0:
        raise ValueError(f"t_quantile: expected 0.5 < p < 1 and df > 0, got p={p}, df={df}")
    norm = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float) -> float:
        grid = np.linspace(0.0, x, 4001)
        f = norm * (1 + grid**2 / df) ** (-(df + 1) / 2)
        h = x / 4000
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    low, high = 0.0, 1.0
    while cdf(high) < p:
        low, high = high, 2 * high
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def _t_interval(values: np.ndarray, level: float) -> tuple[float, float]:
    """mean +- t(n - 1) * sd / sqrt(n): the classical interval for a mean over n seeds."""
    n = len(values)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)
    centre = float(np.mean(values))
    return centre - half, centre + half


def ratio_interval(num: Sequence[float], den: Sequence[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(estimate, low, high) of the ratio of paired positive measurements num_k / den_k (timings
    taken side by side, pair k in round k of a benchmark): the geometric mean of the pairs' ratios
    and Student's t interval over their logs, so that 2x faster and 2x slower weigh alike. The
    pairing removes the machine's drift between rounds; what is left is the spread within a round.
    At least two pairs."""
    x, y = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"ratio_interval: expected two equal-length sequences of 2 or more, got {x.shape}, {y.shape}")
    if (x <= 0).any() or (y <= 0).any():
        raise ValueError("ratio_interval: expected positive measurements")
    logs = np.log(x) - np.log(y)
    low, high = _t_interval(logs, level)
    return math.exp(float(logs.mean())), math.exp(low), math.exp(high)


def _widen(low: float, high: float, t_low: float, t_high: float, over: str) -> tuple[float, float, str]:
    """The union of the bootstrap and t intervals: a percentile bootstrap over a handful of seeds
    runs narrow (3 seeds give 10 distinct resamples, and the resampled mean's spread is
    (n - 1) / n of the plug-in one), so the t interval over seeds bounds it from below."""
    if t_low < low or t_high > high:
        return min(low, t_low), max(high, t_high), over + "; widened to Student's t over seeds"
    return low, high, over


def cell_replicates(runs: Sequence[RunScore], n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """[n_boot] bootstrap replicates of the cell's mean over seeds (see the module docstring)."""
    _check(runs, "cell")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(runs), size=(n_boot, len(runs)))
    return _seed_draws(runs, picks, _example_draws([runs], n_boot, rng)).mean(1)


def cell_interval(runs: Sequence[RunScore], n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL) -> Interval:
    """The cell's mean over seeds with its hierarchical-bootstrap interval."""
    low, high = _percentiles(cell_replicates(runs, n_boot, seed), level)
    values = np.array([r.value for r in runs])
    over = _over(runs)
    if len(runs) >= 2:
        low, high, over = _widen(low, high, *_t_interval(values, level), over)
    return Interval(float(values.mean()), low, high, len(runs), over, level)


def paired(a: Sequence[RunScore], b: Sequence[RunScore]) -> bool:
    """Whether two cells pair by seed: the same seeds, each once."""
    return sorted(map(repr, (r.seed for r in a))) == sorted(map(repr, (r.seed for r in b)))


def difference_interval(
    a: Sequence[RunScore], b: Sequence[RunScore], n_boot: int = N_BOOT, seed: int = 0, level: float = LEVEL
) -> Interval:
    """mean(a) - mean(b) over seeds with its interval: paired by seed when the seeds match, else
    the two cells' seeds drawn independently; paired by test example throughout (one draw of each
    test set per replicate)."""
    _check(a, "difference: cell a")
    _check(b, "difference: cell b")
    rng = np.random.default_rng(seed)
    estimate = float(np.mean([r.value for r in a]) - np.mean([r.value for r in b]))
    sides = _over(a) if _over(a) == _over(b) else f"a {_over(a)}, b {_over(b)}"
    if paired(a, b):
        order = {repr(r.seed): i for i, r in enumerate(b)}
        b = [b[order[repr(r.seed)]] for r in a]
        picks = rng.integers(0, len(a), size=(n_boot, len(a)))
        rows = _example_draws([a, b], n_boot, rng)
        replicates = _seed_draws(a, picks, rows).mean(1) - _seed_draws(b, picks, rows).mean(1)
        over = f"paired by seed: {sides}"
        diffs = np.array([x.value - y.value for x, y in zip(a, b, strict=True)])
        t = _t_interval(diffs, level) if len(a) >= 2 else None
    else:
        picks_a = rng.integers(0, len(a), size=(n_boot, len(a)))
        picks_b = rng.integers(0, len(b), size=(n_boot, len(b)))
        rows = _example_draws([a, b], n_boot, rng)
        replicates = _seed_draws(a, picks_a, rows).mean(1) - _seed_draws(b, picks_b, rows).mean(1)
        over = f"independent: {sides}"
        t = _welch(np.array([r.value for r in a]), np.array([r.value for r in b]), level)
    low, high = _percentiles(replicates, level)
    if t is not None:
        low, high, over = _widen(low, high, *t, over)
    return Interval(estimate, low, high, min(len(a), len(b)), over, level)


def _welch(x: np.ndarray, y: np.ndarray, level: float) -> tuple[float, float] | None:
    """Welch's t interval for mean(x) - mean(y) (None unless both sides have 2 or more seeds)."""
    if len(x) < 2 or len(y) < 2:
        return None
    vx, vy = np.var(x, ddof=1) / len(x), np.var(y, ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0:
        return float(x.mean() - y.mean()), float(x.mean() - y.mean())
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    half = t_quantile(1 - (1 - level) / 2, df) * se
    centre = float(x.mean() - y.mean())
    return centre - half, centre + half


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks along the last axis, ties given their mean rank."""
    order = np.argsort(x, axis=-1, kind="stable")
    ranks = np.empty_like(x, dtype=float)
    np.put_along_axis(ranks, order, np.arange(x.shape[-1], dtype=float) * np.ones_like(x), axis=-1)
    # ties: average the ranks of equal values
    out = ranks.copy()
    for idx in np.ndindex(x.shape[:-1]):
        row = x[idx]
        for v in np.unique(row):
            same = row == v
            if same.sum() > 1:
                out[idx][same] = ranks[idx][same].mean()
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho along the last axis (nan where either side is constant)."""
    rx, ry = _ranks(np.asarray(x, dtype=float)), _ranks(np.asarray(y, dtype=float))
    rx = rx - rx.mean(-1, keepdims=True)
    ry = ry - ry.mean(-1, keepdims=True)
    den = np.sqrt((rx**2).sum(-1) * (ry**2).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(-1) / np.where(den > 0, den, 1), np.nan)


def spearman_interval(
    cells: Mapping[str, Sequence[RunScore]],
    paper: Mapping[str, float],
    n_boot: int = N_BOOT,
    seed: int = 0,
    level: float = LEVEL,
) -> Interval:
    """Spearman's rho between each cell's mean and the paper's number for it, with the interval of
    rho when our means are resampled (each cell hierarchically, independently). Replicates in
    which ours tie throughout give no rho and are left out; the interval says how many remain.
    Cells of fewer than ``SPEARMAN_MIN_SEEDS`` seeds are refused."""
    labels = [k for k in cells if k in paper]
    if len(labels) < 3:
        raise ValueError(f"spearman: expected 3 or more cells with a paper number, got {labels}")
    for k in labels:
        _check(cells[k], f"spearman: cell {k}")
    for k in labels:
        if len(cells[k]) < SPEARMAN_MIN_SEEDS:
            raise ValueError(
                f"spearman: expected {SPEARMAN_MIN_SEEDS} or more seeds a cell, got {len(cells[k])} for cell {k} "
                "(the interval of rho would leave out or understate the seeds' noise)"
            )
    rng = np.random.default_rng(seed)
    rows = _example_draws([cells[k] for k in labels], n_boot, rng)
    ours = np.stack(
        [
            _seed_draws(cells[k], rng.integers(0, len(cells[k]), size=(n_boot, len(cells[k]))), rows).mean(1)
            for k in labels
        ],
        axis=-1,
    )
    theirs = np.array([paper[k] for k in labels], dtype=float)
    rhos = spearman(ours, np.broadcast_to(theirs, ours.shape))
    estimate = float(spearman(np.array([np.mean([r.value for r in cells[k]]) for k in labels]), theirs))
    finite = rhos[np.isfinite(rhos)]
    if len(finite) == 0:
        raise ValueError("spearman: our cells tie in every replicate; rho is undefined")
    low, high = _percentiles(finite, level)
    seeds = min(len(cells[k]) for k in labels)
    return Interval(estimate, low, high, seeds, f"{len(labels)} cells, {len(finite)} of {n_boot} replicates", level)


def spearman_chance(ours: Sequence[float], paper: Sequence[float], samples: int = 200_000, seed: int = 0) -> float:
    """How often a uniformly random order of ``ours`` against ``paper`` (our values permuted among
    the labels, ties and all) reaches |rho| >= the observed |rho|, ranked with mid-ranks as
    ``spearman`` ranks them: every order for n <= 8, else ``samples`` random ones (seeded). What a
    rho's interval over our resampling does not say: well-separated cells give a narrow interval
    around any rho, however likely by chance. Ties matter: tied values take fewer distinct orders,
    so an order without ties would count agreement as rarer than it is."""
    x, y = np.asarray(ours, dtype=float), np.asarray(paper, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 3:
        raise ValueError(
            f"spearman_chance: expected ours and paper of one length of 3 or more, got {list(x.shape)} and "
            f"{list(y.shape)}"
        )
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx**2).sum() * (ry**2).sum()))
    if den == 0:
        raise ValueError("spearman_chance: rho is undefined, ours or paper is constant")
    n = len(x)
    if n <= 8:
        orders = np.array(list(itertools.permutations(range(n))))
    else:
        orders = np.argsort(np.random.default_rng(seed).random((samples, n)), axis=1)
    # permuting our values permutes their ranks: rho of each order from the ranks once computed
    rhos = rx[orders] @ ry / den
    return float(np.mean(np.abs(rhos) >= abs(float(rx @ ry) / den) - 1e-12))
