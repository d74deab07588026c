"""The commit recorded with results: marked when tracked files changed, except in ignored folders."""
import subprocess

import lcsm._provenance as provenance


def test_changes_inside_ignored_folders_do_not_mark_the_commit(tmp_path, monkeypatch):
    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
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
    git("mv", "code.py", "results/code.py")                 # a rename whose source is outside
    assert provenance.git_commit(ignore=results) == dirty
    git("mv", "results/code.py", "code.py")
    (tmp_path / "code.py").write_text("x = 2")
    assert provenance.git_commit(ignore=results) == dirty
    (tmp_path / "untracked.py").write_text("")
    git("checkout", "code.py")
    assert provenance.git_commit(ignore=results) == head     # untracked files never count
