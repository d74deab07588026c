"""``lcsm list``: the registered mixers (as EOS configurations), tasks and model presets."""

from __future__ import annotations


def _source(cls: type) -> str:
    """The file that defines ``cls``, relative to the checkout (or site-packages) holding lcsm, so
    that ``lcsm list | grep gla`` says where GLA's math is; absolute for a mixer from elsewhere."""
    import inspect
    from pathlib import Path

    import lcsm

    path = Path(inspect.getsourcefile(cls)).resolve()
    root = Path(lcsm.__file__).resolve().parent.parent
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _mixer_table(d_model: int) -> str:
    from lcsm import layers

    by_target = {}
    for alias, target in layers.aliases().items():
        by_target.setdefault(target, []).append(alias)
    header = [
        "mixer",
        "aliases",
        "source",
        "input",
        "expand",
        "oscillation",
        "shrink",
        "memory",
        "psi",
        "data-dependent",
    ]
    rows = []
    for name in layers.available():
        source = _source(layers.resolve(name)[0])
        aliases = ", ".join(sorted(by_target.get(name, []))) or "-"
        try:
            row = layers.build(name, d_model).describe()
        except ValueError as err:  # a width this mixer's defaults cannot divide: the rest are listed
            rows.append([name, aliases, source, f"not built at d_model={d_model}: {err}"] + ["-"] * (len(header) - 4))
            continue
        dd = [
            n
            for n, flag in (("i", row.input_dd), ("e", row.expand_dd), ("o", row.oscillation_dd), ("s", row.shrink_dd))
            if flag
        ]
        rows.append(
            [
                name,
                aliases,
                source,
                row.input,
                row.expand,
                row.oscillation,
                row.shrink,
                row.memory,
                row.psi,
                ",".join(dd) or "none",
            ]
        )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)


def cmd_list(args) -> int:
    from lcsm import tasks
    from lcsm.models import PRESETS

    from ._common import UsageError

    if args.d_model < 1:
        raise UsageError(f"--d-model: d_model must be a positive integer, got {args.d_model}")
    print(f"Token mixers as EOS configurations (LCSM Table 1), built at d_model={args.d_model}:\n")
    print(_mixer_table(args.d_model))
    print("\nTasks (lcsm.tasks; options: the fields of each task's Config):\n")
    for name in tasks.available():
        cls = tasks.resolve(name)
        print(f"- {name} (head {cls.default_head}): {', '.join(cls.Config.option_names())}")
    print("\nModel presets (lcsm.models.preset):\n")
    for name, fn in PRESETS.items():
        print(f"- {name}: {_summary(fn.__doc__ or '')}")
    return 0


def _summary(doc: str, width: int = 160) -> str:
    """A docstring's first paragraph on one line (its first line ends mid-sentence where the text
    wraps), cut at a word to ``width`` characters."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text if len(text) <= width else text[: width - 1].rsplit(" ", 1)[0] + " …"


def add_parsers(sub) -> None:
    p = sub.add_parser("list", help="print the registered mixers (EOS table), tasks and presets")
    p.add_argument("--d-model", type=int, default=64, help="width the mixers are built at (default 64)")
    p.set_defaults(func=cmd_list)
