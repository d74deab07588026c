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

Files damaged afterwards (a disk error, a copy cut short, a file deleted by hand) are found by
``damage`` without loading them whole; resume, ``lcsm eval`` and ``lcsm generate`` then take the
newest intact checkpoint and say which one they passed over (``latest_checkpoint``).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_model, save_model

from .lock import environment_error
from .monitor import json_safe

CHECKPOINTS = "checkpoints"
BEST = "best"
_STEP = re.compile(r"^step-(\d{8})$")
FILES = ("model.safetensors", "trainer.pt", "run.json")


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files are missing, empty, cut off or unreadable; ``problem``: what is
    wrong, without the checkpoint's name."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem or message


def warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / CHECKPOINTS


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete step checkpoints of a run, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found)


def damage(checkpoint: Path, *, trainer: bool = True) -> str | None:
    """What is wrong with the files of ``checkpoint`` (None: nothing found), cheaply: every file
    present and not empty, run.json parsed, the safetensors header read (it must cover the whole
    file: a cut-off file fails), trainer.pt's zip directory (at its end) found. ``trainer=False``:
    the weights alone (evaluation and generation do not read trainer.pt)."""
    for name in FILES:
        if name == "trainer.pt" and not trainer:
            continue
        f = checkpoint / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size == 0:
            return f"{name} is empty"
    try:
        json.loads((checkpoint / "run.json").read_text())
    except (OSError, ValueError) as err:
        return f"run.json is unreadable ({err})"
    try:
        with safe_open(str(checkpoint / "model.safetensors"), "pt"):
            pass
    except (SafetensorError, OSError) as err:
        return f"model.safetensors is unreadable ({str(err).splitlines()[0]})"
    if trainer and not zipfile.is_zipfile(checkpoint / "trainer.pt"):
        return "trainer.pt is cut off or not a torch file"
    return None


def latest_checkpoint(
    out_dir: str | Path,
    *,
    trainer: bool = True,
    note: Callable[[str], None] | None = warn,
    read: Callable[[Path], object] | None = None,
) -> Path | None:
    """The newest intact step checkpoint (``damage``; ``trainer=False``: its weights intact), or
    None when there is none at all. Each newer damaged one is reported through ``note``; damaged
    ones alone raise DamagedCheckpoint. ``read``: a reader run on a checkpoint that passes the
    cheap check (``load_trainer``: damage inside trainer.pt's pickle shows only when it is read),
    whose DamagedCheckpoint passes over the checkpoint as damaged too."""
    passed = []
    for _, path in reversed(list_checkpoints(out_dir)):
        problem = damage(path, trainer=trainer)
        if problem is None and read is not None:
            try:
                read(path)
            except DamagedCheckpoint as err:
                problem = err.problem
        if problem is None:
            if note is not None:
                for older in passed:
                    note(f"warning: checkpoint {older}; using the older {path} instead")
            return path
        passed.append(f"{path} is damaged: {problem}")
    if passed:
        raise DamagedCheckpoint(
            f"checkpoint: no intact checkpoint in {checkpoint_dir(out_dir)} ({'; '.join(passed)}); restore them "
            "from a copy, or, to train the run again from scratch, move them elsewhere (or train with --restart, "
            "which deletes them)"
        )
    return None


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
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    except OSError as err:
        raise environment_error(root, err) from None
    try:
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "lcsm", "step": str(info.get("step"))})
        torch.save(trainer, tmp / "trainer.pt")
        (tmp / "run.json").write_text(json.dumps(json_safe(info), indent=2, sort_keys=True, allow_nan=False))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        final = root / name
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException as err:
        problem = _write_problem(err, root)
        shutil.rmtree(tmp, ignore_errors=True)
        if problem is not None:
            raise environment_error(root / name, problem) from None
        raise
    return final


