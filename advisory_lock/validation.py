"""Argument checks shared by the lock, single-instance commands, the ledger and the commands.

Each raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value out of
range, naming the argument, before any SQL runs.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from numbers import Real

from django.db import DEFAULT_DB_ALIAS


def check_alias(using: object) -> str:
    """A database alias (``None`` or "" means "default"); whether it exists is Django's to
    say."""
    if using is None or using == "":
        return DEFAULT_DB_ALIAS
    if not isinstance(using, str):
        raise TypeError(f"using must be a database alias (str) or None, not {using!r}.")
    return using


def check_flag(name: str, value: object) -> bool:
    """``True`` or ``False`` exactly: ``wait=1`` or ``shared=None`` is a mistake, not a flag."""
    if value is not True and value is not False:
        raise TypeError(f"{name} must be True or False, not {value!r}.")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool = True) -> float:
    """A finite number of seconds, ``>= 0`` (``> 0`` unless ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}.")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}.")
    return seconds


_SECONDS_TEXT = re.compile(r"[+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def seconds_argument(text: str) -> float:
    """An argparse ``type``: seconds written in ASCII digits (``float()`` also reads " 1",
    "1_0" and other scripts' digits, which a command line should not)."""
    if not _SECONDS_TEXT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    try:
        return check_seconds("the value", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a finite number of seconds >= 0"
        ) from None


def whole_number_argument(maximum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of ASCII digits from 1 to ``maximum``."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()):  # int() reads any script's digits
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number.")
        value = int(text)
        if not 1 <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text!r} must be from 1 to {maximum}.")
        return value

    return parse
