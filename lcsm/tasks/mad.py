"""The MAD synthetic suite (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures"; MetaLA Table A6): six token-manipulation tasks that probe what a sequence mixer
can do. Our own generators, written from the paper and the task definitions of the official code
(``athms/mad-lab``, ``mad/data/instances.py``), with its baseline settings as defaults
(``configs/tasks/*.yml``: vocabulary, length, 12,800 training and 1,280 test examples).

    mad_in_context_recall   key-value pairs; a key seen before must be followed by its value
    mad_noisy_recall        the same with noise tokens (from their own vocabulary) between pairs
    mad_fuzzy_recall        keys and values are motifs of 1-3 tokens; test keys are 3 tokens long
    mad_selective_copying   16 tokens scattered among blanks, copied in order after a copy token
    mad_compression         a random sequence squeezed into one vector and decoded back
    mad_memorization        a fixed key -> value map over the vocabulary, learned across examples

Targets follow MAD exactly: the recall tasks train as language models (every next token is a
target) and are tested only on the values of keys presented earlier ("multi-query"); the copying
and memorization tasks carry targets only where the answer is due. Accuracy is over target
positions (MAD's ``Accuracy`` flattens them; ``Evaluator`` here averages per example first: equal
where every example has the same number of targets, as in in-context recall, selective copying,
compression and memorization; noisy recall (32-53 targets an example in the default test split)
and fuzzy recall (1-16) weight their examples differently from MAD).

Mapping onto lcsm heads:
- every task but compression is a causal LM ("lm" head): the target at position t is predicted
  from tokens 0..t. MAD's recall instances are built with the same shift (inputs ``x[:-1]``,
  targets ``x[1:]``); selective copying and memorization put the target on the position that
  asks for it (a blank after the copy token, the insert token after a key), which is also a
  causal prediction from what came before.
- compression is an encoder-decoder in MAD (``AutoEncoder``): the encoder's last position (the
  compression token) is the only path to a decoder that reconstructs all T tokens. Here: the
  "classifier" head with last-token pooling and an MLP of width d_model, whose output of
  T x V logits is read as [T, V] — one vector must carry the whole sequence, as in MAD. MAD's
  decoder shares an MLP over positions with position embeddings; ours has a position-specific
  output layer (same bottleneck, different decoder).

Splits: test examples that also occur in the training set are dropped and redrawn (MAD only
warns above 0.1% overlap), so train and test are disjoint.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from lcsm._checks import check_bool, check_int

from .base import Task, register
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment, Uniforms

_SPLIT_CODE = {"train": 0, "test": 1}
Instance = tuple[list[int], list[int]]


# ----------------------------------------------------------------------------- generators


def recall_instance(u: Uniforms, c, train: bool) -> Instance:
    """(Noisy) in-context recall, MAD ``generate_in_context_recall_instance``. MAD keeps one pair
    from noise, drawn among all seq_len / 2 pairs, but its loop stops a pair short (the last is
    the probe's), so when the kept one is that last pair every pair can turn out noise, leaving no
    key to probe (MAD raises there: likely with short sequences and much noise, e.g. seq_len 16,
    frac_noise 0.5). Such an instance is drawn again; every other instance is MAD's draw."""
    while (instance := _recall_draw(u, c, train)) is None:
        pass
    return instance


def _recall_draw(u: Uniforms, c, train: bool) -> Instance | None:
    """One of ``recall_instance``'s draws; None when every pair became noise."""
    copy_prefix = c.vocab_size - 1
    plain = (c.vocab_size if c.multi_query else c.vocab_size - 1) - c.noise_vocab_size
    half = plain // 2  # keys [0, half), values [half, plain), noise after them
    inputs: list[int] = []
    targets: list[int] = []
    kv: dict[int, int] = {}
    presented: dict[int, int] = {}
    pairs = c.seq_len // 2
    keep = u.below(pairs)  # one pair is not noise (unless it is the last: see recall_instance)
    for i in range(pairs - 1):
        if c.frac_noise > 0 and i != keep and u() < c.frac_noise:
            inputs += [plain + u.below(c.noise_vocab_size) for _ in range(2)]
            targets += [IGNORE_INDEX] * 2
            continue
        k = u.below(half)
        if k not in kv:
            kv[k] = half + u.below(plain - half)
        v = kv[k]
        inputs += [k, v]
        targets += [IGNORE_INDEX, v if (k in presented and c.multi_query) else IGNORE_INDEX]
        presented[k] = v
    if not presented:
        return None
    probe = list(presented)[u.below(len(presented))]
    if not c.multi_query:
        inputs.append(copy_prefix)
        targets.append(IGNORE_INDEX)
    inputs += [probe, presented[probe]]
    targets += [IGNORE_INDEX, presented[probe]]
    return inputs[:-1], (inputs[1:] if train else targets[1:])


def _motif(u: Uniforms, low: int, high: int, size: int) -> tuple[int, ...]:
    """A uniform ordered tuple of ``size`` distinct tokens from [low, high): what MAD's pick from
    its shuffled list of all permutations draws, without building the list for every instance."""
    pool = list(range(low, high))
    return tuple(pool.pop(u.below(len(pool))) for _ in range(size))


def fuzzy_recall_instance(u: Uniforms, c, train: bool) -> Instance:
    """Fuzzy in-context recall, MAD ``generate_fuzzy_in_context_recall_instance``: keys and
    values are motifs of 1..k (1..v) distinct tokens; test keys are k tokens long; sequences are
    left-padded to seq_len. As in MAD, the probe pair is inserted at a drawn position that the
    loop may never reach (it stops short of seq_len by the probe and a largest pair), and the final
    probe is then a key never seen before: 22 of the 1,280 default test examples (1.7%) end on
    such an unanswerable value. Kept, so that the task is MAD's."""
    copy_prefix = c.vocab_size - 1
    pad = c.vocab_size - 1 if c.multi_query else c.vocab_size - 2
    plain = (c.vocab_size - 1 if c.multi_query else c.vocab_size - 2) - c.noise_vocab_size
    half = plain // 2
    key_sizes = list(range(1, c.k_motif_size + 1)) if train else [c.k_motif_size]
    kp_size = key_sizes[u.below(len(key_sizes))]
    vp_size = 1 + u.below(c.v_motif_size)
    k_probe, v_probe = _motif(u, 0, half, kp_size), _motif(u, half, plain, vp_size)
    probe_at = u.below(c.seq_len - 2 * (kp_size + vp_size))
    probe_added = False
    inputs: list[int] = []
    targets: list[int] = []
    kv: dict[tuple[int, ...], tuple[int, ...]] = {}
    presented = set()
    while len(inputs) < c.seq_len - (kp_size + vp_size) - (c.k_motif_size + c.v_motif_size):
        k_size = key_sizes[u.below(len(key_sizes))]
        v_size = 1 + u.below(c.v_motif_size)
        if len(inputs) >= probe_at and not probe_added:
            inputs += list(k_probe) + list(v_probe)
            targets += [IGNORE_INDEX] * (kp_size + vp_size)
            kv[k_probe] = v_probe
            presented.add(k_probe)
            probe_added = True
            continue
        if c.frac_noise > 0 and u() < c.frac_noise:
            inputs += [plain + u.below(c.noise_vocab_size) for _ in range(k_size + v_size)]
            targets += [IGNORE_INDEX] * (k_size + v_size)
            continue
        k = _motif(u, 0, half, k_size)
        if k == k_probe:
            v = v_probe
            probe_added = True
        else:
            if k not in kv:
                kv[k] = _motif(u, half, plain, v_size)
            v = kv[k]
        inputs += list(k) + list(v)
        targets += [IGNORE_INDEX] * len(k) + (
            list(v) if (k in presented and c.multi_query) else [IGNORE_INDEX] * len(v)
        )
        presented.add(k)
    if not c.multi_query:
        inputs.append(copy_prefix)
        targets.append(IGNORE_INDEX)
    inputs += list(k_probe) + list(v_probe)
    targets += [IGNORE_INDEX] * kp_size + list(v_probe)
    n_pad = c.seq_len + 1 - len(inputs)
    inputs = [pad] * n_pad + inputs
    targets = [IGNORE_INDEX] * n_pad + targets
    return inputs[:-1], (inputs[1:] if train else targets[1:])


def selective_copying_instance(u: Uniforms, c, train: bool) -> Instance:
    """MAD ``generate_selective_copying_instance``: the tokens to copy with blanks inserted at
    random places, a copy token, then one blank per token to copy; the targets are the tokens in
    order on those last blanks."""
    copy_token, blank = c.vocab_size - 1, c.vocab_size - 2
    n = c.num_tokens_to_copy
    to_copy = [u.below(c.vocab_size - 2) for _ in range(n)]
    n_blank = c.seq_len - 2 * n - 1
    # MAD inserts each blank before a uniform position of the tokens to copy (numpy.insert with
    # indices in [0, n), drawn from numpy's global RNG; ours come from the instance's stream)
    before = [0] * n
    for _ in range(n_blank):
        before[u.below(n)] += 1
    body: list[int] = []
    for token, blanks in zip(to_copy, before, strict=False):
        body += [blank] * blanks + [token]
    inputs = body + [copy_token] + [blank] * n
    targets = [IGNORE_INDEX] * (n + n_blank + 1) + to_copy
    return inputs, targets


def compression_instance(u: Uniforms, c, train: bool) -> Instance:
    """MAD ``generate_compression_instance``: seq_len - 1 random tokens and the compression token;
    the target is the whole input, noise positions (if any) ignored: MAD computes targets so but
    returns the inputs in their place, which would ask the model to reconstruct the noise too."""
    token = c.vocab_size - 1
    plain = c.vocab_size - 1 - c.noise_vocab_size
    inputs = [u.below(plain) for _ in range(c.seq_len - 1)] + [token]
    targets = list(inputs)
    for i in range(c.seq_len - 1):
        if c.frac_noise > 0 and u() < c.frac_noise:
            inputs[i] = plain + u.below(c.noise_vocab_size)
            targets[i] = IGNORE_INDEX
    return inputs, targets


@functools.lru_cache(maxsize=8)
def memorization_map(c) -> dict[int, int]:
    """The fixed key -> value map (MAD ``generate_kv_map``: keys from the lower half of the
    vocabulary without the insert token, values from the upper half, paired after shuffling both)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, 12345])))
    plain = c.vocab_size - 1 - c.noise_vocab_size
    keys = rng.permutation(plain // 2).tolist()
    values = (plain // 2 + rng.permutation(plain - plain // 2)).tolist()
    return dict(zip(keys, values, strict=False))


def memorization_instance(u: Uniforms, c, train: bool) -> Instance:
    """MAD ``generate_memorization_instance``: seq_len / 2 (key, insert) pairs; the target at each
    insert token is the key's value under the fixed map. With frac_noise, each pair but one
    (drawn, so that every example asks for a value) is two noise tokens with that probability."""
    insert = c.vocab_size - 1
    plain = c.vocab_size - 1 - c.noise_vocab_size
    kv = c.kv_map
    keys = list(kv)
    pairs = c.seq_len // 2
    keep = u.below(pairs) if c.frac_noise > 0 else None
    inputs: list[int] = []
    targets: list[int] = []
    for i in range(pairs):
        if keep is not None and i != keep and u() < c.frac_noise:
            inputs += [plain + u.below(c.noise_vocab_size) for _ in range(2)]
            targets += [IGNORE_INDEX] * 2
            continue
        k = keys[u.below(len(keys))]
        inputs += [k, insert]
        targets += [IGNORE_INDEX, kv[k]]
    return inputs, targets


# ----------------------------------------------------------------------------- configs and tasks


@dataclass(frozen=True)
class MADConfig(TaskConfig):
    """Options shared by the MAD tasks (MAD's names; defaults: each task's baseline config).

    vocab_size, seq_len; frac_noise and noise_vocab_size (noise tokens come from a vocabulary of
    their own, carved out of vocab_size); num_tokens_to_copy (selective copying); k_motif_size,
    v_motif_size (fuzzy recall); multi_query (recall: probe every repeated key, MAD's setting);
    train_examples, test_examples; seed.
    """

    vocab_size: int = 16
    seq_len: int = 128
    frac_noise: float = 0.0
    noise_vocab_size: int = 0
    num_tokens_to_copy: int = 0
    k_motif_size: int = 1
    v_motif_size: int = 1
    multi_query: bool = True
    train_examples: int = 12_800
    test_examples: int = 1_280
    seed: int = 0

    def __post_init__(self):
        check_int("vocab_size", self.vocab_size, 4)
        check_int("seq_len", self.seq_len, 4)
        if (
            isinstance(self.frac_noise, bool)
            or not isinstance(self.frac_noise, (int, float))
            or not 0 <= self.frac_noise < 1
        ):
            raise ValueError(f"frac_noise: expected a fraction in [0, 1), got {self.frac_noise!r}")
        check_int("noise_vocab_size", self.noise_vocab_size, 0)
        if self.frac_noise > 0 and self.noise_vocab_size == 0:
            raise ValueError("noise_vocab_size: frac_noise > 0 needs noise tokens, got noise_vocab_size=0")
        check_int("num_tokens_to_copy", self.num_tokens_to_copy, 0)
        check_int("k_motif_size", self.k_motif_size, 1)
        check_int("v_motif_size", self.v_motif_size, 1)
        check_bool("multi_query", self.multi_query)
        check_int("train_examples", self.train_examples, 1)
        check_int("test_examples", self.test_examples, 1)
        check_int("seed", self.seed, 0)
        if self.vocab_size - 2 - self.noise_vocab_size < 2:
            raise ValueError(
                f"vocab_size: {self.vocab_size} leaves fewer than 2 ordinary tokens after "
                f"{self.noise_vocab_size} noise tokens and the special tokens"
            )


@dataclass(frozen=True)
class RecallConfig(MADConfig):
    def __post_init__(self):
        super().__post_init__()
        if self.seq_len % 2:
            raise ValueError(
                f"seq_len: recall sequences are key-value pairs, expected an even length, got {self.seq_len}"
            )


@dataclass(frozen=True)
class NoisyRecallConfig(RecallConfig):
    vocab_size: int = 32
    noise_vocab_size: int = 16
    frac_noise: float = 0.2


@dataclass(frozen=True)
class FuzzyRecallConfig(MADConfig):
    k_motif_size: int = 3
    v_motif_size: int = 3

    def __post_init__(self):
        super().__post_init__()
        plain = (self.vocab_size - 1 if self.multi_query else self.vocab_size - 2) - self.noise_vocab_size
        if plain // 2 < self.k_motif_size or plain - plain // 2 < self.v_motif_size:
            raise ValueError(
                f"k_motif_size / v_motif_size: motifs of distinct tokens need at least "
                f"{self.k_motif_size} key and {self.v_motif_size} value tokens, vocab_size "
                f"{self.vocab_size} gives {plain // 2} and {plain - plain // 2}"
            )
        if self.seq_len < 4 * (self.k_motif_size + self.v_motif_size):
            raise ValueError(f"seq_len: expected >= 4 x (k_motif_size + v_motif_size), got {self.seq_len}")


@dataclass(frozen=True)
class CopyingConfig(MADConfig):
    seq_len: int = 256
    num_tokens_to_copy: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.num_tokens_to_copy < 1 or self.seq_len <= 2 * self.num_tokens_to_copy + 1:
            raise ValueError(
                f"num_tokens_to_copy: expected 1 <= n with seq_len > 2n + 1, got n = "
                f"{self.num_tokens_to_copy}, seq_len = {self.seq_len}"
            )
        if self.frac_noise or self.noise_vocab_size:
            raise ValueError(
                f"frac_noise / noise_vocab_size: selective copying has no noise tokens (MAD's "
                f"generator takes none), expected 0 and 0, got {self.frac_noise!r} and "
                f"{self.noise_vocab_size!r}"
            )


@dataclass(frozen=True)
class CompressionConfig(MADConfig):
    seq_len: int = 32


@dataclass(frozen=True)
class MemorizationConfig(MADConfig):
    vocab_size: int = 256
    seq_len: int = 32
    train_examples: int = 256

    def __post_init__(self):
        super().__post_init__()
        if self.seq_len % 2:
            raise ValueError(f"seq_len: key / insert pairs need an even length, got {self.seq_len}")

    @property
    def kv_map(self) -> dict[int, int]:
        return memorization_map(self)


class MADTask(Task):
    """A MAD task: splits train / test, one segment each."""

    default_head = "lm"
    generator_version = 1
    instance = None  # (rng, config, train) -> (inputs, targets)

    @classmethod
    def config_model_fields(cls, config: MADConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head}, "vocab_size": config.vocab_size}

    @property
    def max_len(self) -> int:
        return self.config.seq_len

    def _draw(self, split: str, n: int, exclude: set | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        u = Uniforms(
            np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.config.seed, _SPLIT_CODE[split]])))
        )
        inputs, targets = [], []
        attempts = 0
        while len(inputs) < n:
            attempts += 1
            if attempts > 20 * n + 1000:
                raise ValueError(
                    f"test_examples: only {len(inputs)} of {n} test examples differ from every "
                    "training example; this setting has too few distinct sequences"
                )
            x, y = type(self).instance(u, self.config, split == "train")
            if exclude is not None and tuple(x) in exclude:
                continue
            inputs.append(x)
            targets.append(y)
        return torch.tensor(inputs), torch.tensor(targets)

    def generate(self, split: str) -> list[Segment]:
        c = self.config
        if split == "train":
            x, y = self._draw("train", c.train_examples)
        else:
            seen = {tuple(row) for row in self.dataset("train").segments[0].inputs.tolist()}
            x, y = self._draw("test", c.test_examples, exclude=seen)
        return [Segment(f"L{c.seq_len}", x, y, {"seq_len": c.seq_len})]

    def describe(self) -> str:
        c = self.config
        return (
            f"{self.registry_name}: MAD (Poli et al. 2024) {type(self).__doc__.strip().splitlines()[0]}\n"
            f"  vocab {c.vocab_size}, length {c.seq_len}, {c.train_examples} train / {c.test_examples} test "
            f"examples; seed {c.seed}; accuracy over target positions"
        )


@register("mad_in_context_recall")
class InContextRecall(MADTask):
    """In-context recall: values of keys presented earlier in the sequence."""

    Config = RecallConfig
    instance = staticmethod(recall_instance)


@register("mad_noisy_recall")
class NoisyRecall(MADTask):
    """Noisy in-context recall: recall with noise tokens between the pairs."""

    Config = NoisyRecallConfig
    instance = staticmethod(recall_instance)


@register("mad_fuzzy_recall")
class FuzzyRecall(MADTask):
    """Fuzzy in-context recall: keys and values are motifs of several tokens."""

    Config = FuzzyRecallConfig
    instance = staticmethod(fuzzy_recall_instance)


@register("mad_selective_copying")
class SelectiveCopying(MADTask):
    """Selective copying: the scattered tokens, in order, after the copy token."""

    Config = CopyingConfig
    instance = staticmethod(selective_copying_instance)


@register("mad_memorization")
class Memorization(MADTask):
    """Memorization: a fixed key-value map learned across examples."""

    Config = MemorizationConfig
    generator_version = 2  # 2: frac_noise inserts noise pairs (version 1 ignored it)
    instance = staticmethod(memorization_instance)


@register("mad_compression")
class Compression(MADTask):
    """Compression: reconstruct the sequence from the compression token's vector alone."""

    Config = CompressionConfig
    default_head = "classifier"
    instance = staticmethod(compression_instance)

    @classmethod
    def config_model_fields(cls, config: CompressionConfig) -> dict[str, object]:
        # MAD's bottleneck is the encoder's last position (global_pool "last"); model.head.hidden
        # (e.g. = d_model) adds the hidden layer of its decoder MLP
        fields = super().config_model_fields(config)
        head = {**fields["head"], "n_classes": config.seq_len * config.vocab_size, "pooling": "last"}
        return {**fields, "head": head}

    def logits(self, model, batch):
        flat = model(batch["input_ids"])
        return flat.view(flat.shape[0], self.config.seq_len, self.config.vocab_size)