def _free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def _write_problem(err: BaseException, root: Path) -> OSError | None:
    """The OSError behind a failed checkpoint write, or None for anything else. torch's writer does
    not pass on the OSError of a full disk: it reports a short write (``unexpected pos``, ``file
    write failed``) or its stream's failure (``basic_ios::clear: iostream error``, as the disk
    fills at the archive's end), and safetensors' writer gives the OS error as text."""
    if isinstance(err, OSError):
        return err
    text = str(err)
    short = ("unexpected pos", "file write failed", "iostream error")
    if isinstance(err, RuntimeError) and any(s in text for s in short):
        if _free_bytes(root) < 2**20:
            return OSError(errno.ENOSPC, "disk full")
        return OSError(errno.EIO, f"torch could not write the checkpoint ({text.splitlines()[0]})")
    if isinstance(err, SafetensorError) and "os error" in text:
        full = "os error 28" in text
        return OSError(errno.ENOSPC if full else errno.EIO, "disk full" if full else text.splitlines()[0])
    return None


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
    if any((path / name).is_file() for name in FILES):
        if which == "best":
            raise ValueError(
                f"checkpoint: {str(path)!r} is a checkpoint directory; --best picks a run's best "
                "checkpoint: give the run directory, or leave out --best"
            )
        return _intact(path)
    if not path.exists():
        raise ValueError(f"checkpoint: no such file or directory {str(path)!r}")
    if which == "best":
        best = checkpoint_dir(path) / BEST
        if not best.is_dir():
            raise ValueError(
                f"checkpoint: run {str(path)!r} has no best checkpoint ({best} missing; "
                "a run saves one at each evaluation that improves its early-stop metric)"
            )
        _intact(best, " (leave out --best for the run's newest intact checkpoint)")
        stale = _stale_best(path, best)
        if stale is not None:
            raise ValueError(f"checkpoint: {stale} (leave out --best for the run's newest intact checkpoint)")
        return best
    latest = latest_checkpoint(path, trainer=False)
    if latest is None:
        raise ValueError(
            f"checkpoint: {str(path)!r} is neither a checkpoint directory (run.json + "
            f"model.safetensors) nor a run directory with checkpoints under {CHECKPOINTS}/"
        )
    return latest


def _stale_best(out_dir: Path, best: Path) -> str | None:
    """Why the run's ``best`` checkpoint is not the one its training chose, or None. A run resumed
    from a step checkpoint before ``best`` was written does not repeat its steps bit for bit (another
    machine or thread count), so a ``best`` from the abandoned steps can outlive it: the newest step
    checkpoint after ``best``'s step names the best step of the training that went on (one of the
    same step was written before that step's evaluation, and may not know it yet)."""
    held = read_info(best).get("step")
    try:
        newest = latest_checkpoint(out_dir, trainer=False, note=None)
    except DamagedCheckpoint:  # no intact step checkpoint to tell: the best one is all there is
        return None
    if newest is None or held is None:
        return None
    info = read_info(newest)
    if "best_step" not in info or info.get("step", -1) <= held or info["best_step"] == held:
        return None
    return (
        f"the best checkpoint {str(best)!r} holds step {held}, but the run's best step is "
        f"{info['best_step']} ({newest.name}): it was written by steps a resumed run did not repeat"
    )


def _intact(checkpoint: Path, hint: str = "") -> Path:
    problem = damage(checkpoint, trainer=False)
    if problem is not None:
        raise DamagedCheckpoint(f"checkpoint {str(checkpoint)!r} is damaged: {problem}{hint}")
    return checkpoint


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
    except (SafetensorError, OSError) as err:
        raise DamagedCheckpoint(
            f"checkpoint {str(checkpoint)!r}: model.safetensors is unreadable ({str(err).splitlines()[0]})"
        ) from None
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r}: weights do not fit the model (missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )


def load_trainer(checkpoint: Path) -> dict[str, Any]:
    try:
        return torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Unsupported global" in str(err):
            # intact, but holding an object torch's weights-only loader refuses (lcsm writes none)
            found = next((line.strip() for line in str(err).splitlines() if "Unsupported global" in line), "")
            raise ValueError(
                f"checkpoint {str(checkpoint)!r}: trainer.pt holds an object lcsm does not load ({found})"
            ) from None
        # a whole zip around a damaged pickle, which the cheap ``damage`` check cannot see (torch's
        # own message suggests weights_only=False, which would not mend it)
        problem = "trainer.pt is damaged (its pickled state does not read back)"
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001 (damaged bytes in the pickle raise whatever they decode to)
        first = (str(err).splitlines() or [""])[0]
        problem = f"trainer.pt is unreadable ({type(err).__name__}: {first})"
    raise DamagedCheckpoint(
        f"checkpoint {str(checkpoint)!r}: {problem}; move this checkpoint elsewhere to resume from the one "
        "before it, or restore it from a copy",
        problem,
    ) from None
