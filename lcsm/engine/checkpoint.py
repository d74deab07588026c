"""Checkpoints: one directory per save, written whole or not at all.

    <out_dir>/checkpoints/step-00000200/
        model.safetensors   the weights (tied matrices stored once)
        trainer.pt          optimizer, scheduler, every process's RNG state, loop position
        run.json            the run config, the model config, step, versions, the metrics of the
                            last evaluation before it (a run's final one comes after its final checkpoint)
    <out_dir>/checkpoints/best/        the same, for the best evaluation so far

A checkpoint is written into a hidden temporary directory next to its final place, every file
flushed to disk, then renamed into place: a reader (or a resumed run after SIGKILL) sees a
complete checkpoint or none. Directory renames are atomic on POSIX file systems.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

CHECKPOINTS = "checkpoints"
BEST = "best"
_STEP = re.compile(r"^step-(\d{8})$")


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints of a run, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed away first, so no half-deleted directory keeps a
    checkpoint's name."""
    doomed = path.with_name(f".del-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_checkpoint(
    out_dir: str | Path, name: str, model: torch.nn.Module, trainer: dict[str, Any], info: dict[str, Any]
) -> Path:
    """Write checkpoint ``name`` ("step-00000200" or "best") atomically; an existing one of that name
    is replaced."""
    root = checkpoint_dir(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "lcsm", "step": str(info.get("step"))})
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        final = root / name
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune(out_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step checkpoints, and leftovers of interrupted writes."""
    for _, path in list_checkpoints(out_dir)[:-keep_last]:
        _remove(path)
    root = checkpoint_dir(out_dir)
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".del-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_checkpoint(path: str | Path, which: str = "last") -> Path:
    """A checkpoint directory from a checkpoint directory or a run directory (its newest step
    checkpoint, or its ``best`` one with ``which="best"``)."""
    path = Path(path)
    if (path / "run.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if not path.exists():
        raise ValueError(f"checkpoint: no such file or directory {str(path)!r}")
    if which == "best":
        best = checkpoint_dir(path) / BEST
        if not best.is_dir():
            raise ValueError(
                f"checkpoint: run {str(path)!r} has no best checkpoint ({best} missing; "
                "a run saves one at each evaluation that improves its early-stop metric)"
            )
        return best
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(
            f"checkpoint: {str(path)!r} is neither a checkpoint directory (run.json + "
            f"model.safetensors) nor a run directory with checkpoints under {CHECKPOINTS}/"
        )
    return latest


def read_info(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "run.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {str(checkpoint)!r}: unreadable run.json ({err})") from None


def load_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load ``model.safetensors`` into ``model`` (every tensor must match by name and shape)."""
    try:
        missing, unexpected = load_model(model, str(checkpoint / "model.safetensors"), strict=False)
    except RuntimeError as err:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: weights do not fit the model its run.json "
            f"describes ({str(err).splitlines()[0]})"
        ) from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: weights do not fit the model (missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )


def load_trainer(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
