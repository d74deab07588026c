"""The hierarchical bootstrap: deterministic, about the right coverage on synthetic data, an
interval over examples alone for one seed, paired differences, Spearman's rho, clear errors."""

import json

import numpy as np
import pytest

from lcsm.engine.stats import (
    Examples,
    Interval,
    RunScore,
    _example_draws,
    cell_interval,
    cell_replicates,
    difference_interval,
    ratio_interval,
    spearman,
    spearman_chance,
    spearman_interval,
    t_quantile,
)


def accuracy_run(seed, p, n, rng):
    correct = (rng.random(n) < p).astype(float)
    return RunScore(seed, float(correct.mean()), Examples(correct, np.ones(n)))


def covered(seeds: int, sd: float, experiments: int, n_boot: int, rng_seed: int) -> int:
    """How many of ``experiments`` synthetic cells (``seeds`` runs whose true accuracy is 0.6 plus
    normal noise of ``sd``, 400 test examples each) have a 95% interval that holds 0.6."""
    rng = np.random.default_rng(rng_seed)
    hits = 0
    for _ in range(experiments):
        runs = [accuracy_run(s, 0.6 + sd * rng.standard_normal(), 400, rng) for s in range(seeds)]
        hits += not cell_interval(runs, n_boot=n_boot).excludes(0.6)
    return hits


def test_same_inputs_same_interval():
    rng = np.random.default_rng(1)
    runs = [accuracy_run(s, 0.6, 200, rng) for s in range(3)]
    assert cell_interval(runs) == cell_interval(runs)
    assert np.array_equal(cell_replicates(runs), cell_replicates(runs))
    assert not np.array_equal(cell_replicates(runs, seed=1), cell_replicates(runs))


def test_coverage_of_the_cell_mean():
    """Seeds whose true accuracy varies around 0.6 (sd 0.03), 400 test examples each: the 95%
    interval of 5 seeds' mean holds 0.6 in most of 60 synthetic experiments (the percentile
    bootstrap of a few seeds undercovers a little; far below would mean a wrong interval)."""
    assert covered(seeds=5, sd=0.03, experiments=60, n_boot=1000, rng_seed=0) >= 48


def test_one_seed_is_an_interval_over_examples():
    """One seed: the binomial interval of its test accuracy (p 0.5, 400 examples: +-0.049)."""
    rng = np.random.default_rng(2)
    run = accuracy_run(0, 0.5, 400, rng)
    interval = cell_interval([run])
    assert interval.over == "test examples (1 seed)"
    assert abs(interval.width / 2 - 1.96 * np.sqrt(run.value * (1 - run.value) / 400)) < 0.01


def test_seeds_without_examples_resample_seeds_only():
    """Three seeds, no examples: the bootstrap stays within [0.2, 0.3], narrower than Student's t
    over the seeds (0.25 +- 4.303 x 0.05 / sqrt 3), which the interval is widened to."""
    runs = [RunScore(s, v) for s, v in enumerate([0.2, 0.3, 0.25])]
    interval = cell_interval(runs)
    assert interval.over == "3 seeds only (no per-example record); widened to Student's t over seeds"
    half = 4.3027 * 0.05 / np.sqrt(3)
    assert (interval.low, interval.high) == pytest.approx((0.25 - half, 0.25 + half), abs=1e-4)


def test_t_quantiles():
    for df, q in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)]:
        assert t_quantile(0.975, df) == pytest.approx(q, abs=1e-3)
    with pytest.raises(ValueError, match="t_quantile"):
        t_quantile(0.4, 3)


