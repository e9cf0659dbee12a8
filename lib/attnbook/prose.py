"""Measured numbers in words: phrases for the sentences a notebook writes from its own
results, which must read right whatever the sign and size of the number.

A sentence such as "sinks make the loss at most {x} nats lower" reads wrong the day
``x`` comes out negative ("at most -0.003 nats lower"), zero ("at most 0.000 nats") or
whole ("at least 100.0%"). Each function here turns a number into the phrase that says
what it means:

- :func:`more_or_less`: a signed difference, "0.12 nats higher" / "0.05 nats lower" /
  "no different to two decimals".
- :func:`bound_phrase`: a bound on a signed difference, "at most 0.012 nats lower" /
  "at least 0.003 nats higher" (an upper bound below zero turns round) / "no lower";
  or on a size, "at most 0.0001 nats". A bound is rounded outwards, so it stays true.
- :func:`count_phrase`: a count, "no run" / "one run" / "three of the ten runs" /
  "all ten runs", never "at most 0 runs".
- :func:`percent_phrase`: a share, "at least 99.9%" / "every time" / "never", never
  "at least 100.0%".

Each returns a phrase without a capital or a full stop, for the notebook to glue
(``myst_nb.glue(name, phrase, display=False)``, then ``{glue:text}`name``` in the
prose).
"""

from __future__ import annotations

import math
import numbers

__all__ = ["bound_phrase", "count_phrase", "more_or_less", "percent_phrase"]

_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
          "ten")  # fmt: skip
_BOUNDS = ("at most", "at least")


