"""Tasks: the interface a training engine sees, and the registry.

A task owns everything about *what* is learned, nothing about the model: its datasets
(deterministic from a seed, cached on disk), its loss, its metrics (with slices) and the head a
model needs to solve it. An engine uses any registered task the same way::

    task = tasks.build("mqar", train_examples=2000)
    train, test = task.dataset("train"), task.dataset("test")
    model = ...  # a `task.default_head` model over `task.vocab_size` tokens, up to `task.max_len`
    for batch in train.loader(batch_size=64, shuffle=True, seed=0, epoch=epoch):
        loss = task.loss(task.logits(model, batch), batch["labels"])  # the batch's lengths etc. too
    evaluator = task.evaluator()
    for batch in test.loader(batch_size=64):
        evaluator.update(task.logits(model, batch), batch["labels"], batch)
    metrics = evaluator.compute()   # {"loss", "accuracy", "accuracy/<segment>", ...}

The data layout is described in ``data``, the cache in ``cache``, the metrics in ``metrics``.

Shape glossary: B batch, T sequence length (input tokens), V vocabulary size.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lcsm._checks import check_bool
from lcsm._files import os_error_cause

from .cache import compact, default_cache_dir, files_fingerprint, load_segments, save_segments
from .config import TaskConfig
from .data import IGNORE_INDEX, Segment, SegmentedDataset, Tensor
from .metrics import Evaluator


class Task:
    """Base class of tasks. Subclasses set ``Config`` (a ``TaskConfig`` dataclass),
    ``default_head``, ``generator_version`` and implement ``generate(split)``,
    ``config_model_fields``, ``max_len`` and ``describe``.

    ``generator_version`` is part of the cache key: bump it whenever ``generate`` changes the data
    it makes for an unchanged config, so stale cache files are not reused.
    """

    registry_name: str = ""
    Config: type[TaskConfig] = TaskConfig
    default_head: str = ""  # an lcsm.models head: "lm" (next-token logits), "classifier" or "dual"
    splits: tuple[str, ...] = ("train", "test")
    slice_keys: tuple[str, ...] = ()
    generator_version: int = 1
    # Consecutive test examples that ``lcsm.engine.stats`` resamples together: 1 where examples are
    # drawn independently of each other; more where they are windows of one stream, in order, and
    # neighbours share a document (``stats.Examples.block``).
    example_block: int = 1

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
    @classmethod
    def config_model_fields(cls, config: TaskConfig) -> dict[str, object]:
        """The ``lcsm.models.ModelConfig`` fields the task fixes, from its ``config`` alone: the
        input kind (``vocab_size`` or ``input_dim``), the head's fields as a mapping (``{"head":
        {"kind": ..., "n_classes": ...}}``) and any other field its data needs. A run config is
        checked against them before the task is built, so they are read off the config without
        reading any data. Where the data decides a value, the one the task is made to have stands
        in (an LM's ``bpe_vocab`` for its trained vocabulary, the fetched source's classes for a
        corpus's); ``model_fields`` has the data's own."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int | None:
        """Token vocabulary (None: continuous inputs, see ``input_dim``)."""
        return self.config_model_fields(self.config).get("vocab_size")

    @property
    def max_len(self) -> int:
        """Longest input sequence of any split (for models with learned position embeddings)."""
        raise NotImplementedError

    @property
    def n_classes(self) -> int | None:
        """Classes of a "classifier" or "dual" task (None for "lm" tasks)."""
        return self.config_model_fields(self.config)["head"].get("n_classes")

    @property
    def input_dim(self) -> int | None:
        """Features per step of a task with continuous inputs [T, C] (None: token ids)."""
        return self.config_model_fields(self.config).get("input_dim")

    def model_fields(self) -> dict[str, object]:
        """The ``lcsm.models.ModelConfig`` fields the built task fixes (the engine fills them in):
        ``config_model_fields``, with ``vocab_size``, ``input_dim`` and ``head.n_classes`` read from
        the task's properties, which a task whose data decides one overrides (an LM's trained
        vocabulary, a corpus's classes)."""
        fields = self.config_model_fields(self.config)
        for key in ("vocab_size", "input_dim"):
            if key in fields:
                fields[key] = getattr(self, key)
        if "n_classes" in fields["head"]:
            fields["head"] = {**fields["head"], "n_classes": self.n_classes}
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
            **self.cache_fields(split),
        }
        sources = self.local_sources()
        if sources:
            key["sources"] = files_fingerprint(sources)
        blob = json.dumps(key, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def cache_fields(self, split: str) -> dict[str, object]:
        """Further fields of ``cache_key``: a generator that changed the data of some settings only
        names them here, leaving the other settings' caches valid (a bumped ``generator_version``
        would invalidate all of them)."""
        return {}

    def cache_path(self, split: str) -> Path:
        return self.cache_dir / (self.registry_name or type(self).__name__) / f"{split}-{self.cache_key(split)}.pt"

    def cached(self, split: str) -> bool:
        """Whether ``dataset(split)`` reads its data (memoised or from the cache) rather than
        generating it."""
        self._check_split(split)
        return split in self._datasets or (self.use_cache and self.cache_path(split).exists())

    def dataset(self, split: str) -> SegmentedDataset:
        """The examples of ``split``: generated once, then read from the cache (and memoised)."""
        self._check_split(split)
        if split not in self._datasets:
            segments = None
            if self.use_cache:
                segments = load_segments(self.cache_path(split), self.cache_key(split))
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
                    self._cache(split, segments)
            self._datasets[split] = SegmentedDataset(segments)
        return self._datasets[split]

    def _cache(self, split: str, segments: Sequence[Segment]) -> None:
        """Keep the data made for ``split`` for next time. A cache that cannot take it (a full or
        read-only disk, often another than the run's) costs the next run the time to make it again,
        not this run, which has the data: a warning."""
        path = self.cache_path(split)
        try:
            save_segments(path, self.cache_key(split), segments)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            first = (str(err).splitlines() or [type(err).__name__])[0]
            cause = os_error_cause(err) if isinstance(err, OSError) else first
            warnings.warn(
                f"task data not cached at {path} ({cause}); it is made again next time", RuntimeWarning, stacklevel=3
            )

    def logits(self, model, batch: Mapping[str, object]) -> Tensor:
        """Run ``model`` (an ``lcsm.models`` model with head ``default_head``) on a batch: "lm"
        gets the ids, as one packed row of documents when the batch carries ``document_starts``
        (``packed_cu_seqlens``); "classifier" the inputs and their ``lengths`` if the batch has them; "dual"
        both sequences (``input_ids``/``input_ids2``) and their lengths."""
        head = self.default_head
        if head == "lm":
            if "document_starts" in batch:
                ids = batch["input_ids"]
                cu_seqlens = packed_cu_seqlens(batch["document_starts"], ids)
                return model(ids.reshape(1, -1), cu_seqlens=cu_seqlens).reshape(*ids.shape, -1)
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

    @classmethod
    def evaluator(cls) -> Evaluator:
        """A fresh evaluator (a class method: a run config's metric names are checked without
        building the task)."""
        return Evaluator(cls.slice_keys)

    def metrics(
        self, logits: Tensor, labels: Tensor, batch_meta: Mapping[str, object] | None = None
    ) -> dict[str, float]:
        """Metrics of one batch (see ``Evaluator``; use ``evaluator()`` to accumulate over many)."""
        ev = self.evaluator()
        ev.update(logits, labels, batch_meta)
        return ev.compute()


def packed_cu_seqlens(document_starts: Tensor, input_ids: Tensor) -> Tensor:
    """The ``cu_seqlens`` [N + 1] (int32) of a batch of packed rows run as one row [1, B*T]:
    document_starts [B, T] is 1 where a document begins; every row's first token begins one, so no
    document runs from one row into the next."""
    if document_starts.shape != input_ids.shape or input_ids.dim() != 2:
        raise ValueError(
            f"document_starts: expected the shape of input_ids [B, T] = {list(input_ids.shape)}, "
            f"got {list(document_starts.shape)}"
        )
    starts = document_starts != 0
    starts[:, 0] = True
    begins = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([begins, begins.new_tensor([starts.numel()])]).to(torch.int32)


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
# result.json): what a run without that record trained on. It stays as long as such runs are
# kept: most committed results under results/ and their checkpoints predate the
# record, and without it sweeps would rerun them and resume would refuse them as trained on other data.
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


def config_model_fields(name: str, **options) -> dict[str, object]:
    """The model fields task ``name`` fixes with ``options`` (see ``Task.config_model_fields``):
    the options are checked as ``build`` checks them, but no task is built and no data read."""
    cls = resolve(name)
    return cls.config_model_fields(cls.Config.from_options(name, **options))


def build(name: str, *, cache_dir: str | Path | None = None, use_cache: bool = True, **options) -> Task:
    """Build a registered task from its options (the fields of its ``Config``); unknown options
    fail with the valid ones listed. ``cache_dir``/``use_cache`` say where (whether) its data is
    cached; they do not change the data."""
    cls = resolve(name)
    return cls(cls.Config.from_options(name, **options), cache_dir=cache_dir, use_cache=use_cache)
