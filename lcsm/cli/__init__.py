"""The ``lcsm`` command line.

Every module of this package that defines ``add_parsers(subparsers)`` contributes its commands
(``catalog``: list; ``bench``; ``train``: train / eval / generate; ``sweep``: sweep / report;
``data``: data prepare; ``export``: export --hf; ``eval_harness``: eval-harness). Errors a user can
cause end in one clear message on stderr and exit status 2, not a traceback; a problem of the
machine (a read-only or full disk) in one line ``<path>: <cause>`` and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys

from lcsm._files import os_error_cause

from ._common import UsageError

# The order commands appear in ``lcsm --help``; modules not listed follow in name order.
_ORDER = ("catalog", "train", "sweep", "data", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lcsm", description="Linear-complexity sequence models: one EOS operator, every model, every form."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = sorted(
        (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
        key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n),
    )
    for name in names:
        module = importlib.import_module(f"{__name__}.{name}")
        if hasattr(module, "add_parsers"):
            module.add_parsers(sub)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, args, unknown: list[str], argv: list[str]) -> None:
    """Exits naming unknown arguments by the parser they were given to, with the closest of its
    options: the top-level parser's "lcsm: error: unrecognized arguments" named neither the
    command nor the option. Those before the command word are the top level's; the rest are the
    innermost (sub)command's (``lcsm data prepare``)."""
    from lcsm._names import did_you_mean

    owner, words = parser, []
    while True:
        sub = next((a for a in owner._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) is None:
            break
        words.append(getattr(args, sub.dest))
        owner = sub.choices[words[-1]]
    command_at = argv.index(words[0]) if words and words[0] in argv else len(argv)
    if any(u in argv[:command_at] for u in unknown):
        owner = parser
    options = [o for action in owner._actions for o in action.option_strings]
    named = [u + (did_you_mean(u.split("=", 1)[0], options) if u.startswith("-") else "") for u in unknown]
    owner.error(f"unrecognized arguments: {' '.join(named)}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unrecognized(parser, args, unknown, sys.argv[1:] if argv is None else list(argv))
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader stopped (`lcsm list | head`): nothing to report. stdout goes to /dev/null so
        # that the interpreter's own flush at exit does not fail on the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (UsageError, ValueError) as err:
        print(f"lcsm {args.command}: error: {err}", file=sys.stderr)
        return getattr(err, "exit_status", 2)
    except OSError as err:
        # The machine, not the input (a read-only or full disk, a file where a directory should be):
        # one line naming the path, status 1.
        where = f"{err.filename}: " if err.filename else ""
        print(f"lcsm {args.command}: error: {where}{os_error_cause(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lcsm {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["UsageError", "build_parser", "main"]
