"""Smoke test of bench/side_by_side.py: one case timed in two trees (here the same tree twice),
each cell in its own process, and the report's table. Timings are machine-dependent and not
asserted."""

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ lives at the repository root, outside the lcsm package
    sys.path.insert(0, str(REPO))

from bench import side_by_side  # noqa: E402


def test_one_case_in_two_trees(tmp_path, capsys):
    """A mixer layer's case under the system allocator (the other choice is the default)."""
    out = tmp_path / "report.md"
    args = ["--old", str(REPO), "--new", str(REPO), "--cases", "layer-s4-16", "--rounds", "2", "--repeats", "1"]
    assert side_by_side.main([*args, "--threads", "1", "--allocator", "system", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| layer-s4-16 |")]
    # the median ratio, then the ratio paired by round with its interval
    assert len(rows) == 1 and re.search(r"x \| [0-9.]+x \[[0-9.]+, [0-9.]+\] \|$", rows[0]), out.read_text()
    assert "| layer-s4-16 |" in capsys.readouterr().out


def test_a_decode_case_steps_the_model_with_its_state():
    """decode-NAME-N: N one-token steps from the prefill's state, without gradients (and without
    leaving them off for what runs after)."""
    import torch

    side_by_side._case("decode-gla-3")()
    assert torch.is_grad_enabled()


def test_a_case_a_tree_cannot_run_is_reported_not_fatal(tmp_path):
    out = tmp_path / "report.md"
    args = ["--old", str(REPO), "--new", str(REPO), "--cases", "lm-nosuchmodel-8", "--rounds", "1"]
    assert side_by_side.main([*args, "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| lm-nosuchmodel-8 | - | - | - | - |" in text
    assert "old tree, lm-nosuchmodel-8: " in text and "nosuchmodel" in text.split("old tree, ")[1], text


@pytest.mark.parametrize(
    "name", ["eos-none-33-2x3x5", "eos-scalar-33-2x3x5", "eos-row-33-2x3x5", "eos-col-20", "glu-9"]
)
def test_op_cases_run_in_process(name):
    """The chunk-form cases, at a given B x H x K or the ops bench's limit shape, and the GLU's,
    build and run one forward and backward."""
    side_by_side._case(name)()


def test_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"--old: expected a source tree holding lcsm/"):
        side_by_side.main(["--old", str(tmp_path), "--new", str(REPO)])
    with pytest.raises(ValueError, match=r"case: expected one of kxd, product, kxd-auto, product-auto, product-packed"):
        side_by_side._case("nope")
    with pytest.raises(
        ValueError, match=r"eos-KIND-T\[-BxHxK\], glu-T, lm-NAME-T, layer-NAME-T or decode-NAME-N, got 'nope'"
    ):
        side_by_side._case("nope")
