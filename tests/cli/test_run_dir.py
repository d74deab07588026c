"""The out dir of ``lcsm train`` / ``lcsm sweep``: one writer at a time (a lock file), and a
directory or disk that cannot take the run's files fails in one line, losing nothing."""

import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from lcsm.cli import main
from lcsm.engine import checkpoint as ckpt_mod
from lcsm.engine.lock import LOCK_NAME

from .conftest import TINY


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def hold(directory, pid, host=None):
    directory.mkdir(parents=True, exist_ok=True)
    holder = {"pid": pid, "host": host or socket.gethostname(), "started": "2026-12-04T08:00:00+0000"}
    (directory / LOCK_NAME).write_text(json.dumps({**holder, "command": "lcsm train"}))


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_a_second_trainer_on_a_run_dir_in_use_is_refused(cfg, tmp_path, capsys, live_pid):
    run = tmp_path / "run"
    hold(run, live_pid)
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 2
    one_line_error(capsys, "lcsm train: error: ", str(run), f"pid {live_pid}", "in use by lcsm train")
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
    assert not (tmp_path / "cache").exists()  # refused before any data was made
    # a lock held on another host is never guessed dead
    hold(run, dead_pid(), host="elsewhere.example")
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 2
    one_line_error(capsys, "on elsewhere.example")


def test_the_lock_of_a_dead_trainer_is_taken_over_and_released_at_the_end(cfg, tmp_path, capsys):
    run = tmp_path / "run"
    pid = dead_pid()
    hold(run, pid)
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"taking over the lock of lcsm train (pid {pid}" in err and "no longer running" in err
    assert not (run / LOCK_NAME).exists()
    assert json.loads((run / "result.json").read_text())["status"] == "completed"


def test_a_lock_naming_this_process_that_it_does_not_hold_is_dead(tmp_path, capsys):
    """A container restarted after a kill runs its entrypoint under the pid of the last one: the
    lock it left names the new process, which took it for a live holder and refused itself."""
    from lcsm.engine.lock import DirectoryLock

    run = tmp_path / "run"
    hold(run, os.getpid())
    with DirectoryLock(run, "lcsm train"):
        assert f"taking over the lock of lcsm train (pid {os.getpid()}" in capsys.readouterr().err
        # while this process holds it, another lock on the directory is still refused
        with pytest.raises(ValueError, match=rf"in use by lcsm train \(pid {os.getpid()}"):
            DirectoryLock(run, "lcsm train").acquire()
    assert not (run / LOCK_NAME).exists()


@pytest.mark.parametrize("text", ["", '{"pid": 9999'])
def test_an_unreadable_lock_file_says_what_to_do(tmp_path, text):
    from lcsm.engine.lock import DirectoryLock

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(text)
    with pytest.raises(ValueError, match=r"is empty or unreadable .*delete it if no lcsm process is using"):
        DirectoryLock(run, "lcsm train").acquire()


def test_the_lock_is_released_after_an_error_and_an_interrupt(cfg, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--set", "task.train_examples=4"]) == 2
    assert "no full batch can be formed" in capsys.readouterr().err
    assert not run.exists()  # the directory the lock made, left empty, goes again

    from lcsm.engine import trainer

    def interrupted(self, resume=True):
        assert (run / LOCK_NAME).is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer.Trainer, "run", interrupted)
    assert main(["train", str(cfg), "--out", str(run), "--quiet"]) == 130
    assert not (run / LOCK_NAME).exists()


