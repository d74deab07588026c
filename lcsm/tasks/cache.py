"""The on-disk cache of task data: one file per (task, split, config), written atomically and
checked on reading (its key and a checksum of its contents)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from lcsm._cache import cache_root

from .data import Segment, Tensor

_CACHE_FORMAT = 2


def default_cache_dir() -> Path:
    """``$LCSM_CACHE/tasks`` if ``LCSM_CACHE`` is set, else ``~/.cache/lcsm/tasks``."""
    return cache_root() / "tasks"


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


def save_segments(path: Path, key: str, segments: Sequence[Segment]) -> None:
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


def load_segments(path: Path, key: str) -> list[Segment] | None:
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
