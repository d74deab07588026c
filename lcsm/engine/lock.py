"""One output directory, one writer: a lock file that ``lcsm train`` and ``lcsm sweep`` hold on
their out dir while they run.

    <out_dir>/.lcsm.lock    {"pid": ..., "host": ..., "started": ..., "command": ...}

Two trainers on one directory would interleave their metrics records and checkpoints (and, with
different configs, leave a directory that mixes two runs), so the second refuses at once. The file
is created whole or not at all (written under a temporary name, then hard-linked into place, which
fails if it exists). A lock whose process is gone (same host, no such pid: killed with SIGKILL, the
machine rebooted) is taken over with a note; one held on another host is never guessed dead.

Taking the lock also creates the directory, so an out dir that cannot be written (read-only, a
regular file in its place) fails here, before any data or model is built.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from lcsm._files import os_error_cause

LOCK_NAME = ".lcsm.lock"
# The directories whose lock this process holds: a lock file naming this process's pid that is not
# among them was written by an earlier process of the same pid (a container restarted after a kill
# runs its entrypoint under the pid its last one had) and is dead.
_HELD: set[Path] = set()


def environment_error(path: str | Path, err: OSError) -> OSError:
    """``err`` re-raised against ``path`` (what the user named, not an internal temporary file),
    with "disk full" for ENOSPC: the CLI prints it as one line ``<path>: <cause>``."""
    return OSError(err.errno, os_error_cause(err), str(path))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _live(holder: dict[str, Any], directory: str | Path) -> bool:
    """Whether the holder of ``directory``'s lock may still be running: one on another host is
    never guessed dead; one naming this process is alive only where this process holds it."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = int(holder.get("pid", -1))
    return Path(directory).resolve() in _HELD if pid == os.getpid() else _alive(pid)


def live_holder(directory: str | Path) -> dict[str, Any] | None:
    """What its lock file says of the process that holds ``directory``, or None when none does."""
    holder = _read(Path(directory) / LOCK_NAME)
    return holder if holder is not None and _live(holder, directory) else None


class DirectoryLock:
    """``with DirectoryLock(out_dir, "lcsm train"):`` holds ``out_dir`` (created if missing) or
    raises ValueError naming the live holder. Released on leaving the block however it is left;
    a directory the lock itself created and nothing else filled is removed again."""

    def __init__(self, directory: str | Path, command: str, *, note=None):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command = command
        self.note = note if note is not None else (lambda text: print(text, file=sys.stderr, flush=True))
        self._created: list[Path] = []
        self._held = False

    def _make_directory(self) -> None:
        missing = []
        parent = self.directory
        while not parent.exists() and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError as err:
            raise environment_error(self.directory, OSError(errno.ENOTDIR, "exists and is not a directory")) from err
        except OSError as err:
            raise environment_error(err.filename or self.directory, err) from None
        self._created = missing

    def acquire(self) -> None:
        self._make_directory()
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        me["command"] = self.command
        tmp = self.directory / f"{LOCK_NAME}.{me['pid']}.tmp"
        try:
            # on the disk before it is linked: a crash cannot leave an empty lock file behind
            tmp.write_text(json.dumps(me) + "\n")
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            for _ in range(10):
                try:
                    os.link(tmp, self.path)
                    self._held = True
                    _HELD.add(self.directory.resolve())
                    return
                except FileExistsError:
                    pass
                holder = _read(self.path)
                if holder is None:
                    # Another process's lock, seen between a take-over's rename and its link: look again.
                    time.sleep(0.05)
                    continue
                if _live(holder, self.directory):
                    raise ValueError(
                        f"{self.directory}: in use by {holder.get('command', 'another lcsm process')} (pid "
                        f"{holder.get('pid')} on {holder.get('host')}, since {holder.get('started')}); wait for it "
                        f"to finish or use another directory (lock file {self.path}; delete it only if that "
                        "process is gone)"
                    )
                self._take_over(holder)
            if self.path.exists() and _read(self.path) is None:
                raise ValueError(
                    f"{self.directory}: its lock file {self.path} is empty or unreadable (left by a crash before "
                    "its contents reached the disk?); delete it if no lcsm process is using this directory"
                )
            raise ValueError(f"{self.directory}: could not take its lock file {self.path} (it keeps changing)")
        except OSError as err:
            # the directory, not the lock's temporary file: what the user named and must fix
            raise environment_error(self.directory, err) from None
        finally:
            # (on a read-only file system unlink fails too: the error above, naming the directory, is the one to keep)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def _take_over(self, holder: dict[str, Any]) -> None:
        """Remove a dead process's lock, unless another process took it over first (then the file
        moved aside is a live lock and goes back)."""
        aside = self.directory / f"{LOCK_NAME}.stale.{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read(aside) != holder:
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            aside.unlink(missing_ok=True)
            return
        aside.unlink()
        self.note(
            f"note: {self.directory}: taking over the lock of {holder.get('command', 'an lcsm process')} (pid "
            f"{holder.get('pid')}, since {holder.get('started')}), which is no longer running"
        )

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        _HELD.discard(self.directory.resolve())
        if (_read(self.path) or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        for path in self._created:
            try:
                path.rmdir()
            except OSError:
                break  # not empty: the run wrote something

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
