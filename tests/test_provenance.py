"""The commit recorded with results: marked when tracked files changed, except in ignored folders
or files (a report's folder, a bench's output table)."""

import subprocess
import sys
from pathlib import Path

import lcsm._provenance as provenance

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench._common import provenance_header  # noqa: E402


def _scratch_repo(path):
    def git(*args):
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=path,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    git("init", "-q")
    return git


def test_changes_inside_ignored_folders_do_not_mark_the_commit(tmp_path, monkeypatch):
    git = _scratch_repo(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "report.md").write_text("old")
    (tmp_path / "code.py").write_text("x = 1")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    results, dirty = [tmp_path / "results"], f"{head} (with uncommitted changes)"
    assert provenance.git_commit() == head
    (tmp_path / "results" / "report.md").write_text("new")
    assert provenance.git_commit() == dirty
    assert provenance.git_commit(ignore=results) == head
    git("mv", "results/report.md", "results/renamed.md")
    assert provenance.git_commit(ignore=results) == head
    git("mv", "code.py", "results/code.py")  # a rename whose source is outside
    assert provenance.git_commit(ignore=results) == dirty
    git("mv", "results/code.py", "code.py")
    (tmp_path / "code.py").write_text("x = 2")
    assert provenance.git_commit(ignore=results) == dirty
    (tmp_path / "untracked.py").write_text("")
    git("checkout", "code.py")
    assert provenance.git_commit(ignore=results) == head  # untracked files never count


def test_a_bench_header_ignores_its_own_output_file(tmp_path, monkeypatch):
    git = _scratch_repo(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "ops.md").write_text("old table")
    (tmp_path / "results" / "tasks.md").write_text("old table")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = git("rev-parse", "--short", "HEAD")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.chdir(tmp_path)  # --out is a path relative to where the bench runs
    (tmp_path / "results" / "ops.md").write_text("the previous rerun's table")
    assert provenance_header("lcsm bench ops", [], 1, out="results/ops.md")["git commit"] == head
    assert provenance_header("lcsm bench ops", [], 1)["git commit"] == f"{head} (with uncommitted changes)"
    (tmp_path / "results" / "tasks.md").write_text("another bench's table")
    assert (
        provenance_header("lcsm bench ops", [], 1, out="results/ops.md")["git commit"]
        == f"{head} (with uncommitted changes)"
    )
