"""Needle in a haystack (NIAH): find one fact hidden in long real prose.

MetaLA (appendix A5, Table A8) evaluates pretrained language models on NIAH following Shen et al.
2024: accuracy of retrieving a needle placed at a chosen depth of a long context, by context
length. At this project's scale there is no pretrained model to probe, so the task is trained: each
example is a window of real prose from the ``lm`` corpus (the haystack), a needle sentence
inserted at a depth fraction, and a question at the end whose answer is the needle's number::

    <prose ...> The special magic number is 4821. <... prose> \\n
    What is the special magic number? The special magic number is 4821

Byte tokens (the ``lm`` byte tokenizer, vocabulary 257). Labels sit only on the answer's digits
(the model predicts each digit from everything before it; -100 elsewhere). Metrics: ``accuracy``
(fraction of answer digits right, per example), ``exact`` (all digits right) and both per context
length and per depth, so the report reads as MetaLA Table A8 (accuracy by context scale). The
haystacks of the train and test splits come from the ``lm`` corpus's train and test documents,
so no test haystack text is seen in training; needle numbers are drawn per example.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lcsm._checks import check_int

from . import lm
from .base import Task, register
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment
from .metrics import Evaluator
from .word_problems import parse_lengths

_SPLIT_CODE = {"train": 0, "test": 1}
SNAP = 32
QUESTION = "\nWhat is the special magic number? The special magic number is "


def needle_text(number: str) -> str:
    return f" The special magic number is {number}. "


@dataclass(frozen=True)
class NIAHConfig(TaskConfig):
    """Options of the ``niah`` task.

    contexts: context lengths in tokens (bytes); depths: needle positions as fractions of the
        haystack (0 = start, 1 = just before the question).
    digits: length of the needle number. train_examples / test_examples: per (context, depth).
    corpus, data_dir: the haystack corpus, as the ``lm`` task's options.
    seed: haystack windows and needle numbers.
    """

    contexts: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    digits: int = 4
    train_examples: int = 400
    test_examples: int = 50
    corpus: str = "default"
    data_dir: str = None
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.contexts, str):  # "256,512", as mqar's grids and word_problems' lengths
            contexts = parse_lengths("contexts", self.contexts)
        else:
            contexts = tuple(self.contexts) if isinstance(self.contexts, (list, tuple)) else (self.contexts,)
        depths = tuple(self.depths) if isinstance(self.depths, (list, tuple)) else (self.depths,)
        for name, values in (("contexts", contexts), ("depths", depths)):
            if not values:
                raise ValueError(f"{name}: expected at least one value, got {getattr(self, name)!r}")
        if not all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in depths):
            raise ValueError(f"depths: expected fractions in [0, 1] (a list of numbers), got {self.depths!r}")
        object.__setattr__(self, "contexts", contexts)
        object.__setattr__(self, "depths", tuple(float(d) for d in depths))
        check_int("digits", self.digits, 1)
        lengths = [L for L in contexts if isinstance(L, int) and not isinstance(L, bool)]
        if lengths:
            # Past what the longest context holds the needle cannot fit, and "0" * digits could not
            # even be made (10**30 digits): name digits, not contexts.
            fixed = len(needle_text("")) + len(QUESTION) + 16
            most = (max(lengths) - fixed) // 2
            if 1 <= most < self.digits:  # below 1, no context holds any needle: contexts is named
                raise ValueError(
                    f"digits: expected an integer from 1 to {most} (the needle, the question and the answer "
                    f"must fit the longest context, {max(lengths)} tokens), got {self.digits!r}"
                )
        overhead = len(needle_text("0" * self.digits)) + len(QUESTION) + self.digits
        for L in contexts:
            check_int("contexts", L, overhead + 16)
        if len(self.depths) != len(depths) or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths: expected fractions in [0, 1], got {depths!r}")
        if len(set(contexts)) != len(contexts):
            raise ValueError(f"contexts: expected distinct lengths, got {contexts!r}")
        percents = [int(round(d * 100)) for d in self.depths]
        if len(set(percents)) != len(percents):
            raise ValueError(
                f"depths: segments are named and seeded by whole percents, so depths must differ "
                f"after rounding to 0.01; got {depths!r} ({percents})"
            )
        check_int("train_examples", self.train_examples, 1)
        check_int("test_examples", self.test_examples, 1)
        check_int("seed", self.seed, 0)
        lm.LMConfig(corpus=self.corpus, data_dir=self.data_dir)  # validates the corpus options


class NIAHEvaluator(Evaluator):
    """The base metrics plus ``exact``: the fraction of examples with every answer digit right
    (overall and per slice)."""

    def __init__(self, slice_keys=()):
        super().__init__(slice_keys)
        self._exact: dict[str, list[float]] = {}

    def update(self, logits, labels, batch_meta=None):
        super().update(logits, labels, batch_meta)
        labels = labels.to(logits.device)
        mask = labels != IGNORE_INDEX
        all_right = ((logits.argmax(-1) != labels) & mask).sum(1) == 0
        groups = {"exact": list(range(len(labels)))}
        for key in self.slice_keys if batch_meta is not None else ():
            for i, value in enumerate(torch.as_tensor(batch_meta[key]).tolist()):
                groups.setdefault(f"exact/{key}={value}", []).append(i)
        flags = all_right.tolist()
        for key, rows in groups.items():
            slot = self._exact.setdefault(key, [0.0, 0])
            slot[0] += sum(flags[i] for i in rows)
            slot[1] += len(rows)

    def metric_names(self, dataset=None):
        names = super().metric_names(dataset) + ["exact"]
        return names + ([f"exact/{key}" for key in self._slice_values(dataset)] if dataset is not None else [])

    def compute(self):
        out = super().compute()
        out.update({k: s / n for k, (s, n) in self._exact.items()})
        return out


@register("niah")
class NeedleInAHaystack(Task):
    """Needle in a haystack over real prose; one segment per (context length, depth)."""

    Config = NIAHConfig
    default_head = "lm"
    slice_keys = ("context", "depth_pct")
    generator_version = 1

    @classmethod
    def config_model_fields(cls, config: NIAHConfig) -> dict[str, object]:
        return {"head": {"kind": cls.default_head}, "vocab_size": lm.ByteTokenizer.vocab_size}

    @property
    def max_len(self) -> int:
        return max(self.config.contexts)

    def _haystack(self) -> lm.LanguageModelling:
        return lm.LanguageModelling(
            lm.LMConfig(corpus=self.config.corpus, data_dir=self.config.data_dir),
            cache_dir=self.cache_dir,
            use_cache=self.use_cache,
        )

    def local_sources(self) -> list[Path]:
        return self._haystack().local_sources()

    def _haystack_stream(self, split: str) -> np.ndarray:
        return self._haystack().stream(split).astype(np.int64)

    def generate(self, split: str) -> list[Segment]:
        c = self.config
        tok = lm.ByteTokenizer()
        stream = self._haystack_stream(split)
        question = tok.encode(QUESTION)
        n = c.train_examples if split == "train" else c.test_examples
        segments = []
        for L in c.contexts:
            for depth in c.depths:
                pct = int(round(depth * 100))
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([c.seed, _SPLIT_CODE[split], L, pct])))
                inputs = np.empty((n, L), dtype=np.int64)
                labels = np.full((n, L), IGNORE_INDEX, dtype=np.int64)
                positions = np.empty(n, dtype=np.int64)
                for row in range(n):
                    number = "".join(str(d) for d in rng.integers(0, 10, c.digits))
                    needle = tok.encode(needle_text(number))
                    answer = tok.encode(number)
                    # L + 1 tokens: inputs are the first L, labels the last L (next-token targets)
                    hay_len = L + 1 - len(needle) - len(question) - len(answer)
                    if len(stream) < hay_len:
                        raise ValueError(
                            f"contexts: the {split} haystack corpus has {len(stream)} tokens, fewer "
                            f"than a context of {L}"
                        )
                    start = int(rng.integers(0, len(stream) - hay_len + 1))
                    hay = stream[start : start + hay_len].tolist()
                    at = int(round(depth * hay_len))
                    # between words, as the needle is a sentence of its own (within SNAP bytes)
                    gap = next((i for i, t in enumerate(hay[at : at + SNAP]) if t in (10, 32)), None)
                    at = at + gap + 1 if gap is not None and at + gap + 1 < hay_len else at
                    seq = hay[:at] + needle + hay[at:] + question + answer
                    inputs[row] = seq[:-1]
                    target = np.asarray(seq[1:])
                    labels[row, L - len(answer) :] = target[L - len(answer) :]
                    positions[row] = at
                segments.append(
                    Segment(
                        f"L{L}-d{pct}",
                        torch.from_numpy(inputs),
                        torch.from_numpy(labels),
                        {"context": L, "depth_pct": pct},
                        {"needle_position": torch.from_numpy(positions)},
                    )
                )
        return segments

    @classmethod
    def evaluator(cls) -> NIAHEvaluator:
        return NIAHEvaluator(cls.slice_keys)

    @property
    def tokenizer(self) -> lm.ByteTokenizer:
        """The ``lm`` byte tokenizer its text is in (``lcsm export`` writes it beside the model)."""
        return lm.ByteTokenizer()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def cache_key(self, split: str) -> str:
        # The haystack is the lm task's stream: data of another version of its generator are other
        # data here too, whatever this generator's own version.
        own = super().cache_key(split)
        return hashlib.sha256(f"{own}:lm-{lm.LanguageModelling.generator_version}".encode()).hexdigest()[:32]

    def describe(self) -> str:
        c = self.config
        return "\n".join(
            [
                "niah: needle in a haystack over real prose (MetaLA Table A8 style, trained), byte tokens",
                f"  contexts {list(c.contexts)} x depths {list(c.depths)}; {c.digits}-digit needle numbers; "
                f"corpus {c.corpus!r}",
                f"  {c.train_examples} train / {c.test_examples} test examples per cell; seed {c.seed}",
                "  metrics: accuracy (answer digits), exact (whole answer), per context and per depth",
            ]
        )
