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


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def token_count(text: str) -> int:
    """A count of tokens, also as vLLM writes them: 32k (32,000), 32K (32,768), 1.5m."""
    scale = _SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale if scale > 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a count of tokens such as 4096, 32k or "
                                         f"32K, got {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"must be a whole count of tokens, got {text!r}")
    return int(value)


def available_device(text: str) -> str:
    """A device this machine has, for the benchmarks that use one without an engine."""
    try:
        check_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
