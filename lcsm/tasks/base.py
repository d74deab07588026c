"""Tasks: the interface a training engine sees, the on-disk dataset cache and the registry.

A task owns everything about *what* is learned, nothing about the model: its datasets
(deterministic from a seed, cached on disk), its loss, its metrics (with slices) and the head a
model needs to solve it. An engine uses any registered task the same way::

    task = tasks.build("mqar", train_examples=2000)
    train, test = task.dataset("train"), task.dataset("test")
    model = ...  # a `task.default_head` model over `task.vocab_size` tokens, up to `task.max_len`
    for batch in train.loader(batch_size=64, shuffle=True, seed=0, epoch=epoch):
        loss = task.loss(model(batch["input_ids"]), batch["labels"])
    evaluator = task.evaluator()
    for batch in test.loader(batch_size=64):
        evaluator.update(model(batch["input_ids"]), batch["labels"], batch)
    metrics = evaluator.compute()   # {"loss", "accuracy", "accuracy/<segment>", ...}

Data layout. A split is a list of *segments*, each a block of equal-length examples generated
with one setting (for MQAR one (seq_len, kv_pairs) pair). Examples of different segments may have
different lengths, so a batch never mixes segments (``SegmentBatchSampler``) and nothing is padded.
Each example is a dict ``{"input_ids": [T], "labels": [T], "segment": name, <meta key>: int,
<extra key>: tensor}`` (ids and labels int64); a batch stacks them (``input_ids``/``labels``
[B, T], ``segment`` a list of B names, each meta key a [B] tensor, each extra [B, ...]). Labels
are -100 (``IGNORE_INDEX``) at positions that carry no target. Extras carry per-example tensors a
head needs: ``lengths`` (valid tokens of right-padded inputs), ``input_ids2``/``lengths2`` (the
second sequence of a dual task); ``Task.logits`` feeds them to the model.

Shape glossary: B batch, T sequence length (input tokens), V vocabulary size, N examples.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from lcsm._checks import check_bool, check_int, check_keys

Tensor = torch.Tensor

IGNORE_INDEX = -100
"""Label of positions that carry no target (PyTorch's cross-entropy default, as in Zoology)."""

_CACHE_FORMAT = 2


def default_cache_dir() -> Path:
    """``$LCSM_CACHE/tasks`` if ``LCSM_CACHE`` is set, else ``~/.cache/lcsm/tasks``."""
    root = os.environ.get("LCSM_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "lcsm") / "tasks"


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TaskConfig:
    """Base of every task's typed configuration: a frozen dataclass validated on construction.

    Subclasses declare their fields with defaults and check them in ``__post_init__``; the fields
    are exactly the options ``build`` accepts, and all of them together determine the data (the
    cache key hashes them).
    """

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls, task_name: str, **options) -> TaskConfig:
        """Build from keyword options; unknown names fail with the closest valid ones."""
        check_keys(f"task {task_name!r}", options, cls.option_names(), kind="option")
        return cls(**options)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready view (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


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


# ----------------------------------------------------------------------------- data


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


# ----------------------------------------------------------------------------- cache


def compact(t: Tensor) -> Tensor:
    """The smallest of int16 / int32 / int64 that holds ``t`` exactly: token ids stay compact in
    memory and on disk (MQAR at the paper's sizes: 0.4 GB instead of 1.5 GB); batches are int64."""
    if t.numel() == 0 or t.is_floating_point() or t.is_complex():
        return t
    lo, hi = int(t.min()), int(t.max())
    for dtype in (torch.int16, torch.int32):
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return t.to(dtype)
    return t.to(torch.int64)


def files_fingerprint(paths: Sequence[Path]) -> str:
    """Hash of the name, size and modification time of every file at ``paths`` (a file, or a
    directory walked recursively; a missing path counts as missing): a local corpus edited by
    hand changes it, while reading no file contents."""
    entries = []
    for path in paths:
        files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
        entries += [[str(f), f.stat().st_size, f.stat().st_mtime_ns] if f.exists() else [str(f), None] for f in files]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def _digest(segments: Sequence[Segment]) -> str:
    h = hashlib.sha256()
    for s in segments:
        head = [s.name, s.meta, list(s.inputs.shape), str(s.inputs.dtype), list(s.labels.shape), str(s.labels.dtype)]
        h.update(json.dumps(head, sort_keys=True).encode())
        h.update(s.inputs.contiguous().numpy())
        h.update(s.labels.contiguous().numpy())
        for key in sorted(s.extras):
            h.update(json.dumps([key, list(s.extras[key].shape), str(s.extras[key].dtype)]).encode())
            h.update(s.extras[key].contiguous().numpy())
    return h.hexdigest()


def _save(path: Path, key: str, segments: Sequence[Segment]) -> None:
    """Write atomically: a temporary file in the same directory, fsync, then rename over ``path``
    (a reader never sees a partial file; concurrent writers of one key leave one whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": _CACHE_FORMAT,
        "key": key,
        "digest": _digest(segments),
        "segments": [
            {"name": s.name, "meta": dict(s.meta), "inputs": s.inputs, "labels": s.labels, "extras": dict(s.extras)}
            for s in segments
        ],
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load(path: Path, key: str) -> list[Segment] | None:
    """The cached segments, or None if the file is absent. A file that cannot be read, belongs to
    another key or fails its checksum is reported with a warning and treated as absent."""
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _CACHE_FORMAT:
            raise ValueError("unknown cache format")
        if payload.get("key") != key:
            raise ValueError("cache key mismatch")
        segments = [
            Segment(d["name"], d["inputs"], d["labels"], dict(d["meta"]), dict(d["extras"]))
            for d in payload["segments"]
        ]
        if _digest(segments) != payload.get("digest"):
            raise ValueError("checksum mismatch")
    except Exception as exc:  # any unreadable or inconsistent file is regenerated, never trusted
        warnings.warn(
            f"ignoring corrupt task cache file {path} ({type(exc).__name__}: {exc}); regenerating it",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return segments


# ----------------------------------------------------------------------------- metrics


class Evaluator:
    """Streams metrics over batches: ``update`` per batch, ``compute`` once at the end.

    - ``loss``: cross-entropy averaged over every labelled position seen (token mean, as
      ``Task.loss``).
    - ``accuracy``: mean over examples of each example's accuracy over its labelled positions
      (Zoology's ``compute_metrics``: a per-example mean, then the mean of those). Examples with
      no labelled position have no accuracy and are not counted.
    - ``accuracy/<segment>``: the same mean restricted to one segment, for every segment seen.
    - ``accuracy/<key>=<value>``: the same mean per value of each of ``slice_keys`` (batch meta).
    """

    def __init__(self, slice_keys: Sequence[str] = ()):
        self.slice_keys = tuple(slice_keys)
        self._loss_sum = 0.0
        self._tokens = 0
        self._acc: dict[str, list[float]] = {}  # metric key -> [sum of example accuracies, examples]

    def _add(self, key: str, acc_sum: float, count: int) -> None:
        slot = self._acc.setdefault(key, [0.0, 0])
        slot[0] += acc_sum
        slot[1] += count

    @torch.no_grad()
    def update(self, logits: Tensor, labels: Tensor, batch_meta: Mapping[str, object] | None = None) -> None:
        """logits [B, T, V] (or [B, V]), labels [B, T] (or [B]); batch_meta: the batch dict (its
        ``"segment"`` names and slice keys; None gives the overall metrics only)."""
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"logits/labels: expected logits [*labels.shape, V], got {list(logits.shape)} "
                f"and labels {list(labels.shape)}"
            )
        logits = logits.detach()
        labels = labels.to(logits.device)
        mask = labels != IGNORE_INDEX
        n_tok = int(mask.sum())
        if n_tok:
            self._loss_sum += float(F.cross_entropy(logits[mask].float(), labels[mask], reduction="sum"))
            self._tokens += n_tok
        counts = mask.reshape(mask.shape[0], -1).sum(1)
        correct = ((logits.argmax(-1) == labels) & mask).reshape(mask.shape[0], -1).sum(1)
        has = (counts > 0).cpu().tolist()
        acc = (correct.double() / counts.clamp(min=1).double()).cpu().tolist()
        groups: dict[str, list[int]] = {"accuracy": list(range(len(acc)))}
        if batch_meta is not None and "segment" in batch_meta:
            for i, name in enumerate(batch_meta["segment"]):
                groups.setdefault(f"accuracy/{name}", []).append(i)
        for key in self.slice_keys if batch_meta is not None else ():
            if key not in batch_meta:
                raise ValueError(
                    f"batch_meta: expected slice key {key!r} (per-example values), got keys {sorted(batch_meta)}"
                )
            for i, value in enumerate(torch.as_tensor(batch_meta[key]).tolist()):
                groups.setdefault(f"accuracy/{key}={value}", []).append(i)
        for key, rows in groups.items():
            rows = [i for i in rows if has[i]]
            self._add(key, sum(acc[i] for i in rows), len(rows))

    def metric_names(self, dataset: SegmentedDataset | None = None) -> list[str]:
        """The keys ``compute`` gives after an evaluation of ``dataset``, read off its segments
        without evaluating anything (an engine checks the metric it selects on before training).
        Without ``dataset``: the names any data gives, those without a '/'; the names with one
        belong to the segments and slices of the data."""
        names = ["loss", "accuracy"]
        if dataset is not None:
            names += [f"accuracy/{s.name}" for s in dataset.segments]
            names += [f"accuracy/{key}" for key in self._slice_values(dataset)]
        return names

    def _slice_values(self, dataset: SegmentedDataset) -> list[str]:
        """``"<key>=<value>"`` for every value each slice key takes in ``dataset``, written as
        ``update`` writes it (a batch holds meta values as int64, extras widened to int64)."""
        found: dict[str, None] = {}
        for s in dataset.segments:
            for key in self.slice_keys:
                if key in s.meta:
                    values = torch.tensor([s.meta[key]], dtype=torch.long)
                elif key in s.extras:
                    values = s.extras[key] if s.extras[key].is_floating_point() else s.extras[key].long()
                else:
                    raise ValueError(
                        f"segment {s.name!r}: expected slice key {key!r} among its meta and extras, "
                        f"got {sorted([*s.meta, *s.extras])}"
                    )
                found.update(dict.fromkeys(f"{key}={v}" for v in values.tolist()))
        return list(found)

    def compute(self) -> dict[str, float]:
        out = {"loss": self._loss_sum / self._tokens if self._tokens else float("nan")}
        for key, (s, n) in self._acc.items():
            out[key] = s / n if n else float("nan")
        return out


# ----------------------------------------------------------------------------- task


class Task:
    """Base class of tasks. Subclasses set ``Config`` (a ``TaskConfig`` dataclass),
    ``default_head``, ``generator_version`` and implement ``generate(split)``, ``vocab_size``,
    ``max_len`` and ``describe``.

    ``generator_version`` is part of the cache key: bump it whenever ``generate`` changes the data
    it makes for an unchanged config, so stale cache files are not reused.
    """

    registry_name: str = ""
    Config: type[TaskConfig] = TaskConfig
    default_head: str = ""  # an lcsm.models head: "lm" (next-token logits), "classifier" or "dual"
    splits: tuple[str, ...] = ("train", "test")
    slice_keys: tuple[str, ...] = ()
    generator_version: int = 1

    def __init__(
        self, config: TaskConfig | None = None, *, cache_dir: str | Path | None = None, use_cache: bool = True
    ):
        if config is None:
            config = self.Config()
        if not isinstance(config, self.Config):
            raise ValueError(f"config: expected a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self.use_cache = check_bool("use_cache", use_cache)
        self._datasets: dict[str, SegmentedDataset] = {}

    # --- what subclasses provide
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def max_len(self) -> int:
        """Longest input sequence of any split (for models with learned position embeddings)."""
        raise NotImplementedError

    @property
    def n_classes(self) -> int | None:
        """Classes of a "classifier" or "dual" task (None for "lm" tasks)."""
        return None

    @property
    def input_dim(self) -> int | None:
        """Features per step of a task with continuous inputs [T, C] (None: token ids)."""
        return None

    def model_fields(self) -> dict[str, object]:
        """The ``lcsm.models.ModelConfig`` fields the task's data fixes: the head, the input kind
        (``vocab_size`` or ``input_dim``) and ``n_classes``. The engine fills them in."""
        fields: dict[str, object] = {"head": self.default_head}
        if self.input_dim is not None:
            fields["input_dim"] = self.input_dim
        else:
            fields["vocab_size"] = self.vocab_size
        if self.default_head != "lm":
            fields["n_classes"] = self.n_classes
        return fields

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (tasks over text override this and ``decode``)."""
        raise NotImplementedError(f"task {self.registry_name!r} has no text tokenizer; give token ids instead")

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError(f"task {self.registry_name!r} has no text tokenizer")

    def generate(self, split: str) -> list[Segment]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def local_sources(self) -> list[Path]:
        """Files or directories the data is read from that no version pins (a user's
        ``data_dir`` or ``path:`` corpus; the registry's fetched packages are versioned)."""
        return []

    # --- shared machinery
    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise ValueError(f"split: expected one of {', '.join(self.splits)}, got {split!r}")

    def cache_key(self, split: str) -> str:
        """Hash of everything that determines the data of ``split``: task, generator version,
        config and, for local sources, their ``files_fingerprint``."""
        self._check_split(split)
        key = {
            "task": self.registry_name,
            "generator_version": self.generator_version,
            "split": split,
            "config": self.config.to_dict(),
        }
        sources = self.local_sources()
        if sources:
            key["sources"] = files_fingerprint(sources)
        blob = json.dumps(key, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def cache_path(self, split: str) -> Path:
        return self.cache_dir / (self.registry_name or type(self).__name__) / f"{split}-{self.cache_key(split)}.pt"

    def dataset(self, split: str) -> SegmentedDataset:
        """The examples of ``split``: generated once, then read from the cache (and memoised)."""
        self._check_split(split)
        if split not in self._datasets:
            segments = None
            if self.use_cache:
                segments = _load(self.cache_path(split), self.cache_key(split))
            if segments is None:
                segments = [
                    dataclasses.replace(
                        s,
                        inputs=compact(s.inputs),
                        labels=compact(s.labels),
                        extras={k: compact(v) for k, v in s.extras.items()},
                    )
                    for s in self.generate(split)
                ]
                if self.use_cache:
                    _save(self.cache_path(split), self.cache_key(split), segments)
            self._datasets[split] = SegmentedDataset(segments)
        return self._datasets[split]

    def logits(self, model, batch: Mapping[str, object]) -> Tensor:
        """Run ``model`` (an ``lcsm.models`` model with head ``default_head``) on a batch: "lm"
        gets the ids; "classifier" the inputs and their ``lengths`` if the batch has them; "dual"
        both sequences (``input_ids``/``input_ids2``) and their lengths."""
        head = self.default_head
        if head == "lm":
            return model(batch["input_ids"])
        if head == "classifier":
            return model(batch["input_ids"], lengths=batch.get("lengths"))
        if head == "dual":
            return model(
                batch["input_ids"], batch["input_ids2"], lengths1=batch.get("lengths"), lengths2=batch.get("lengths2")
            )
        raise ValueError(f"default_head: expected 'lm', 'classifier' or 'dual', got {head!r}")

    def loss(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """Cross-entropy over labelled positions (labels != -100), computed in float32: their mean
        (``reduction="mean"``) or their sum (``"sum"``, for an engine that normalises by the
        labelled positions of a whole accumulated / distributed batch).

        logits [B, T, V] (or [B, V]); labels [B, T] (or [B]). A batch with no labelled position
        has no defined mean loss (NaN), as with ``torch.nn.CrossEntropyLoss``.
        """
        if logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"logits/labels: expected logits [*labels.shape, V], got {list(logits.shape)} "
                f"and labels {list(labels.shape)}"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )

    def evaluator(self) -> Evaluator:
        return Evaluator(self.slice_keys)

    def metrics(
        self, logits: Tensor, labels: Tensor, batch_meta: Mapping[str, object] | None = None
    ) -> dict[str, float]:
        """Metrics of one batch (see ``Evaluator``; use ``evaluator()`` to accumulate over many)."""
        ev = self.evaluator()
        ev.update(logits, labels, batch_meta)
        return ev.compute()


# ----------------------------------------------------------------------------- registry

_REGISTRY: dict[str, type[Task]] = {}


def register(name: str):
    """Class decorator: ``@register("mqar")``."""

    def deco(cls: type[Task]) -> type[Task]:
        if name in _REGISTRY:
            raise ValueError(f"task name {name!r} registered twice")
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"@register({name!r}): expected a Task subclass, got {cls!r}")
        _REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return deco


def available() -> list[str]:
    """Sorted names of the registered tasks."""
    return sorted(_REGISTRY)


def resolve(name: str) -> type[Task]:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a task name (str), got {type(name).__name__}")
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, available(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown task {name!r}.{hint} Valid names: {', '.join(available())}")
    return _REGISTRY[name]


# Each task's generator version before runs recorded theirs (``task_data`` in checkpoints and
# result.json, from commit 6ef4f9e): what a run without that record trained on.
VERSIONS_BEFORE_RECORDS = {
    "bbc_news": 2,
    "image": 1,
    "listops": 1,
    "lm": 2,
    "mad_compression": 1,
    "mad_fuzzy_recall": 1,
    "mad_in_context_recall": 1,
    "mad_memorization": 2,
    "mad_noisy_recall": 1,
    "mad_selective_copying": 1,
    "mqar": 1,
    "niah": 1,
    "pathfinder": 1,
    "retrieval": 2,
    "rotten_tomatoes": 2,
    "spam": 2,
    "text": 2,
}


def task_data(name: str) -> dict[str, Any]:
    """The data this lcsm makes for task ``name`` beyond its options: the task's generator version."""
    return {"task": name, "generator_version": resolve(name).generator_version}


def recorded_task_data(record: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The task data that a checkpoint's info or a ``result.json`` says its run trained on; for a
    record from before runs recorded it, the task's generator version of that time."""
    if "task_data" in record:
        return record["task_data"]
    return {"task": name, "generator_version": VERSIONS_BEFORE_RECORDS.get(name, resolve(name).generator_version)}


def build(name: str, *, cache_dir: str | Path | None = None, use_cache: bool = True, **options) -> Task:
    """Build a registered task from its options (the fields of its ``Config``); unknown options
    fail with the valid ones listed. ``cache_dir``/``use_cache`` say where (whether) its data is
    cached; they do not change the data."""
    cls = resolve(name)
    return cls(cls.Config.from_options(name, **options), cache_dir=cache_dir, use_cache=use_cache)