def _number(name: str, value) -> float:
    """``value`` as a finite ``float``; a ``TypeError`` or ``ValueError`` naming
    ``name`` otherwise (a bool is no number here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def _decimals(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"decimals must be an int >= 0, got {value!r}")
    return int(value)


def _bound(value) -> str:
    if value not in _BOUNDS:
        raise ValueError(f"bound must be one of {_BOUNDS}, got {value!r}")
    return value


def _words(count: int) -> str:
    """A count as a reader writes it: words up to ten, digits with commas above."""
    return _WORDS[count] if count < len(_WORDS) else f"{count:,}"


def _with_unit(text: str, unit: str) -> str:
    if not unit:
        return text
    return text + unit if unit == "%" else f"{text} {unit}"


def _rounded(value: float, decimals: int, direction: str = "nearest") -> float:
    """``value`` to ``decimals`` places: to the nearest, or up or down (for a bound that
    must stay true once rounded)."""
    scale = 10.0**decimals
    scaled = round(value * scale, 9)  # 0.1 + 0.2 is 0.3 here, not just above it
    if direction == "up":
        return math.ceil(scaled) / scale
    if direction == "down":
        return math.floor(scaled) / scale
    return round(value, decimals)


def more_or_less(
    difference, unit: str = "", *, more: str = "more", less: str = "less", decimals=2
) -> str:
    """A signed difference in words: its size, its unit and which way it goes.

    >>> more_or_less(0.1234, "nats", more="higher", less="lower")
    '0.12 nats higher'
    >>> more_or_less(-0.05, "nats", more="higher", less="lower")
    '0.05 nats lower'
    >>> more_or_less(0.004, "nats", more="higher", less="lower")
    'no different to two decimals'
    >>> more_or_less(-2.5, "%", more="more accurate", less="less accurate", decimals=1)
    '2.5% less accurate'

    ``difference`` is positive when the thing measured is ``more``; a difference that
    rounds to zero at ``decimals`` places says so instead of printing "0.00 more".
    """
    difference = _number("difference", difference)
    decimals = _decimals(decimals)
    size = _rounded(abs(difference), decimals)
    if size == 0:
        if decimals == 0:
            return "no different to the nearest whole"
        return (
            f"no different to {_words(decimals)} decimal{'s' if decimals > 1 else ''}"
        )
    way = more if difference > 0 else less
    return f"{_with_unit(f'{size:.{decimals}f}', unit)} {way}"


def bound_phrase(
    limit,
    unit: str = "",
    *,
    bound: str = "at most",
    more: str | None = None,
    less: str | None = None,
    decimals=2,
) -> str:
    """A bound in words, rounded outwards so that it stays true.

    With ``more`` and ``less``, ``limit`` bounds a signed difference (positive when the
    thing measured is ``more``): ``bound="at most"`` says the difference never exceeded
    ``limit``, ``"at least"`` that it never fell below it. A bound on the far side of
    zero turns round and says what it guarantees:

    >>> bound_phrase(0.0123, "nats", more="lower", less="higher", decimals=3)
    'at most 0.013 nats lower'
    >>> bound_phrase(-0.003, "nats", more="lower", less="higher", decimals=3)
    'at least 0.003 nats higher'
    >>> bound_phrase(0.0, "nats", more="lower", less="higher")
    'no lower'
    >>> bound_phrase(0.004, "nats", bound="at least", more="lower", less="higher")
    'no higher'

    (the last rounds down to zero: all it guarantees is the direction; more
    ``decimals`` say more). Without ``more`` and ``less``,
    ``limit`` bounds a size (an absolute change, a distance):

    >>> bound_phrase(0.00003, "nats", decimals=4)
    'at most 0.0001 nats'
    >>> bound_phrase(0.0, "nats", decimals=4)
    '0 nats'
    """
    limit = _number("limit", limit)
    bound = _bound(bound)
    decimals = _decimals(decimals)
    if (more is None) != (less is None):
        raise ValueError(f"give both more and less or neither, got {more!r}, {less!r}")
    if more is None:
        if limit < 0:
            raise ValueError(f"a size cannot be negative, got limit={limit!r}")
        if limit == 0:
            return _with_unit("0", unit)
        size = _rounded(limit, decimals, "up" if bound == "at most" else "down")
        return f"{bound} {_with_unit(f'{size:.{decimals}f}', unit)}"
    # An upper bound below zero is a lower bound the other way, and the reverse; a bound
    # of zero, or one that rounds down to zero, says only which way it does not go.

    def sized(words: str, size: float, direction: str, way: str) -> str:
        size = _rounded(size, decimals, direction)
        if not size:
            return ""
        return f"{words} {_with_unit(f'{size:.{decimals}f}', unit)} {way}"

    if bound == "at most":  # difference <= limit
        if limit > 0:
            return sized("at most", limit, "up", more)
        return sized("at least", -limit, "down", less) or f"no {more}"
    if limit < 0:  # difference >= limit
        return sized("at most", -limit, "up", less)
    return sized("at least", limit, "down", more) or f"no {less}"


def count_phrase(
    count, noun: str, *, total=None, bound: str | None = None, plural: str | None = None
) -> str:
    """A count of things in words, with the extremes said as words.

    >>> count_phrase(0, "run"), count_phrase(1, "run"), count_phrase(3, "run")
    ('no run', 'one run', 'three runs')
    >>> count_phrase(0, "other run", total=10), count_phrase(4, "other run", total=10)
    ('none of the ten other runs', 'four of the ten other runs')
    >>> count_phrase(10, "other run", total=10), count_phrase(2, "seed", total=2)
    ('all ten other runs', 'both seeds')
    >>> count_phrase(0, "run", total=10, bound="at most")
    'none of the ten runs'
    >>> count_phrase(3, "prompt", bound="at most")
    'at most three prompts'

    ``bound`` ("at most" or "at least") is dropped where it adds nothing: at most none
    is none, at least all is all. The plural adds "s" to ``noun`` unless ``plural`` is
    given. ``count`` may be a float that holds a whole number (a glued count often is).
    """
    count = _count("count", count)
    total = None if total is None else _count("total", total)
    if total is not None and count > total:
        raise ValueError(f"count {count} is more than total {total}")
    bound = None if bound is None else _bound(bound)
    if not isinstance(noun, str) or not noun:
        raise ValueError(f"noun must be a non-empty str, got {noun!r}")
    plural = plural or noun + "s"
    if count == 0 or (total is not None and count == total):
        bound = None
    prefix = f"{bound} " if bound else ""
    if total is None:
        return f"{prefix}{_words(count)} {noun if count <= 1 else plural}"
    if count == total:
        return f"both {plural}" if total == 2 else f"all {_words(total)} {plural}"
    if count == 0:
        return f"none of the {_words(total)} {plural}"
    return f"{prefix}{_words(count)} of the {_words(total)} {plural}"


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if not (math.isfinite(value) and float(value).is_integer() and value >= 0):
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return int(value)


def percent_phrase(
    fraction,
    *,
    bound: str | None = None,
    decimals=1,
    everything: str = "every time",
    nothing: str = "never",
) -> str:
    """A share (a fraction from 0 to 1) as a percentage, with the extremes said as
    words; a bound is rounded outwards, so it stays true.

    >>> percent_phrase(0.9987, bound="at least"), percent_phrase(1.0, bound="at least")
    ('at least 99.8%', 'every time')
    >>> percent_phrase(0.99996, bound="at least")
    'at least 99.9%'
    >>> percent_phrase(0.0, bound="at most"), percent_phrase(0.0004, bound="at most")
    ('never', 'at most 0.1%')
    >>> percent_phrase(1.0, bound="at least", everything="all")
    'all'
    >>> percent_phrase(0.123)
    '12.3%'

    At least 100% is ``everything`` ("every time", or "all" before "of the ..."), at
    most 0% is ``nothing``; a share just under 1 never prints as "at least 100.0%".
    """
    fraction = _number("fraction", fraction)
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be between 0 and 1, got {fraction!r}")
    decimals = _decimals(decimals)
    if bound is None:
        return f"{fraction * 100:.{decimals}f}%"
    bound = _bound(bound)
    if bound == "at least" and fraction == 1:
        return everything
    if bound == "at most" and fraction == 0:
        return nothing
    outwards = "down" if bound == "at least" else "up"
    percent = _rounded(fraction * 100, decimals, outwards)
    return f"{bound} {percent:.{decimals}f}%"
