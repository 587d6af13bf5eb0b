"""argparse value types that hold a flag to its range, so that a value outside it is refused
by name before anything runs (`argument --runs: must be >= 1, got 0`) rather than failing
deep inside a benchmark."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kvserve.devices import check_device


def _ranged(kind: type, low: float, inclusive: bool, high: float | None = None
            ) -> Callable[[str], float]:
    lower = f">= {low}" if inclusive else f"> {low}"
    bound = lower if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> float:
        value = kind(text)
        too_low = value < low or (value == low and not inclusive)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


positive_int = _ranged(int, 1, inclusive=True)  # counts, lengths, sizes
at_least_two = _ranged(int, 2, inclusive=True)  # lengths that a rate is taken over
non_negative_int = _ranged(int, 0, inclusive=True)  # where 0 means none or off
positive_float = _ranged(float, 0.0, inclusive=False)  # rates, seconds
non_negative_float = _ranged(float, 0.0, inclusive=True)  # temperatures
fraction = _ranged(float, 0.0, inclusive=True, high=1.0)  # shares of a whole
port = _ranged(int, 0, inclusive=True, high=65535)


def available_device(text: str) -> str:
    """A device this machine has, for the benchmarks that use one without an engine."""
    try:
        check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