def test_ratio_interval_is_student_t_over_the_pairs_log_ratios():
    """Pairs 2/1, 4/2, 3/1: ratios 2, 2, 3; the estimate is their geometric mean and the interval
    mean(log) +- t(2) sd(log) / sqrt 3, mapped back; a constant ratio has no width, whatever the
    drift of the pairs; mismatched, short or non-positive input is an error naming the function."""
    logs = np.log([2.0, 2.0, 3.0])
    half = 4.3027 * logs.std(ddof=1) / np.sqrt(3)
    got = ratio_interval([2.0, 4.0, 3.0], [1.0, 2.0, 1.0])
    assert got == pytest.approx((np.exp(logs.mean()), np.exp(logs.mean() - half), np.exp(logs.mean() + half)), rel=1e-4)
    assert ratio_interval([2.0, 20.0, 0.2], [1.0, 10.0, 0.1]) == pytest.approx((2.0, 2.0, 2.0))
    for num, den in [([1.0, 2.0], [1.0]), ([1.0], [1.0]), ([1.0, 0.0], [1.0, 1.0])]:
        with pytest.raises(ValueError, match="ratio_interval"):
            ratio_interval(num, den)


def test_coverage_with_three_seeds():
    """3 seeds whose true accuracy varies (sd 0.05) around 0.6, 400 examples each: the percentile
    bootstrap alone covers well under 95%; with the t interval at least 92% of 200 experiments."""
    assert covered(seeds=3, sd=0.05, experiments=200, n_boot=500, rng_seed=6) >= 184


def test_paired_and_welch_differences_are_at_least_t():
    """Paired: the t interval of the per-seed differences; apart: Welch's."""
    a = [RunScore(s, v) for s, v in enumerate([0.50, 0.60, 0.55])]
    b = [RunScore(s, v) for s, v in enumerate([0.45, 0.50, 0.52])]
    paired_ = difference_interval(a, b)
    d = np.array([0.05, 0.10, 0.03])
    half = 4.3027 * d.std(ddof=1) / np.sqrt(3)
    assert paired_.low <= d.mean() - half + 1e-4 and paired_.high >= d.mean() + half - 1e-4
    apart = difference_interval(a, [RunScore(s + 3, r.value) for s, r in enumerate(b)])
    assert apart.over.endswith("widened to Student's t over seeds") and apart.width > paired_.width


def test_loss_and_perplexity_are_ratios_over_positions():
    ex = Examples(np.array([2.0, 6.0]), np.array([1.0, 3.0]), transform="exp")
    assert ex.value() == pytest.approx(np.exp(2.0))
    assert np.allclose(ex.value(np.array([[0, 0], [1, 1]])), np.exp([2.0, 2.0]))


def test_paired_difference_cancels_shared_noise():
    """Two cells tested on the same examples whose per-example scores are mostly shared: pairing
    by seed and example gives a much narrower interval than resampling the cells apart."""
    rng = np.random.default_rng(3)
    a, b = [], []
    for s in range(3):
        base = (rng.random(300) < 0.5).astype(float)
        flip = rng.random(300) < 0.1
        other = np.where(flip, 1 - base, base)
        a.append(RunScore(s, float(base.mean()), Examples(base, np.ones(300))))
        b.append(RunScore(s, float(other.mean()), Examples(other, np.ones(300))))
    together = difference_interval(a, b)
    apart = difference_interval(a, [RunScore(s + 10, r.value, r.examples) for s, r in enumerate(b)])
    assert together.over.startswith("paired by seed") and apart.over.startswith("independent")
    assert together.estimate == pytest.approx(apart.estimate)
    assert together.width < 0.6 * apart.width


def test_a_real_difference_is_resolved_and_none_is_not():
    rng = np.random.default_rng(4)
    good = [accuracy_run(s, 0.7, 500, rng) for s in range(3)]
    bad = [accuracy_run(s, 0.5, 500, rng) for s in range(3)]
    same = [accuracy_run(s, 0.7, 500, rng) for s in range(3)]
    assert difference_interval(good, bad).low > 0
    assert not difference_interval(good, same).excludes(0.0)


def test_spearman_and_its_interval():
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2, 2, 4]), np.array([4.0, 3, 2, 1])) == pytest.approx(-0.9486833)
    rng = np.random.default_rng(5)
    cells = {
        k: [accuracy_run(s, p, 500, rng) for s in range(3)] for k, p in zip("abcd", [0.2, 0.4, 0.6, 0.8], strict=True)
    }
    clear = spearman_interval(cells, {"a": 1, "b": 2, "c": 3, "d": 4})
    assert clear.estimate == pytest.approx(1.0) and clear.low == pytest.approx(1.0)
    close = {k: [accuracy_run(s, 0.5, 100, rng) for s in range(3)] for k in "abcd"}
    noisy = spearman_interval(close, {"a": 1, "b": 2, "c": 3, "d": 4})
    assert noisy.low < 0 < noisy.high


