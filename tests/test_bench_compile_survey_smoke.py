"""The compile survey's plumbing (bench/compile_survey.py) without compiling anything: names are
checked, and a worker that gives no result in time is a row saying so, not a hung survey."""

import pytest

from bench import compile_survey


def test_unknown_mixer_is_refused():
    with pytest.raises(SystemExit):
        compile_survey.main(["no_such_mixer"])


def test_worker_past_its_timeout_is_reported():
    result = compile_survey._survey("gla", "aot_eager", timeout=0.01)
    assert result["ok"] is False and "no result within" in result["error"]


def test_error_cell_is_one_table_safe_line():
    assert compile_survey._first_line("\n  a | b\nsecond line", width=160) == "a \\| b"
    assert compile_survey._first_line("x" * 200, width=10) == "x" * 9 + "…"
