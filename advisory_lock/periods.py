"""Ledger periods: which slot a run belongs to, computed from the database server's clock."""

from __future__ import annotations

import datetime
import zoneinfo
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from advisory_lock.conf import get_setting
from advisory_lock.validation import check_text

Period = str | Callable[[datetime.datetime], str]
PERIODS = ("once", "hourly", "daily", "weekly", "monthly")
MAX_PERIOD_LENGTH = 64
MAX_JOB_NAME_LENGTH = 200


def check_job_name(job_name: object, name: str = "job_name") -> str:
    """Return ``job_name`` if it is a usable job name (non-blank text the ledger's column
    holds: see ``check_text``); raise TypeError or ValueError naming it ``name``."""
    text = check_text(name, job_name, max_length=MAX_JOB_NAME_LENGTH)
    if not text.strip():
        raise ValueError(f"{name} must be a non-blank string.")
    return text


def check_period(period: object) -> Period:
    """Return ``period`` if it is a known period name or a callable; else raise."""
    if callable(period):
        return period
    if not isinstance(period, str):
        raise TypeError(f"period must be one of {PERIODS} or a callable, not {period!r}.")
    if period not in PERIODS:
        raise ValueError(f"Unknown period {period!r}: use one of {PERIODS}, or a callable.")
    return period


def ledger_time_zone() -> zoneinfo.ZoneInfo:
    """``ADVISORY_LOCK["LEDGER_TIME_ZONE"]``, else ``TIME_ZONE``, else UTC."""
    name = get_setting("LEDGER_TIME_ZONE") or settings.TIME_ZONE or "UTC"
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, TypeError):
        raise ImproperlyConfigured(
            f"ADVISORY_LOCK['LEDGER_TIME_ZONE'] / TIME_ZONE {name!r} is not a known time zone."
        ) from None


def slot(period: Period, now: datetime.datetime) -> str:
    """The slot of ``now`` (aware) for ``period``, in the ledger's time zone.

    Hourly slots name the local hour; the hour that repeats when DST ends gets its UTC
    offset appended the second time (e.g. ``2026-11-01T01-0500``), so it is a slot of its own.
    """
    local = now.astimezone(ledger_time_zone())
    if callable(period):
        value = period(local)
        try:
            check_text("slot", value, max_length=MAX_PERIOD_LENGTH)
            if not value.strip():
                raise ValueError(f"slot {value!r} is blank.")
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"The period callable {period!r} must return a non-blank str of at most "
                f"{MAX_PERIOD_LENGTH} characters that every database can store: {error}"
            ) from None
        return value
    if period == "once":
        return "once"
    if period == "hourly":
        return f"{local:%Y-%m-%dT%H}" + (f"{local:%z}" if local.fold else "")
    if period == "daily":
        return f"{local:%Y-%m-%d}"
    if period == "weekly":
        year, week, _ = local.isocalendar()
        return f"{year}-W{week:02d}"
    return f"{local:%Y-%m}"
