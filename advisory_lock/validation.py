"""Argument checks shared by the lock, single-instance commands, the ledger and the commands.

Each raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value out of
range, naming the argument, before any SQL runs (the commands' options: ``CommandError``).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from numbers import Real

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS
from django.db import connections

from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import NotSupportedError

#: The longest duration of a schedule or a declared job (``every``, ``grace``, ``timeout``):
#: a century. A date that far from now is still a valid ``datetime`` (whose years end at
#: 9999), and the slots before it are too; ``1e300`` is a float, but no ``timedelta``.
MAX_SECONDS = 36_500 * 86_400


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


def check_seconds(
    name: str, value: object, *, allow_zero: bool = True, maximum: float | None = None
) -> float:
    """A finite number of seconds, ``>= 0`` (``> 0`` unless ``allow_zero``), and at most
    ``maximum`` when given (``MAX_SECONDS`` for what becomes a timedelta or a date)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}.")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}.")
    if maximum is not None and seconds > maximum:
        why = ""
        if maximum == MAX_SECONDS:
            why = " (a century: a date that far from now can still be computed)"
        raise ValueError(f"{name} must be at most {maximum:.0f} seconds{why}, not {value!r}.")
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


def check_text(name: str, value: object, *, max_length: int | None = None) -> str:
    """A str that every database can store and compare, within ``max_length`` characters.

    PostgreSQL's text can't hold NUL, and no database driver can encode a lone surrogate
    (which is what Python makes of bytes that are not UTF-8, e.g. on a command line): both
    would fail in the driver, or be stored on one database and not on another. Raises
    ``TypeError`` for a value that is not a str, ``ValueError`` naming ``name`` otherwise.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__} ({value!r}).")
    shown = repr(value) if len(value) <= 60 else f"{value[:40]!r}..."
    if "\x00" in value:
        raise ValueError(
            f"{name} {shown} contains NUL (\\x00), which PostgreSQL text can't hold; remove it."
        )
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{name} {shown} contains a lone surrogate ({value[error.start]!r}), which "
                f"can't be encoded as UTF-8: it comes from bytes that are not UTF-8 (e.g. on "
                f"a command line). Pass UTF-8 text."
            ) from None
    if max_length is not None and len(value) > max_length:
        raise ValueError(
            f"{name} {shown} is {len(value)} characters long; the ledger's column holds "
            f"{max_length}."
        )
    return value


def check_database(using: object) -> str:
    """A database alias of ``DATABASES`` (``None`` or "" means "default"): ``ValueError``
    naming the configured ones otherwise."""
    alias = check_alias(using)
    if alias not in connections.settings:
        configured = ", ".join(map(repr, connections.settings)) or "none"
        raise ValueError(
            f"{alias!r} is not a database alias: DATABASES has {configured}. Pass one of "
            f"those, or add {alias!r} to DATABASES."
        )
    return alias


def check_wait(name: str, seconds: float, backend: LockBackend) -> None:
    """Raise ``ValueError`` if ``seconds`` is a bounded wait longer than ``backend``'s database
    accepts (``max_timeout``), naming the maximum (0 tries once: no bound)."""
    maximum = backend.max_timeout
    if seconds and maximum is not None and seconds > maximum:
        raise ValueError(
            f"{name}={seconds!r} is longer than {backend.describe()} can wait: at most "
            f"{maximum} seconds. Pass a shorter wait, or 0 to skip at once when the lock is "
            f"busy."
        )


def wait_limit(name: str, seconds: float, using: str | None) -> None:
    """``check_wait`` for a wait on ``using``'s database, if its backend can be known now (the
    alias is configured, settings are ready); else nothing: the wait is checked before the
    lock is taken. Single-instance runs lock through the alias's ``DIRECT_ALIAS``."""
    if not seconds:
        return
    try:
        alias = check_alias(using)
        alias = get_setting("DIRECT_ALIAS").get(alias, alias)
        if alias not in connections.settings:
            return
        backend = backend_for(connections[alias])
    except (ImproperlyConfigured, NotSupportedError, AttributeError, TypeError):
        return  # settings not ready, or no lock support: said when the lock is taken
    check_wait(name, seconds, backend)


# The options of the management commands: a CommandError (exit status 2, as argparse's usage
# errors) naming the option, never a traceback from the database or its driver.


def database_option(option: str, using: object) -> str:
    """``check_database`` for a command's option (``--database``, ``--using``)."""
    try:
        return check_database(using)
    except (TypeError, ValueError) as error:
        raise CommandError(f"{option} {error}", returncode=2) from None


def text_option(option: str, value: object, *, max_length: int) -> None:
    """``check_text`` for a command's option that is compared with a ledger's column (``None``:
    not given)."""
    if value is not None:
        try:
            check_text(option, value, max_length=max_length)
        except (TypeError, ValueError) as error:
            raise CommandError(str(error), returncode=2) from None
