"""Task metrics: the evaluator that streams loss and accuracy (overall, per segment, per slice)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, SegmentedDataset, Tensor


class Evaluator:
    """Streams metrics over batches: ``update`` per batch, ``compute`` once at the end.

    - ``loss``: cross-entropy averaged over every labelled position seen (token mean, as
      ``Task.loss``).
    - ``accuracy``: mean over examples of each example's accuracy over its labelled positions
      (Zoology's ``compute_metrics``: a per-example mean, then the mean of those). Examples with
      no labelled position have no accuracy and are not counted.
    - ``accuracy/<segment>``: the same mean restricted to one segment, for every segment seen.
    - ``accuracy/<key>=<value>``: the same mean per value of each of ``slice_keys`` (batch meta).

    ``examples()`` gives every example seen, in order: its segment, labelled positions, correct
    predictions and summed loss, which the metrics above are means of (a run writes its test
    examples, ``lcsm.engine.stats`` resamples them for intervals).
    """

    def __init__(self, slice_keys: Sequence[str] = ()):
        self.slice_keys = tuple(slice_keys)
        self._loss_sum = 0.0
        self._tokens = 0
        self._acc: dict[str, list[float]] = {}  # metric key -> [sum of example accuracies, examples]
        self._examples: dict[str, list] = {"segment": [], "total": [], "correct": [], "loss": []}

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
        token_loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).reshape(mask.shape[0], -1)
        example_loss = token_loss.double().sum(1)
        if n_tok:
            self._loss_sum += float(F.cross_entropy(logits[mask].float(), labels[mask], reduction="sum"))
            self._tokens += n_tok
        counts = mask.reshape(mask.shape[0], -1).sum(1)
        correct = ((logits.argmax(-1) == labels) & mask).reshape(mask.shape[0], -1).sum(1)
        segments = batch_meta.get("segment") if batch_meta is not None else None
        self._examples["segment"] += list(segments) if segments is not None else [""] * len(counts)
        self._examples["total"] += counts.cpu().tolist()
        self._examples["correct"] += correct.cpu().tolist()
        self._examples["loss"] += example_loss.cpu().tolist()
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

    def examples(self) -> dict[str, list]:
        """Per example seen, in order: ``segment`` (its name, "" without batch meta), ``total``
        (labelled positions), ``correct`` (of those) and ``loss`` (cross-entropy summed over them)."""
        return {key: list(values) for key, values in self._examples.items()}

    def compute(self) -> dict[str, float]:
        out = {"loss": self._loss_sum / self._tokens if self._tokens else float("nan")}
        for key, (s, n) in self._acc.items():
            out[key] = s / n if n else float("nan")
        return out
