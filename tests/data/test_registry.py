"""Fetching registry artefacts: checksum, unpacking (tar.gz, wheel/zip, .deb), atomicity, caching.
No network: the artefacts are built here and served through file:// URLs."""

import dataclasses
import hashlib
import io
import json
import lzma
import tarfile
import urllib.request
import zipfile

import pytest

from lcsm.data import SourceUnavailable, fetch
from lcsm.data import registry as src


def _tar_bytes(files, compression=""):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _ar(members):
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        if len(data) % 2:
            out += b"\n"
    return out


def artefact(tmp_path, kind):
    files = {"package/data/a.json": b'{"text": "hello"}', "package/LICENSE": b"public domain"}
    if kind == "tgz":
        data, name = _tar_bytes(files, "gz"), "pkg-1.0.tgz"
    elif kind == "whl":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            for n, d in files.items():
                zf.writestr(n, d)
        data, name = buf.getvalue(), "pkg-1.0-py3-none-any.whl"
    else:
        data = _ar(
            {
                "debian-binary": b"2.0\n",
                "control.tar.gz": _tar_bytes({"control": b"Package: x"}, "gz"),
                "data.tar.xz": lzma.compress(_tar_bytes(files)),
            }
        )
        name = "pkg_1.0_all.deb"
    path = tmp_path / name
    path.write_bytes(data)
    return path, hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    def make(kind="tgz", sha=None, url=None):
        path, digest = artefact(tmp_path, kind)
        source = dataclasses.replace(
            src.SOURCES["sotu"], name="fake", url=url or path.as_uri(), sha256=sha or digest, size=path.stat().st_size
        )
        monkeypatch.setitem(src.SOURCES, "fake", source)
        return source

    return make


@pytest.mark.parametrize("kind", ["tgz", "whl", "deb"])
def test_fetch_unpacks_and_records(tmp_path, fake_source, kind):
    fake_source(kind)
    root = tmp_path / "data"
    out = fetch("fake", root=root, progress=False)
    assert out == root / "fake"
    assert json.loads((out / "package" / "data" / "a.json").read_text()) == {"text": "hello"}
    record = json.loads((out / "SOURCE.json").read_text())
    assert record["name"] == "fake" and record["sha256"] and "fetched" in record
    assert [p.name for p in root.iterdir()] == ["fake"]  # no temporary leftovers


def test_second_fetch_uses_the_cache(tmp_path, fake_source):
    fake_source()
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return urllib.request.urlopen(url, timeout=timeout)

    fetch("fake", root=tmp_path / "data", progress=False, opener=opener)
    fetch("fake", root=tmp_path / "data", progress=False, opener=opener)
    assert len(calls) == 1


def test_a_copy_fetched_meanwhile_by_another_process_stays(tmp_path, fake_source):
    """Two runs of a sweep fetching one source at once: the one that finishes second keeps the
    first one's whole copy (which that run may be reading) and drops its own, where it removed it."""
    fake_source()
    root = tmp_path / "data"

    def opener(url, timeout):  # the other process finishes while this one downloads
        (root / "fake").mkdir()
        (root / "fake" / "SOURCE.json").write_text("{}")
        (root / "fake" / "theirs.txt").write_text("in use")
        return urllib.request.urlopen(url, timeout=timeout)

    out = fetch("fake", root=root, progress=False, opener=opener)
    assert (out / "theirs.txt").read_text() == "in use"
    assert [p.name for p in root.iterdir()] == ["fake"]  # this fetch's temporary directory is gone


def test_checksum_mismatch_is_refused(tmp_path, fake_source):
    fake_source(sha="0" * 64)
    with pytest.raises(SourceUnavailable, match="expected 0000.*refusing to use it"):
        fetch("fake", root=tmp_path / "data", progress=False)
    assert list((tmp_path / "data").iterdir()) == []  # nothing half-written stays


def test_unreachable_source_says_what_to_do(tmp_path, fake_source):
    fake_source(url=(tmp_path / "missing.tgz").as_uri())
    with pytest.raises(SourceUnavailable, match="cannot download .*lcsm data prepare fake"):
        fetch("fake", root=tmp_path / "data", progress=False)


def test_unknown_source():
    with pytest.raises(ValueError, match="unknown data source 'sotuu' \\(did you mean 'sotu'\\?\\)"):
        fetch("sotuu")


def test_unsafe_archive_members_are_refused(tmp_path):
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(_tar_bytes({"../escape.txt": b"x"}, "gz"))
    with pytest.raises(tarfile.TarError):
        src.unpack(bad, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()
    # a zip member outside the target, also one whose path only shares the target's name as a prefix
    for member in ("../escape.txt", "../out2/escape.txt", "/abs/escape.txt"):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr(member, b"x")
        bad = tmp_path / "bad.zip"
        bad.write_bytes(buf.getvalue())
        with pytest.raises(ValueError, match=f"member {member!r} would land outside the target directory"):
            src.unpack(bad, tmp_path / "out")
    assert not any(tmp_path.rglob("escape.txt"))


def test_every_declared_source_is_pinned():
    for s in src.sources().values():
        assert len(s.sha256) == 64 and s.size > 0 and s.licence and s.url.startswith(("https://", "http://"))
        assert s.registry in ("npm", "pypi", "debian")