def test_a_second_sweep_on_a_sweep_dir_in_use_is_refused(cfg, tmp_path, capsys, live_pid):
    spec = {"name": "exp", "base": "tiny.yaml", "grid": {"train.seed": [0]}}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    hold(out, live_pid)
    assert main(["sweep", str(tmp_path / "exp.yaml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"lcsm sweep: error: {out}: in use by lcsm train (pid {live_pid}" in err and "Traceback" not in err
    assert not (out / "results.csv").exists()


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_an_out_dir_that_is_or_is_under_a_file_fails_in_one_line_before_the_data(cfg, tmp_path, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile if where == "file" else afile / "run"
    assert main(["train", str(cfg), "--out", str(out)]) == 1
    cause = "exists and is not a directory" if where == "file" else "Not a directory"
    one_line_error(capsys, f"lcsm train: error: {out}: {cause}")
    assert afile.read_text() == "keep me"
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("exists", [False, True], ids=["new", "existing"])
def test_a_read_only_out_dir_fails_in_one_line_before_the_data(cfg, tmp_path, capsys, monkeypatch, exists):
    """(As root, chmod would not stop the writes: the file system calls refuse instead.)"""
    read_only = tmp_path / "ro"
    out = read_only / "run"
    if exists:
        out.mkdir(parents=True)
    real_mkdir, real_write_text = os.mkdir, pathlib.Path.write_text

    def refuse(path):
        if str(path).startswith(str(read_only)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def write_text(self, *args, **kwargs):
        refuse(self)
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    assert main(["train", str(cfg), "--out", str(out)]) == 1
    one_line_error(capsys, f"lcsm train: error: {out}: Read-only file system")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at inline_container.cc:672] . unexpected pos 573248 vs 573140",
        "basic_ios::clear: iostream error",
    ],
)
def test_a_full_disk_during_a_checkpoint_fails_in_one_line_and_loses_nothing(
    cfg, tmp_path, capsys, monkeypatch, message
):
    """torch's writer reports a full disk as a short write ('unexpected pos') or its stream's
    failure (an audit on a 2 MB tmpfs), not as ENOSPC."""
    real_save, saves = torch.save, []

    def save(obj, path, *args, **kwargs):
        # the task cache is written with torch.save too: the checkpoints' trainer.pt alone counts
        if str(path).endswith("trainer.pt"):
            saves.append(path)
            if len(saves) == 2:
                raise RuntimeError(message)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    monkeypatch.setattr(ckpt_mod, "_free_bytes", lambda path: 0)
    run = tmp_path / "run"
    args = ["train", str(cfg), "--out", str(run), "--set", "train.save_every=2", "--quiet"]
    assert main(args) == 1
    one_line_error(capsys, f"lcsm train: error: {run / 'checkpoints' / 'step-00000004'}: disk full")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]  # no half checkpoint
    assert not (run / LOCK_NAME).exists()
    monkeypatch.setattr(ckpt_mod.torch, "save", real_save)
    assert main(args) == 0  # space freed: the run resumes
    assert json.loads((run / "result.json").read_text())["step"] == 4


def test_a_full_disk_during_a_metrics_append_leaves_no_cut_off_line(cfg, tmp_path, capsys, monkeypatch):
    real_write = os.write

    def write(fd, data):
        if b'"kind": "train", "step": 4' in bytes(data):
            real_write(fd, bytes(data)[:25])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    run = tmp_path / "run"
    args = ["train", str(cfg), "--out", str(run), "--quiet"]
    assert main(args) == 1
    one_line_error(capsys, f"lcsm train: error: {run / 'metrics.jsonl'}: disk full")
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [2]
    monkeypatch.setattr(os, "write", real_write)
    assert main(args) == 0


def test_two_real_trainers_on_one_out_dir(cfg, tmp_path, capsys):
    """The review's case D18: the second of two lcsm train on one --out stops at once."""
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "lcsm", "train", str(cfg), "--out", str(run), "--quiet"]
        + ["--set", "train.max_steps=100000"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (run / "metrics.jsonl").exists() and first.poll() is None:
            time.sleep(0.05)
        assert main(["train", str(cfg), "--out", str(run), "--quiet", "--set", "train.max_steps=100000"]) == 2
        one_line_error(capsys, f"pid {first.pid}", "in use by lcsm train")
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 130, err
    assert not (run / LOCK_NAME).exists()
