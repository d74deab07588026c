"""What a run shows and records: a progress line, metrics files, optional TensorBoard.

- ``Progress``: on a terminal, one line redrawn in place (step/total, loss, lr, tokens/s, ETA);
  otherwise (logs, CI, pipes) a plain line every ``log_every`` steps.
- ``MetricsLog``: ``metrics.jsonl`` (one JSON object per record: ``{"kind": "train" | "eval",
  "step": ..., ...}``) is the record of truth; ``train.csv`` and ``eval.csv`` are regenerated
  from it. A resumed run first drops the records its checkpoint does not hold (``truncate_after``),
  so the files read as if the run had never stopped. A last line cut off by a kill or a full
  disk is dropped then (with a warning), and an append that fails takes back what it wrote.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .lock import environment_error


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole, or what it held before: a run's or a report's file written
    under a temporary name and renamed into place (a full disk or a kill leaves no cut-off file);
    a failure is one error naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise environment_error(path, err) from None


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None: JSON has no such numbers (Python
    would write bare NaN / Infinity, which strict parsers refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


class Progress:
    """Training progress for humans (rank 0 only; ``enabled=False`` silences it)."""

    def __init__(
        self, total: int, *, start: int = 0, log_every: int = 10, enabled: bool = True, stream: TextIO | None = None
    ):
        self.total, self.start, self.log_every, self.enabled = total, start, log_every, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._drawn = False

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done else math.inf
        text = (
            f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {_rate(tokens_per_s)} tok/s  "
            f"elapsed {_duration(elapsed)}  eta {_duration(eta)}"
        )
        if self.tty:
            width = 24
            filled = int(width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif step == self.total or (self.log_every and step % self.log_every == 0):
            print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line of its own (evaluation results, checkpoints) that the progress line does not overwrite."""
        if not self.enabled:
            return
        if self._drawn:
            self.stream.write("\n")
            self._drawn = False
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False


class MetricsLog:
    """Append-only metrics of a run (rank 0 writes; other ranks pass ``enabled=False``)."""

    def __init__(self, out_dir: Path, *, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "run.tensorboard: true needs the 'tensorboard' package (pip install tensorboard)"
                ) from None
            self._tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def truncate_after(self, step: int, eval_step: int | None) -> None:
        """Drop the records of work a run resumed from a checkpoint redoes: training past its
        ``step``, evaluations past its ``eval_step`` (the last evaluation it holds, None: none; a
        run's final evaluation comes after its final checkpoint)."""
        if not self.enabled or not self.path.exists():
            return

        def keep(record: dict[str, Any]) -> bool:
            last = eval_step if record.get("kind") == "eval" else step
            return last is not None and record.get("step", 0) <= last

        kept = [json.dumps(record) for record in self._read(warn=True) if keep(record)]
        write_atomic(self.path, "".join(line + "\n" for line in kept))

    def _read(self, warn: bool = False) -> list[dict[str, Any]]:
        """The records; a cut-off last line (a write interrupted by a kill or a full disk) is left
        out, with a warning when ``warn``. A bad line anywhere else is an error naming it."""
        lines = self.path.read_text().splitlines()
        while lines and not lines[-1].strip():
            lines.pop()
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as err:
                if number < len(lines):
                    raise ValueError(
                        f"{self.path}: line {number} is not a JSON record ({err}); repair or delete that line"
                    ) from None
                if warn:
                    print(
                        f"warning: {self.path}: dropped its cut-off last line {line[:60]!r} (an interrupted write)",
                        file=sys.stderr,
                        flush=True,
                    )
        return records

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        data = (json.dumps(record) + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as err:
            raise environment_error(self.path, err) from None
        try:
            size = os.fstat(fd).st_size
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError as err:
            # A record cut off by a full disk would end the file in half a line: take it back out.
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise environment_error(self.path, err) from None
        finally:
            os.close(fd)
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [r for r in self._read() if kind is None or r["kind"] == kind]

    def write_csv(self) -> None:
        """``train.csv`` and ``eval.csv`` from the JSONL (columns: the union of keys, in order seen)."""
        if not self.enabled:
            return
        for kind in ("train", "eval"):
            rows = self.records(kind)
            if not rows:
                continue
            columns: dict[str, None] = {}
            for row in rows:
                columns.update(dict.fromkeys(k for k in row if k != "kind"))
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            write_atomic(self.path.parent / f"{kind}.csv", buf.getvalue())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
