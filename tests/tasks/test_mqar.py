"""MQAR (Zoology protocol): generator invariants, power-law gaps, determinism, the disk cache,
batching and metrics."""

import errno
import hashlib
import math
import os

import numpy as np
import pytest
import torch

from lcsm import tasks
from lcsm.tasks import IGNORE_INDEX
from lcsm.tasks.mqar import mqar_segment, power_law

V = 8192


def _rng(seed=0):
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed)))


def _check_example(x, y, seq_len, kv, vocab):
    """Every invariant of one example (x inputs [T], y labels [T], numpy)."""
    ctx = 2 * kv
    assert x.shape == y.shape == (seq_len,)
    keys, values = x[0:ctx:2], x[1:ctx:2]
    assert ((keys >= 1) & (keys < vocab // 2)).all(), keys
    assert ((values >= vocab // 2) & (values < vocab)).all(), values
    assert len(set(keys.tolist())) == kv and len(set(values.tolist())) == kv
    value_of = dict(zip(keys.tolist(), values.tolist(), strict=False))
    assert (y[:ctx] == IGNORE_INDEX).all()
    region = x[ctx:]
    query_offsets = np.nonzero(region)[0]
    # each key exactly once, at an even offset of the query region, and nothing else there
    assert sorted(region[query_offsets].tolist()) == sorted(keys.tolist())
    assert (query_offsets % 2 == 0).all() and query_offsets.max() < 2 * ((seq_len - ctx) // 2)
    labelled = np.nonzero(y != IGNORE_INDEX)[0]
    assert labelled.tolist() == (ctx + query_offsets).tolist()
    # the label of a query is the token that followed that key in the context (labels = seq[1:])
    for t in labelled:
        assert y[t] == value_of[int(x[t])]


@pytest.mark.parametrize("seq_len,kv", [(64, 4), (128, 8), (512, 64), (16, 4), (8, 1)])
def test_generator_invariants(seq_len, kv):
    n = 64 if seq_len == 512 else 200
    x, y = mqar_segment(_rng(seq_len + kv), vocab_size=V, seq_len=seq_len, kv_pairs=kv, num_examples=n)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (n, seq_len)
    for xi, yi in zip(x.numpy(), y.numpy(), strict=False):
        _check_example(xi, yi, seq_len, kv, V)


def test_small_vocab_uses_every_key_and_value_range_edge():
    # vocab 12 (Zoology's docstring example): keys {1..5}, values {6..11}; 5 keys of 5 -> all used.
    x, y = mqar_segment(_rng(1), vocab_size=12, seq_len=20, kv_pairs=5, num_examples=50)
    for xi, yi in zip(x.numpy(), y.numpy(), strict=False):
        _check_example(xi, yi, 20, 5, 12)
        assert sorted(xi[0:10:2].tolist()) == [1, 2, 3, 4, 5]
    assert set(x[:, 1:10:2].flatten().tolist()) == set(range(6, 12))


def test_keys_that_nearly_exhaust_the_vocabulary_are_drawn_without_stalling():
    # 20 keys of the 20 of vocabulary 42 (and 20 of its 21 values): a row without a repeat by
    # rejection has chance 2e-8, so the rows are permutations' heads instead; it hung before.
    x, y = mqar_segment(_rng(2), vocab_size=42, seq_len=80, kv_pairs=20, num_examples=300)
    for xi, yi in zip(x.numpy(), y.numpy(), strict=False):
        _check_example(xi, yi, 80, 20, 42)
    assert set(x[:, 1:40:2].flatten().tolist()) == set(range(21, 42))


def test_the_settings_rejection_served_keep_their_draws():
    # The switch to permutations lies below the demo's 16 keys of 31 (vocabulary 64, 256 tokens),
    # so its data, and every result trained on it, stays as generated before.
    from lcsm.tasks.mqar import MIN_NO_REPEAT

    assert math.prod(1 - i / 31 for i in range(16)) > MIN_NO_REPEAT


def test_random_non_queries_only_changes_the_filler():
    kw = dict(vocab_size=V, seq_len=128, kv_pairs=8, num_examples=300)
    x0, y0 = mqar_segment(_rng(3), **kw)
    x1, y1 = mqar_segment(_rng(3), random_non_queries=True, **kw)
    assert torch.equal(y0, y1)
    keep = x0 != 0
    assert torch.equal(x1[keep], x0[keep])
    filler = x1[~keep].double()
    # uniform over [0, V): mean V/2 - 1/2, std V/sqrt(12); 4 standard errors
    assert abs(filler.mean().item() - (V - 1) / 2) < 4 * V / math.sqrt(12 * filler.numel())
    assert filler.min() >= 0 and filler.max() < V


# ----------------------------------------------------------------------------- gap distribution


def _chi2_critical(dof, z=3.0902):
    """0.999 quantile of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _chi2(observed_gaps, probs):
    counts = np.bincount(observed_gaps, minlength=probs.size)
    expected = probs * observed_gaps.size
    return float(((counts - expected) ** 2 / expected).sum())


def _gaps_by_key(x, kv):
    """[N, kv]: the gap of key j (j-th key of the context) recovered from the query region."""
    x = x.numpy()
    ctx = 2 * kv
    out = np.empty((x.shape[0], kv), dtype=np.int64)
    for r, row in enumerate(x):
        pos = {int(k): o for o, k in enumerate(row[ctx:]) if k}
        out[r] = [pos[int(k)] // 2 for k in row[0:ctx:2]]
    return out


def test_single_gap_follows_the_power_law():
    # kv = 1: the one gap is a draw from p(i) ∝ a i^(a-1) over space = (64 - 2) // 2 = 31 offsets.
    x, _ = mqar_segment(_rng(11), vocab_size=V, seq_len=64, kv_pairs=1, num_examples=20000)
    gaps = _gaps_by_key(x, 1)[:, 0]
    p = power_law(31, 0.01)
    assert _chi2(gaps, p) < _chi2_critical(30)
    # and the test has power: uniform gaps (a = 1) fail it by far
    xu, _ = mqar_segment(_rng(11), vocab_size=V, seq_len=64, kv_pairs=1, num_examples=20000, power_a=1.0)
    assert _chi2(_gaps_by_key(xu, 1)[:, 0], p) > 10 * _chi2_critical(30)


def test_gaps_without_replacement_follow_successive_sampling():
    # np.random.choice(space, k, replace=False, p) draws one gap after another, renormalising
    # over what is left; key j gets the j-th draw. First draw ~ p; second draw ~
    # sum_{i != j} p_i p_j / (1 - p_i).
    kv, seq_len = 4, 64
    space = (seq_len - 2 * kv) // 2
    x, _ = mqar_segment(_rng(12), vocab_size=V, seq_len=seq_len, kv_pairs=kv, num_examples=20000)
    gaps = _gaps_by_key(x, kv)
    assert (np.sort(gaps, 1)[:, 1:] != np.sort(gaps, 1)[:, :-1]).all()
    p = power_law(space, 0.01)
    second = p * ((p / (1 - p)).sum() - p / (1 - p))
    assert abs(second.sum() - 1) < 1e-12
    assert _chi2(gaps[:, 0], p) < _chi2_critical(space - 1)
    assert _chi2(gaps[:, 1], second) < _chi2_critical(space - 1)
    # the first and second draws differ in law (the mode 0 is taken first more often)
    assert _chi2(gaps[:, 1], p) > 2 * _chi2_critical(space - 1)


def test_a_large_power_a_gives_the_power_law_without_overflow():
    # a·i^(a-1) overflows float64 from a ~136 at seq_len 512, which made the law NaN and the gaps
    # degenerate; in log space the law stays, down to the gaps whose probability is below float64's
    # range, which the race still ranks by their law (the largest gaps first).
    p = power_law(248, 500.0)
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-12 and p.argmax() == 247 and p[0] == 0
    with np.errstate(all="raise"):
        x, _ = mqar_segment(_rng(13), vocab_size=V, seq_len=64, kv_pairs=8, num_examples=50, power_a=1e5)
    gaps = _gaps_by_key(x, 8)
    assert (np.sort(gaps, 1) == np.arange(16, 24)).all()


def test_settings_past_the_direct_law_have_caches_of_their_own():
    # data made before the log-space law (degenerate gaps) must not be served from a cache; the
    # other settings keep their keys (the last: its key before this field existed), and their caches
    def task(power_a):
        return tasks.build("mqar", use_cache=False, power_a=power_a, train_grid="512:8", test_grid="64:4")

    assert task(120.0).cache_fields("train") == task(200.0).cache_fields("test") == {}
    assert task(200.0).cache_fields("train") == {"power_law": "log-space"}
    assert task(0.01).cache_key("train") == "308c5b0081e01df9cd4f85d0e514c852"


# ----------------------------------------------------------------------------- task, determinism, cache

SMALL = dict(train_grid="16:2,32:4", test_grid="32:4,64:8", train_examples=40, test_examples=12)


def _same(a, b):
    return all(
        torch.equal(sa.inputs, sb.inputs) and torch.equal(sa.labels, sb.labels) and sa.name == sb.name
        for sa, sb in zip(a.segments, b.segments, strict=False)
    ) and len(a.segments) == len(b.segments)


def test_task_segments_follow_the_grids(tmp_path):
    task = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    train, test = task.dataset("train"), task.dataset("test")
    assert train.segment_sizes() == {"L16-kv2": 40, "L32-kv4": 40}
    assert test.segment_sizes() == {"L32-kv4": 12, "L64-kv8": 12}
    assert task.max_len == 64 and task.vocab_size == V and task.default_head == "lm"
    for seg in train.segments + test.segments:
        L, kv = seg.meta["seq_len"], seg.meta["kv_pairs"]
        assert seg.inputs.shape == (len(seg), L)
        for xi, yi in zip(seg.inputs.numpy(), seg.labels.numpy(), strict=False):
            _check_example(xi, yi, L, kv, V)
    # stored compactly, served as int64
    assert train.segments[0].inputs.dtype == torch.int16
    item = train[len(train) - 1]
    assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
    assert item["segment"] == "L32-kv4" and item["seq_len"] == 32 and item["kv_pairs"] == 4
    assert torch.equal(item["input_ids"], train.segments[1].inputs[-1].long())
    # same (seq_len, kv) in train and test: different examples
    assert not torch.equal(train.segments[1].inputs[:12], test.segments[0].inputs)


def test_same_seed_same_data_other_seed_other_data():
    a = tasks.build("mqar", use_cache=False, **SMALL).dataset("train")
    b = tasks.build("mqar", use_cache=False, **SMALL).dataset("train")
    c = tasks.build("mqar", use_cache=False, seed=1, **SMALL).dataset("train")
    assert _same(a, b)
    assert not any(torch.equal(sa.inputs, sc.inputs) for sa, sc in zip(a.segments, c.segments, strict=False))


def test_data_is_pinned_across_machines():
    # The exact data of a fixed config; a change of numpy's PCG64/random() stream or of the
    # generator shows up here (and then generator_version must be bumped so old caches are not
    # reused).
    task = tasks.build("mqar", use_cache=False, vocab_size=64, train_grid="16:2", test_grid="16:2", train_examples=3)
    seg = task.generate("train")[0]
    assert seg.inputs[0].tolist() == [10, 59, 26, 39, 0, 0, 10, 0, 0, 0, 0, 0, 26, 0, 0, 0]
    assert seg.labels[0].tolist() == [-100] * 6 + [59] + [-100] * 5 + [39] + [-100] * 3
    h = hashlib.sha256(seg.inputs.numpy().tobytes() + seg.labels.numpy().tobytes()).hexdigest()
    assert h == "be4aeb23facf6ecc559df8b9031cc76c81bc80fef2aa92bd8b902a1b0ae0730e"


def test_cache_hit_returns_identical_data_without_generating(tmp_path, monkeypatch):
    first = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    data = first.dataset("train")
    path = first.cache_path("train")
    assert path.exists() and path.parent.parent == tmp_path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    second = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    monkeypatch.setattr(second, "generate", lambda split: pytest.fail("cache miss"))
    assert _same(second.dataset("train"), data)
    # another config is another file
    other = tasks.build("mqar", cache_dir=tmp_path, **{**SMALL, "train_examples": 41})
    assert other.cache_path("train") != path


def _corrupt_truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_garbage(path):
    path.write_bytes(b"not a torch file")


def _corrupt_tamper(path):
    # a perfectly loadable file whose tensors no longer match the stored checksum
    payload = torch.load(path, weights_only=True)
    payload["segments"][0]["labels"][0, -1] = 7
    torch.save(payload, path)


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_garbage, _corrupt_tamper])
def test_corrupt_cache_is_rebuilt_not_trusted(tmp_path, corrupt):
    reference = tasks.build("mqar", use_cache=False, **SMALL).dataset("train")
    task = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    task.dataset("train")
    path = task.cache_path("train")
    corrupt(path)
    again = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    with pytest.warns(RuntimeWarning, match="corrupt task cache"):
        data = again.dataset("train")
    assert _same(data, reference)
    # the file was rewritten whole: a third reader trusts it silently
    third = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    third.generate = lambda split: pytest.fail("cache miss")
    assert _same(third.dataset("train"), reference)


@pytest.mark.parametrize(
    "error, cause",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "disk full"),
        (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
        (RuntimeError("basic_ios::clear: iostream error"), "basic_ios::clear: iostream error"),
    ],
)
def test_a_cache_that_cannot_take_the_data_is_a_warning(tmp_path, monkeypatch, error, cause):
    """The run has its data: a full or read-only cache (often on another disk than the run's)
    costs the next run its making, not this one (it stopped the run)."""
    from lcsm.tasks import base

    def refuse(*args):
        raise error

    monkeypatch.setattr(base, "save_segments", refuse)
    task = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    with pytest.warns(RuntimeWarning, match=rf"task data not cached at .*\({cause}"):
        data = task.dataset("train")
    assert _same(data, tasks.build("mqar", use_cache=False, **SMALL).dataset("train"))


def test_cache_file_of_another_config_is_not_trusted(tmp_path):
    a = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    b = tasks.build("mqar", cache_dir=tmp_path, **{**SMALL, "seed": 5})
    a.dataset("train")
    os.replace(a.cache_path("train"), b.cache_path("train"))
    with pytest.warns(RuntimeWarning, match="key mismatch"):
        data = b.dataset("train")
    assert _same(data, tasks.build("mqar", use_cache=False, **{**SMALL, "seed": 5}).dataset("train"))


def test_default_cache_dir_follows_lcsm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path))
    task = tasks.build("mqar", **SMALL)
    assert task.cache_path("test").is_relative_to(tmp_path / "tasks")
    task.dataset("test")
    assert task.cache_path("test").exists()


# ----------------------------------------------------------------------------- batching


def test_batches_stay_in_one_segment_and_cover_the_split():
    ds = tasks.build("mqar", use_cache=False, **SMALL).dataset("train")
    seen = []
    for batch in ds.loader(batch_size=16, shuffle=True, seed=3, epoch=0):
        assert len(set(batch["segment"])) == 1
        L = batch["seq_len"][0].item()
        assert batch["input_ids"].shape == batch["labels"].shape == (len(batch["segment"]), L)
        seen.append(batch["input_ids"])
    rows = sorted(tuple(r.tolist()) for b in seen for r in b)
    expected = sorted(tuple(r.tolist()) for s in ds.segments for r in s.inputs)
    assert rows == expected

    def order(seed, epoch):
        return [b["input_ids"][0].tolist() for b in ds.loader(batch_size=16, shuffle=True, seed=seed, epoch=epoch)]

    assert order(3, 0) == order(3, 0)
    assert order(3, 0) != order(3, 1)
    plain = [b["segment"][0] for b in ds.loader(batch_size=16)]
    assert plain == ["L16-kv2"] * 3 + ["L32-kv4"] * 3


# ----------------------------------------------------------------------------- loss and metrics


def _one_hot_logits(labels, vocab):
    """Logits whose argmax is the label at labelled positions and a wrong token elsewhere."""
    logits = torch.zeros(*labels.shape, vocab)
    target = torch.where(labels == IGNORE_INDEX, torch.zeros_like(labels), labels)
    logits.scatter_(-1, target.unsqueeze(-1), 30.0)
    return logits


def test_perfect_logits_score_one_everywhere():
    task = tasks.build("mqar", use_cache=False, **SMALL)
    ev = task.evaluator()
    for batch in task.dataset("test").loader(batch_size=5):
        logits = _one_hot_logits(batch["labels"], task.vocab_size)
        ev.update(logits, batch["labels"], batch)
        assert task.loss(logits, batch["labels"]).item() < 1e-6
    m = ev.compute()
    assert set(m) == {
        "loss",
        "accuracy",
        "accuracy/L32-kv4",
        "accuracy/L64-kv8",
        "accuracy/kv_pairs=4",
        "accuracy/kv_pairs=8",
    }
    assert all(m[k] == 1.0 for k in m if k != "loss")


def test_random_logits_score_one_over_vocab():
    vocab = 64
    task = tasks.build(
        "mqar", use_cache=False, vocab_size=vocab, train_grid="16:2", test_grid="32:4,64:8", test_examples=600
    )
    gen = torch.Generator().manual_seed(0)
    ev = task.evaluator()
    labelled = 0
    for batch in task.dataset("test").loader(batch_size=100):
        logits = torch.randn(*batch["labels"].shape, vocab, generator=gen)
        ev.update(logits, batch["labels"], batch)
        labelled += int((batch["labels"] != IGNORE_INDEX).sum())
    m = ev.compute()
    sigma = math.sqrt((1 / vocab) * (1 - 1 / vocab) / labelled)
    assert abs(m["accuracy"] - 1 / vocab) < 4 * sigma
    assert abs(m["loss"] - math.log(vocab)) < 0.6  # randn logits: E[CE] = log V + O(1/2)
    assert 0 < m["accuracy/L32-kv4"] < 0.05 and 0 < m["accuracy/L64-kv8"] < 0.05


def test_accuracy_is_a_mean_over_examples_not_over_tokens():
    # Zoology: per-example accuracy over its labelled positions, then the mean over examples.
    labels = torch.full((2, 8), IGNORE_INDEX)
    labels[0, [1, 3, 5, 7]] = torch.tensor([1, 2, 3, 4])  # 4 queries, 1 right
    labels[1, [2]] = 5  # 1 query, right
    preds = torch.zeros(2, 8, dtype=torch.long)
    preds[0, 1] = 1
    preds[1, 2] = 5
    logits = torch.nn.functional.one_hot(preds, 8).float()
    meta = {"segment": ["a", "b"], "kv_pairs": torch.tensor([4, 1])}
    m = tasks.build("mqar", use_cache=False).metrics(logits, labels, meta)
    assert m["accuracy"] == pytest.approx((1 / 4 + 1) / 2)  # token mean would be 2/5
    assert m["accuracy/a"] == 0.25 and m["accuracy/b"] == 1.0
    assert m["accuracy/kv_pairs=4"] == 0.25 and m["accuracy/kv_pairs=1"] == 1.0
    overall = tasks.build("mqar", use_cache=False).metrics(logits, labels)
    assert set(overall) == {"loss", "accuracy"}


def test_loss_counts_only_labelled_positions():
    task = tasks.build("mqar", use_cache=False, vocab_size=16, train_grid="16:2", test_grid="16:2", test_examples=4)
    batch = next(iter(task.dataset("test").loader(batch_size=4)))
    labels = batch["labels"]
    logits = torch.randn(*labels.shape, 16, generator=torch.Generator().manual_seed(1))
    mask = labels != IGNORE_INDEX
    manual = -torch.log_softmax(logits, -1)[mask].gather(-1, labels[mask].unsqueeze(-1)).mean()
    loss = task.loss(logits, labels)
    assert torch.allclose(loss, manual)
    noisy = logits.clone()
    noisy[~mask] += 5 * torch.randn(int((~mask).sum()), 16)
    assert torch.equal(task.loss(noisy, labels), loss)
    with pytest.raises(ValueError, match="logits/labels"):
        task.loss(logits[:, :-1], labels)


def test_metric_names_are_known_without_evaluating(tmp_path, check_metric_names):
    """Per segment and per kv_pairs slice (two segments share kv_pairs 4)."""
    task = tasks.build(
        "mqar",
        cache_dir=tmp_path,
        vocab_size=64,
        train_grid="16:2,32:4",
        test_grid="16:4,32:4",
        train_examples=32,
        test_examples=16,
    )
    check_metric_names(task)
    assert sorted(task.evaluator().metric_names(task.dataset("test"))) == [
        "accuracy",
        "accuracy/L16-kv4",
        "accuracy/L32-kv4",
        "accuracy/kv_pairs=4",
        "loss",
    ]


def test_metric_names_of_slices_held_per_example():
    """A slice key may be a per-example extra (float values too), not only a segment's meta."""
    from lcsm.tasks import Evaluator, Segment, SegmentedDataset

    ids = torch.zeros(3, 4, dtype=torch.long)
    ds = SegmentedDataset([Segment("a", ids, ids, {"n": 7}, {"depth": torch.tensor([0.5, 0.25, 0.5])})])
    evaluator = Evaluator(("depth", "n"))
    for batch in ds.loader(2):
        evaluator.update(torch.randn(len(batch["segment"]), 4, 8), batch["labels"], batch)
    assert (
        sorted(Evaluator(("depth", "n")).metric_names(ds))
        == sorted(evaluator.compute())
        == ["accuracy", "accuracy/a", "accuracy/depth=0.25", "accuracy/depth=0.5", "accuracy/n=7", "loss"]
    )


def test_validation_split_is_drawn_like_test_from_its_own_stream(tmp_path):
    plain = tasks.build("mqar", cache_dir=tmp_path, **SMALL)
    assert plain.splits == ("train", "test")
    with pytest.raises(ValueError, match="split: expected one of train, test, got 'validation'"):
        plain.dataset("validation")
    task = tasks.build("mqar", cache_dir=tmp_path, validation_examples=7, **SMALL)
    assert task.splits == ("train", "validation", "test")
    valid, test = task.dataset("validation"), task.dataset("test")
    assert valid.segment_sizes() == {"L32-kv4": 7, "L64-kv8": 7}
    for seg in valid.segments:
        for xi, yi in zip(seg.inputs.numpy(), seg.labels.numpy(), strict=True):
            _check_example(xi, yi, seg.meta["seq_len"], seg.meta["kv_pairs"], V)
    assert not torch.equal(valid.segments[0].inputs, test.segments[0].inputs[:7])
    # the test split does not depend on whether a validation split exists
    assert _same(test, plain.dataset("test"))
    assert "validation: L32-kv4, L64-kv8 (7 examples each)" in task.describe()
    with pytest.raises(ValueError, match="validation_examples"):
        tasks.build("mqar", use_cache=False, validation_examples=-1, **SMALL)