@pytest.mark.parametrize("seeds", [1, 2])
def test_a_rank_correlation_of_fewer_than_3_seeds_a_cell_has_no_interval(seeds):
    """One seed's interval of rho resamples the test examples only (it leaves the seeds' noise out)
    and two seeds have 3 distinct resamples: refused, naming the cell."""
    rng = np.random.default_rng(12)
    cells = {k: [accuracy_run(s, p, 500, rng) for s in range(3)] for k, p in zip("abc", [0.2, 0.5, 0.8], strict=True)}
    cells["b"] = cells["b"][:seeds]
    with pytest.raises(ValueError, match=rf"spearman: expected 3 or more seeds a cell, got {seeds} for cell b"):
        spearman_interval(cells, {"a": 1, "b": 2, "c": 3})


def test_clear_errors():
    with pytest.raises(ValueError, match="cell: expected at least one run, got none"):
        cell_interval([])
    with pytest.raises(ValueError, match="one seed without test examples"):
        cell_interval([RunScore(0, 0.5)])
    with pytest.raises(ValueError, match=r"expected one run per seed, got seeds \[0, 0\]"):
        cell_interval([RunScore(0, 0.5), RunScore(0, 0.6)])
    with pytest.raises(ValueError, match=r"expected numerator and denominator of one shape \[N\], got \[2\] and \[3\]"):
        Examples(np.ones(2), np.ones(3))
    with pytest.raises(ValueError, match="expected 3 or more cells"):
        spearman_interval({"a": [RunScore(0, 0.1), RunScore(1, 0.2)]}, {"a": 1.0})
    with pytest.raises(ValueError, match="nan or inf for seeds \\[1\\]"):
        cell_interval([RunScore(0, 0.5), RunScore(1, float("nan"))])


def test_intervals_are_clipped_to_the_metric_range():
    """Three seeds near the ceiling: Student's t reaches past an accuracy of 1, the report's
    interval stops at 1 and says so; a difference of accuracies stays within [-1, 1]; an interval
    inside the range is returned as it is."""
    from lcsm.engine.report import metric_range

    runs = [RunScore(s, v) for s, v in enumerate([0.90, 1.00, 0.99])]
    raw = cell_interval(runs)
    assert raw.high > 1
    clipped = raw.clipped(*metric_range("test/accuracy"))
    assert (clipped.low, clipped.high) == (raw.low, 1.0)
    assert clipped.over.endswith("clipped to the metric's range [0, 1]")
    assert raw.clipped(*metric_range("accuracy/L64-kv4")) == clipped
    assert raw.clipped(0.0, 2.0) is raw
    assert metric_range("test/accuracy", difference=True) == (-1.0, 1.0)
    assert metric_range("test/perplexity") == (1.0, float("inf"))
    assert metric_range("test/perplexity", difference=True) == (-float("inf"), float("inf"))
    assert metric_range("bits_per_byte") == (-float("inf"), float("inf"))


def test_one_test_set_shared_by_every_seed_is_resampled_once_a_replicate():
    """Every seed of an experiment is tested on the same examples, so their noise does not average
    out over seeds. Cells of 8 seeds (seed sd 0.01) on one shared set of 500 examples whose
    difficulty varies (the set's mean off the population's by sd 0.01 too): the 95% interval holds
    the population mean in 147 of 150 experiments. Each seed resampling its examples on its own,
    as if tested on sets of its own, held it in 130 (87%)."""
    rng = np.random.default_rng(8)
    hits = 0
    for _ in range(150):
        difficulty = rng.beta(2, 2, 500)  # per-example chance of being right, mean 0.5
        runs = []
        for s in range(8):
            p = np.clip(difficulty + 0.01 * rng.standard_normal(), 0, 1)
            correct = (rng.random(500) < p).astype(float)
            runs.append(RunScore(s, float(correct.mean()), Examples(correct, np.ones(500))))
        hits += not cell_interval(runs, n_boot=1000).excludes(0.5)
    assert hits >= 135


