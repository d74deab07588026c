"""The command line: valid input exits 0, user errors exit non-zero with one clear message."""

import subprocess
import sys

from lcsm import layers
from lcsm.cli import main


def test_list_prints_every_mixer(capsys):
    assert main(["list", "--d-model", "32"]) == 0
    out = capsys.readouterr().out
    for name in layers.available():
        assert f"| {name} |" in out


def test_unknown_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "lcsm", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_value_gives_one_line_error(capsys):
    assert main(["list", "--d-model", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lcsm list: error: ") and "d_model" in err
