"""Task data: the segments a task generates, the dataset and batch sampler that serve them, and
``Uniforms``, the random numbers the generators draw.

Data layout. A split is a list of *segments*, each a block of equal-length examples generated
with one setting (for MQAR one (seq_len, kv_pairs) pair). Examples of different segments may have
different lengths, so a batch never mixes segments (``SegmentBatchSampler``) and nothing is padded.
Each example is a dict ``{"input_ids": [T], "labels": [T], "segment": name, <meta key>: int,
<extra key>: tensor}`` (ids and labels int64); a batch stacks them (``input_ids``/``labels``
[B, T], ``segment`` a list of B names, each meta key a [B] tensor, each extra [B, ...]). Labels
are -100 (``IGNORE_INDEX``) at positions that carry no target. Extras carry per-example tensors a
head needs: ``lengths`` (valid tokens of right-padded inputs), ``input_ids2``/``lengths2`` (the
second sequence of a dual task); ``Task.logits`` feeds them to the model.

Shape glossary: B batch, T sequence length (input tokens), N examples.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lcsm._checks import check_bool, check_int

Tensor = torch.Tensor

IGNORE_INDEX = -100
"""Label of positions that carry no target (PyTorch's cross-entropy default, as in Zoology)."""


@dataclass
class Segment:
    """A block of equal-length examples generated with one setting.

    name: label used in batches and metric keys (e.g. ``"L64-kv4"``).
    inputs: [N, T] integer token ids (stored compactly, see ``compact``), or [N, T, C] features.
    labels: [N, T] integer targets, ``IGNORE_INDEX`` where there is none, or [N] (one per sequence).
    meta: the setting as named integers (e.g. ``{"seq_len": 64, "kv_pairs": 4}``); every example
        of a batch carries them, so metrics can be sliced by any of them.
    extras: per-example tensors, each [N, ...] (e.g. ``lengths`` [N] of right-padded inputs).
    """

    name: str
    inputs: Tensor
    labels: Tensor
    meta: dict[str, int]
    extras: dict[str, Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        reserved = {"input_ids", "labels", "segment", *self.meta}
        for key, value in self.extras.items():
            if (
                key in reserved
                or not isinstance(value, Tensor)
                or value.dim() < 1
                or value.shape[0] != self.inputs.shape[0]
            ):
                raise ValueError(
                    f"segment {self.name!r}: extra {key!r} must be a tensor [N={self.inputs.shape[0]}, ...] "
                    f"under a name other than {sorted(reserved)}, got "
                    f"{list(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
                )
        per_token = self.labels.dim() == 2 and self.labels.shape == self.inputs.shape[:2]
        per_sequence = self.labels.dim() == 1 and self.labels.shape[0] == self.inputs.shape[0]
        if self.inputs.dim() < 2 or not (per_token or per_sequence):
            raise ValueError(
                f"segment {self.name!r}: expected inputs [N, T, ...] with labels [N, T] (per token) or [N] "
                f"(per sequence), got {list(self.inputs.shape)} and {list(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.inputs.shape[0]


class SegmentedDataset(Dataset):
    """The examples of one split: its segments one after the other (global index = offset + row)."""

    def __init__(self, segments: Sequence[Segment]):
        if not segments:
            raise ValueError("segments: expected at least one segment, got none")
        names = [s.name for s in segments]
        if len(set(names)) != len(names):
            raise ValueError(f"segments: names must be unique, got {names}")
        self.segments: list[Segment] = list(segments)
        self.offsets: list[int] = []
        total = 0
        for s in self.segments:
            self.offsets.append(total)
            total += len(s)
        self._len = total

    def __len__(self) -> int:
        return self._len

    def locate(self, index: int) -> tuple[int, int]:
        """Global example index -> (segment index, row in that segment)."""
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for a dataset of {self._len} examples")
        seg = bisect.bisect_right(self.offsets, index) - 1
        return seg, index - self.offsets[seg]

    def __getitem__(self, index: int) -> dict[str, object]:
        seg, row = self.locate(index)
        s = self.segments[seg]
        x = s.inputs[row]
        extras = {k: (v[row] if v[row].is_floating_point() else v[row].long()) for k, v in s.extras.items()}
        return {
            "input_ids": x if x.is_floating_point() else x.long(),
            "labels": s.labels[row].long(),
            "segment": s.name,
            **s.meta,
            **extras,
        }

    def __getitems__(self, indices: Sequence[int]) -> dict[str, object]:
        """The batch of ``indices`` (all from one segment), gathered at once: what ``loader`` and
        the training engine yield (``DataLoader`` calls this instead of one ``__getitem__`` each)."""
        seg_index, _ = self.locate(int(indices[0]))
        s = self.segments[seg_index]
        rows = torch.as_tensor(indices, dtype=torch.long) - self.offsets[seg_index]
        if bool((rows < 0).any()) or bool((rows >= len(s)).any()):
            raise ValueError(f"indices: a batch must come from one segment ({s.name!r}), got {list(indices)[:8]}...")

        def widen(t: Tensor) -> Tensor:
            return t if t.is_floating_point() else t.long()

        batch: dict[str, object] = {
            "input_ids": widen(s.inputs[rows]),
            "labels": s.labels[rows].long(),
            "segment": [s.name] * len(rows),
        }
        batch.update({k: torch.full((len(rows),), v, dtype=torch.long) for k, v in s.meta.items()})
        batch.update({k: widen(v[rows]) for k, v in s.extras.items()})
        return batch

    def segment_sizes(self) -> dict[str, int]:
        return {s.name: len(s) for s in self.segments}

    def loader(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        **dataloader_options,
    ) -> DataLoader:
        """A DataLoader whose batches each come from one segment (see ``SegmentBatchSampler``)."""
        sampler = SegmentBatchSampler(self, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        return DataLoader(self, batch_sampler=sampler, collate_fn=_as_is, **dataloader_options)


def _as_is(batch):
    """``collate_fn`` of the loaders: ``__getitems__`` already returns a batch."""
    return batch


class SegmentBatchSampler(Sampler[list[int]]):
    """Batches of global indices, each batch inside one segment (so examples stack without padding).

    Without shuffling: segments in order, rows in order. With shuffling: rows are permuted within
    each segment, cut into batches, and the batches of all segments are interleaved in a random
    order, from a torch.Generator seeded with (seed, epoch) so every epoch is reproducible.
    """

    def __init__(
        self,
        dataset: SegmentedDataset,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.dataset = dataset
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.shuffle = check_bool("shuffle", shuffle)
        self.seed = check_int("seed", seed, 0)
        self.drop_last = check_bool("drop_last", drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = check_int("epoch", epoch, 0)

    def batches(self) -> list[list[int]]:
        """Every batch of the current epoch, in order."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        batches = []
        for seg, off in zip(self.dataset.segments, self.dataset.offsets, strict=False):
            n = len(seg)
            order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
            for start in range(0, n, self.batch_size):
                rows = order[start : start + self.batch_size]
                if self.drop_last and len(rows) < self.batch_size:
                    continue
                batches.append((rows + off).tolist())
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=gen).tolist()]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        if self.drop_last:
            return sum(len(s) // self.batch_size for s in self.dataset.segments)
        return sum(-(-len(s) // self.batch_size) for s in self.dataset.segments)


class Uniforms:
    """Uniform [0, 1) numbers drawn from a numpy ``Generator`` in blocks, for generators that make
    many small random choices in Python: one numpy call per block instead of one per choice is
    what keeps them fast. ``below(n)`` is a uniform integer in [0, n)."""

    def __init__(self, rng: np.random.Generator, block: int = 1 << 14):
        self.rng, self.block = rng, block
        self.buf, self.pos = rng.random(block), 0

    def __call__(self) -> float:
        if self.pos == self.block:
            self.buf, self.pos = self.rng.random(self.block), 0
        self.pos += 1
        return float(self.buf[self.pos - 1])

    def below(self, n: int) -> int:
        return int(self() * n)
