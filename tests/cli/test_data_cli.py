"""lcsm data list / prepare (served from a local file:// artefact, no network)."""

import dataclasses
import hashlib
import io
import tarfile

from lcsm.cli import main
from lcsm.data import registry


def test_list_and_prepare(tmp_path, monkeypatch, capsys):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/data/x.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    path = tmp_path / "x-1.0.tgz"
    path.write_bytes(buf.getvalue())
    fake = dataclasses.replace(
        registry.SOURCES["sotu"],
        name="fake",
        url=path.as_uri(),
        sha256=hashlib.sha256(buf.getvalue()).hexdigest(),
        size=len(buf.getvalue()),
    )
    monkeypatch.setitem(registry.SOURCES, "fake", fake)
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "cache"))
    assert main(["data", "list"]) == 0
    assert "| fake | npm |" in capsys.readouterr().out
    assert main(["data", "prepare", "fake"]) == 0
    assert (tmp_path / "cache" / "data" / "fake" / "package" / "data" / "x.json").is_file()
    assert main(["data", "list"]) == 0
    assert "| yes |" in capsys.readouterr().out
    assert main(["data", "prepare", "fakee"]) == 2
    assert "unknown source 'fakee' (did you mean 'fake'?)" in capsys.readouterr().err
    assert main(["data", "prepare", "all", "sotu"]) == 2
    assert "all: stands alone (it prepares every source), got all sotu" in capsys.readouterr().err
    monkeypatch.setitem(registry.SOURCES, "fake", dataclasses.replace(fake, sha256="0" * 64))
    monkeypatch.setenv("LCSM_CACHE", str(tmp_path / "other"))
    assert main(["data", "prepare", "fake"]) == 2
    captured = capsys.readouterr()
    assert "refusing to use it" in captured.out and "could not fetch fake" in captured.err