def test_a_nan_interval_excludes_nothing():
    assert not Interval(0.1, float("nan"), float("nan"), 3, "x").excludes(0.0)
    assert Interval(0.1, 0.05, 0.2, 3, "x").excludes(0.0) and not Interval(0.1, -0.1, 0.2, 3, "x").excludes(0.0)


def test_the_chance_of_a_rho_from_a_random_order():
    """Exact over every order for a few labels: 5 labels reach |rho| >= 0.6 in 42 of 120 orders
    (0.35); 3 labels reach |rho| = 1 in 2 of 6; sampled beyond 8 labels, close to the exact law."""
    assert spearman_chance([3, 2, 1, 4, 5], [1, 2, 3, 4, 5]) == pytest.approx(0.35)
    assert spearman_chance([3.0, 2.0, 1.0], [1, 2, 3]) == pytest.approx(1 / 3)
    assert spearman_chance([1, 3, 7, 9, 8, 6, 5, 4, 2], list(range(1, 10))) == 1.0
    assert 0.0 < spearman_chance([11, 10, 9, 8, 6, 7, 5, 3, 4, 1, 2], list(range(11, 0, -1))) < 0.01


def test_the_chance_of_a_rho_keeps_our_ties():
    """Tied values have fewer distinct orders, so a tied rho is likelier by chance than an untied
    one of the same size: three cells at 1.0 of five reach rho +0.89 in 12 of 120 orders (0.10,
    not 0.083 of orders without ties), four at 1.0 of six in 48 of 720 (0.067, not 0.033)."""
    assert spearman_chance([1, 1, 1, 0.9, 0.3], [5, 4, 3, 2, 1]) == pytest.approx(0.1)
    assert spearman_chance([1, 1, 1, 1, 0.3, 0.2], [6, 5, 4, 3, 2, 1]) == pytest.approx(48 / 720)
    with pytest.raises(ValueError, match="spearman_chance: rho is undefined, ours or paper is constant"):
        spearman_chance([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match=r"spearman_chance: expected ours and paper of one length of 3 or more"):
        spearman_chance([1, 2, 3], [1, 2])


def ar1_stream(n, phi, rng):
    """n consecutive values of an AR(1) process of unit variance: neighbours correlate phi."""
    x = np.empty(n)
    x[0] = rng.standard_normal()
    for i in range(1, n):
        x[i] = phi * x[i - 1] + np.sqrt(1 - phi**2) * rng.standard_normal()
    return x


def test_a_block_draw_is_runs_of_consecutive_examples():
    """Blocks of 10 of 95 examples: each replicate is 10 starts, each followed by its next 9
    examples (past the last back to the first), cut to 95; every example is drawn about equally
    often. Independent examples keep the draw of one index at a time."""
    runs = [RunScore(0, 0.5, Examples(np.ones(95), np.ones(95), block=10))]
    rows = _example_draws([runs], 500, np.random.default_rng(0))[95, 10]
    assert rows.shape == (500, 95)
    blocks = np.pad(rows, ((0, 0), (0, 5)), constant_values=-1).reshape(500, 10, 10)
    steps = np.diff(blocks[:, :, :], axis=2)[:, :-1]  # the last block is cut after 5
    assert np.all((steps == 1) | (steps == -94))
    assert np.all(np.diff(blocks[:, -1, :5], axis=1) % 95 == 1)
    counts = np.bincount(rows.ravel(), minlength=95)
    assert counts.min() > 0.8 * counts.mean() and counts.max() < 1.2 * counts.mean()
    independent = _example_draws([[accuracy_run(0, 0.5, 95, np.random.default_rng(1))]], 500, np.random.default_rng(0))
    assert list(independent) == [(95, 1)]


def test_an_autocorrelated_stream_gets_the_true_standard_error():
    """Streams of 4000 examples whose neighbours correlate 0.8 (AR(1)): the standard error of their
    mean is 3x what independent draws say ((1 + 0.8) / (1 - 0.8) = 9 in variance). Over 20 streams,
    the interval from blocks of 100 is about 2 x 1.96 true standard errors wide (within 20%); the
    one from independent draws about a third of that."""
    rng = np.random.default_rng(9)
    n, phi = 4000, 0.8
    true_se = np.sqrt((1 + phi) / (1 - phi) / n)
    blocked, independent = [], []
    for _ in range(20):
        x = ar1_stream(n, phi, rng)
        for block, widths in ((1, independent), (100, blocked)):
            run = RunScore(0, float(x.mean()), Examples(x, np.ones(n), block=block))
            widths.append(cell_interval([run], n_boot=1000).width / (2 * 1.96 * true_se))
    assert 0.8 < np.median(blocked) < 1.2
    assert 0.25 < np.median(independent) < 0.45
    assert cell_interval([run]).over == "test examples in blocks of 100 (1 seed)"


def test_a_pair_reads_the_same_blocks():
    """Two runs of one seed whose per-example scores differ by 0.1 everywhere: paired by example,
    every replicate of the difference is 0.1, blocks or not; each side alone varies."""
    x = ar1_stream(600, 0.8, np.random.default_rng(10))
    for block in (1, 50):
        a = [RunScore(0, float(x.mean()) + 0.1, Examples(x + 0.1, np.ones(600), block=block))]
        b = [RunScore(0, float(x.mean()), Examples(x, np.ones(600), block=block))]
        d = difference_interval(a, b)
        assert (d.low, d.high) == pytest.approx((0.1, 0.1), abs=1e-12) and cell_interval(a).width > 0.05


def test_independent_examples_draw_as_before_blocks():
    """Examples without blocks give the replicates of one index drawn at a time, bit for bit: the
    seeds drawn first, then each test set's draw in increasing example count (here 300 and 500)."""
    rng = np.random.default_rng(11)
    runs = [accuracy_run(s, 0.6, 300 if s < 2 else 500, rng) for s in range(4)]
    draw = np.random.default_rng(0)
    picks = draw.integers(0, 4, size=(1000, 4))
    rows = {m: draw.integers(0, m, size=(1000, m), dtype=np.int32) for m in (300, 500)}
    per_run = np.stack([r.examples.value(rows[len(r.examples.numerator)]) for r in runs], axis=1)
    values = np.take_along_axis(per_run, picks, axis=1)
    assert np.array_equal(cell_replicates(runs, n_boot=1000), values.mean(1))


def test_a_stream_shorter_than_two_blocks_is_refused():
    with pytest.raises(
        ValueError,
        match=r"cell: test examples in blocks of 128 need at least 256 of them \(two blocks\), got 200 for seed 0",
    ):
        cell_interval([RunScore(0, 0.5, Examples(np.ones(200), np.ones(200), block=128))])
    with pytest.raises(ValueError, match=r"Examples.block: expected an int >= 1, got 0"):
        Examples(np.ones(2), np.ones(2), block=0)


def test_a_run_of_a_stream_task_is_drawn_in_its_blocks(tmp_path):
    """The report reads a run's task from its result.json: an LM run's test windows are drawn in
    the task's blocks, an MQAR run's examples one by one."""
    from lcsm.engine.report import run_score
    from lcsm.tasks import resolve

    rows = "".join(f"L256,256,{k % 7},{600.0 + k}\n" for k in range(300))
    for task, block in (("lm", resolve("lm").example_block), ("mqar", 1)):
        run = tmp_path / task
        run.mkdir()
        (run / "test_examples.csv").write_text("segment,total,correct,loss\n" + rows)
        (run / "result.json").write_text(json.dumps({"eval_split": "test", "config": {"task": {"name": task}}}))
        loss = sum(600.0 + k for k in range(300)) / (300 * 256)  # the reported loss the examples give back
        score = run_score(run, {"run": task, "metric:loss": loss}, "loss", [])
        assert score.examples.block == block
    assert resolve("lm").example_block > 1
