"""The command line: valid input exits 0, user errors exit non-zero with one clear message."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import lcsm
from lcsm import layers
from lcsm.cli import main


def test_list_prints_every_mixer(capsys):
    assert main(["list", "--d-model", "32"]) == 0
    out = capsys.readouterr().out
    for name in layers.available():
        assert f"| {name} |" in out


def test_list_describes_each_preset_in_whole_words(capsys):
    """A preset's line is its docstring's first paragraph, not the first line of the docstring,
    which wraps mid-sentence; cut to 160 characters at a word, marked."""
    from lcsm.models import PRESETS

    assert main(["list"]) == 0
    lines = {line[2:].split(": ", 1)[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("- ")}
    for name in PRESETS:
        text = lines[name].split(": ", 1)[1]
        assert len(text) <= 160 and (text.endswith((".", ")")) or text.endswith(" …")), (name, text)


def test_list_at_a_width_some_mixer_cannot_take_lists_the_rest(capsys):
    """At d_model 96 RWKV-7's 64-wide heads do not divide the width: its row says so, the others
    are built."""
    assert main(["list", "--d-model", "96"]) == 0
    rows = {
        line.split(" | ")[0].lstrip("| "): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ")
    }
    assert "not built at d_model=96: head_size" in rows["rwkv7"]
    assert all(name in rows for name in layers.available())
    assert sum("not built" in row for row in rows.values()) < len(rows) // 2


def test_list_names_the_file_of_each_mixer(capsys):
    """The source column holds the path, from the checkout's root, of the file whose ``@register``
    defines the mixer."""
    assert main(["list", "--d-model", "32"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    header, table = rows[0], {row[0].lstrip("| "): row for row in rows[1:]}
    assert header[:3] == ["| mixer", "aliases", "source"]
    root = Path(lcsm.__file__).resolve().parent.parent
    for name in layers.available():
        source = table[name][2]
        assert source.startswith("lcsm/layers/") and source.endswith(".py"), (name, source)
        assert Path(inspect.getsourcefile(layers.resolve(name)[0])).resolve() == root / source


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "lcsm", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unknown_option_is_named_by_its_command_with_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "tiny.yaml", "--sett", "x=1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "lcsm train: error: unrecognized arguments: --sett (did you mean '--set'?) x=1" in err
    # a subcommand's by the subcommand, one before the command word by lcsm itself
    for argv, said in (
        (["data", "list", "--jsn"], "lcsm data list: error: unrecognized arguments: --jsn"),
        (["--bogus", "train", "tiny.yaml"], "lcsm: error: unrecognized arguments: --bogus"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err, argv


def test_bad_value_gives_one_line_error(capsys):
    assert main(["list", "--d-model", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm list: error: ") and "d_model" in err


def test_a_closed_pipe_ends_the_listing_quietly():
    """`lcsm list | head -1`: the reader stops, lcsm says nothing and exits as a killed writer."""
    proc = subprocess.run(
        f"{sys.executable} -m lcsm list --d-model 32 | head -1", shell=True, capture_output=True, text=True
    )
    assert proc.stdout.count("\n") == 1 and proc.stderr == "", proc.stderr
