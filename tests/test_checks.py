"""The shared argument checks (lcsm/_checks.py): what they accept, and that every refusal names
the argument, the value got and what was expected."""

import math

import pytest

from lcsm._checks import check_bool, check_choice, check_float, check_int, check_keys


def test_check_int_accepts_integers_at_or_above_the_minimum():
    assert check_int("n", 3, 1) == 3
    assert check_int("n", 0, 0) == 0
    assert check_int("n", None, 1, allow_none=True) is None


@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3", None])
def test_check_int_refuses_with_name_value_and_bound(value):
    with pytest.raises(ValueError, match=rf"^n: expected an integer >= 1, got {value!r}$"):
        check_int("n", value, 1)


def test_check_int_names_a_numpy_integer_and_how_to_pass_it():
    np = pytest.importorskip("numpy")
    with pytest.raises(
        ValueError, match=r"^n: expected an integer >= 1, got np.int64\(3\) \(int64: give a Python int, int\(value\)\)$"
    ):
        check_int("n", np.int64(3), 1)


def test_check_int_with_allow_none_says_so():
    with pytest.raises(ValueError, match=r"^n: expected an integer >= 2 or None, got 1$"):
        check_int("n", 1, 2, allow_none=True)


def test_check_float_accepts_reals_in_range_and_returns_a_float():
    assert check_float("x", 1, 0, low_open=True) == 1.0 and isinstance(check_float("x", 1, 0), float)
    assert check_float("x", 0, 0, 1) == 0.0
    assert check_float("x", None, allow_none=True) is None


@pytest.mark.parametrize(
    "kwargs,value,expected",
    [
        (dict(low=0, low_open=True), 0, "a positive finite number"),
        (dict(low=0, low_open=True), math.inf, "a positive finite number"),
        (dict(low=0, low_open=True), math.nan, "a positive finite number"),
        (dict(low=0), -1, "a finite number >= 0"),
        (dict(high=1, high_open=True), 1, "a finite number < 1"),
        (dict(low=0, high=1, high_open=True), 1.0, r"a number in \[0, 1\)"),
        (dict(low=0, high=1, low_open=True), 0, r"a number in \(0, 1\]"),
        (dict(), True, "a finite number"),
        (dict(), "1", "a finite number"),
    ],
)
def test_check_float_refuses_with_the_range_in_words(kwargs, value, expected):
    with pytest.raises(ValueError, match=rf"^x: expected {expected}, got "):
        check_float("x", value, **kwargs)


def test_check_choice_lists_the_choices_and_the_closest():
    assert check_choice("norm", "rmsnorm", ("layernorm", "rmsnorm")) == "rmsnorm"
    with pytest.raises(
        ValueError,
        match=r"^norm: expected one of 'layernorm', 'rmsnorm', got 'rmsnrom' \(did you mean 'rmsnorm'\?\)$",
    ):
        check_choice("norm", "rmsnrom", ("layernorm", "rmsnorm"))


def test_check_keys_names_every_unknown_key_with_hints():
    check_keys("train", {"seed": 0}, ["seed", "epochs"])
    with pytest.raises(
        ValueError, match=r"^train: unknown key\(s\) 'sed' \(did you mean 'seed'\?\), 'zzz'\. Valid keys: seed, epochs$"
    ):
        check_keys("train", {"sed": 0, "zzz": 1}, ["seed", "epochs"])
    with pytest.raises(ValueError, match=r"^train: expected a mapping of keys to values, got list$"):
        check_keys("train", [], ["seed"])
    with pytest.raises(ValueError, match=r"^m: has no option\(s\) 'a'\. Valid options: none$"):
        check_keys("m", {"a": 1}, [], kind="option", unknown="has no option(s)")


def test_check_bool():
    assert check_bool("b", False) is False
    with pytest.raises(ValueError, match=r"^b: expected True or False, got 1$"):
        check_bool("b", 1)
