"""attnbook.prose: measured numbers in words that read right for every sign and size."""

import doctest

import attnbook
import numpy as np
import pytest
from attnbook import prose
from attnbook.prose import bound_phrase, count_phrase, more_or_less, percent_phrase

HIGHER = {"more": "higher", "less": "lower"}


def test_the_docstring_examples_hold():
    assert doctest.testmod(prose).failed == 0


def test_exported_from_the_package():
    for name in prose.__all__:
        assert getattr(attnbook, name) is getattr(prose, name)


@pytest.mark.parametrize(
    ("difference", "expected"),
    [
        (0.1234, "0.12 nats higher"),
        (-0.05, "0.05 nats lower"),
        (0.0, "no different to two decimals"),
        (-0.0, "no different to two decimals"),
        (0.004, "no different to two decimals"),  # tiny: rounds to zero
        (-0.004, "no different to two decimals"),
        (0.005001, "0.01 nats higher"),
        (12345.678, "12345.68 nats higher"),  # large
        (np.float32(-0.25), "0.25 nats lower"),  # a NumPy number counts
    ],
)
def test_more_or_less(difference, expected):
    assert more_or_less(difference, "nats", **HIGHER) == expected


def test_more_or_less_units_and_places():
    assert more_or_less(2.5, "%", decimals=1) == "2.5% more"  # no space before %
    assert more_or_less(-3, "points", decimals=0) == "3 points less"
    assert more_or_less(0.4, "points", decimals=0) == "no different to the nearest whole"
    assert more_or_less(0.04, decimals=1) == "no different to one decimal"
    assert more_or_less(0.00004, decimals=4) == "no different to four decimals"
    assert more_or_less(7) == "7.00 more"


@pytest.mark.parametrize(
    ("limit", "bound", "expected"),
    [
        # "sinks make the loss {phrase} than the plain window's"; limit bounds how much lower
        (0.0123, "at most", "at most 0.013 nats lower"),  # rounded up: stays a true bound
        (-0.003, "at most", "at least 0.003 nats higher"),  # below zero: turns round
        (-0.0031, "at most", "at least 0.003 nats higher"),  # rounded down: stays true
        (0.0, "at most", "no lower"),
        (-0.0004, "at most", "no lower"),  # rounds down to zero: the direction only
        (0.0004, "at most", "at most 0.001 nats lower"),  # tiny, rounded up
        (250.0, "at most", "at most 250.000 nats lower"),  # large
        (0.02, "at least", "at least 0.020 nats lower"),
        (-0.02, "at least", "at most 0.020 nats higher"),
        (0.0, "at least", "no higher"),
        (0.0004, "at least", "no higher"),
    ],
)
def test_bound_on_a_signed_difference(limit, bound, expected):
    assert bound_phrase(limit, "nats", bound=bound, decimals=3, more="lower",
                        less="higher") == expected  # fmt: skip


def test_bound_on_a_size():
    assert bound_phrase(0.00003, "nats", decimals=4) == "at most 0.0001 nats"
    assert bound_phrase(0.0, "nats", decimals=4) == "0 nats"  # never "at most 0.0000"
    assert bound_phrase(0.1234, "nats", bound="at least") == "at least 0.12 nats"
    assert bound_phrase(1e6, "bytes", decimals=0) == "at most 1000000 bytes"
    with pytest.raises(ValueError, match="size cannot be negative, got limit=-0.1"):
        bound_phrase(-0.1, "nats")


@pytest.mark.parametrize(
    ("count", "kwargs", "expected"),
    [
        (0, {}, "no run"),
        (1, {}, "one run"),
        (3, {}, "three runs"),
        (10, {}, "ten runs"),
        (11, {}, "11 runs"),
        (12345, {}, "12,345 runs"),
        (2.0, {}, "two runs"),  # a glued count is often a float
        (np.int64(4), {}, "four runs"),
        (0, {"bound": "at most"}, "no run"),  # never "at most 0 runs"
        (1, {"bound": "at most"}, "at most one run"),
        (0, {"total": 10}, "none of the ten runs"),
        (0, {"total": 10, "bound": "at most"}, "none of the ten runs"),
        (1, {"total": 10}, "one of the ten runs"),
        (7, {"total": 10, "bound": "at least"}, "at least seven of the ten runs"),
        (10, {"total": 10}, "all ten runs"),
        (10, {"total": 10, "bound": "at least"}, "all ten runs"),  # "at least all" is all
        (2, {"total": 2}, "both runs"),
        (30, {"total": 30}, "all 30 runs"),
    ],
)
def test_count_phrase(count, kwargs, expected):
    assert count_phrase(count, "run", **kwargs) == expected


def test_count_phrase_nouns():
    assert count_phrase(0, "other run", total=10) == "none of the ten other runs"
    assert count_phrase(3, "head", plural="heads of any layer") == "three heads of any layer"
    assert count_phrase(1, "prompt", bound="at most") == "at most one prompt"


@pytest.mark.parametrize(
    ("fraction", "kwargs", "expected"),
    [
        (1.0, {"bound": "at least"}, "every time"),  # never "at least 100.0%"
        (0.99996, {"bound": "at least"}, "at least 99.9%"),  # rounds down, not to 100.0%
        (0.9987, {"bound": "at least"}, "at least 99.8%"),
        (0.0, {"bound": "at most"}, "never"),
        (0.0004, {"bound": "at most"}, "at most 0.1%"),  # tiny: rounded up, not 0.0%
        (0.0, {"bound": "at least"}, "at least 0.0%"),
        (1.0, {"bound": "at most"}, "at most 100.0%"),
        (1.0, {"bound": "at least", "everything": "all"}, "all"),
        (0.0, {"bound": "at most", "nothing": "none"}, "none"),
        (0.123, {}, "12.3%"),
        (1.0, {}, "100.0%"),
        (0.5, {"decimals": 0}, "50%"),
    ],
)
def test_percent_phrase(fraction, kwargs, expected):
    assert percent_phrase(fraction, **kwargs) == expected


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: more_or_less("0.1"), TypeError, "difference must be a real number, got '0.1'"),
        (lambda: more_or_less(True), TypeError, "difference must be a real number, got True"),
        (lambda: more_or_less(float("nan")), ValueError, "difference must be finite, got nan"),
        (lambda: more_or_less(1.0, decimals=-1), ValueError, "decimals must be an int >= 0, got -1"),
        (lambda: more_or_less(1.0, decimals=1.5), ValueError, "decimals must be an int >= 0, got 1.5"),
        (lambda: bound_phrase(0.1, bound="below"), ValueError, "bound must be one of"),
        (lambda: bound_phrase(0.1, more="higher"), ValueError, "give both more and less or neither"),
        (lambda: bound_phrase(float("inf")), ValueError, "limit must be finite, got inf"),
        (lambda: count_phrase(-1, "run"), ValueError, "count must be a whole number >= 0, got -1"),
        (lambda: count_phrase(1.5, "run"), ValueError, "count must be a whole number >= 0, got 1.5"),
        (lambda: count_phrase("3", "run"), TypeError, "count must be a whole number, got '3'"),
        (lambda: count_phrase(11, "run", total=10), ValueError, "count 11 is more than total 10"),
        (lambda: count_phrase(1, ""), ValueError, "noun must be a non-empty str"),
        (lambda: count_phrase(1, "run", bound="nearly"), ValueError, "bound must be one of"),
        (lambda: percent_phrase(1.2), ValueError, "fraction must be between 0 and 1, got 1.2"),
        (lambda: percent_phrase(-0.1), ValueError, "fraction must be between 0 and 1, got -0.1"),
    ],
)
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        call()
