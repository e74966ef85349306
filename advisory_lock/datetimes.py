"""Datetimes between the app's logic and Django's ``DateTimeField`` columns, whatever
``USE_TZ`` says.

The app computes with aware datetimes: the database server's clock (``database_now()``, aware
UTC), slots in the ledger's time zone, a queue's end times. Django's rule for a
``DateTimeField`` (its "Time zones" documentation): with ``USE_TZ = True`` it takes and gives
aware datetimes; with ``USE_TZ = False`` naive ones, the wall time in ``TIME_ZONE`` (the
default time zone). Then its SQLite, MySQL and Oracle backends refuse an aware datetime
(``ValueError``), and every backend reads values back naive: PostgreSQL in its session's time
zone, which Django sets to ``TIME_ZONE``, the others as stored. So every datetime that goes
into a model field or a query goes through ``to_field()``, and every one read from a field
that is computed with or shown goes through ``from_field()``.

With ``USE_TZ = False`` a wall time of the hour that repeats when DST ends in ``TIME_ZONE``
is ambiguous: Django stores both passes alike, and ``from_field()`` reads it as the first.
"""

from __future__ import annotations

import datetime

from django.conf import settings
from django.utils import timezone

UTC = datetime.timezone.utc


def to_field(moment: datetime.datetime) -> datetime.datetime:
    """What a ``DateTimeField`` (a model's, a lookup's) takes for the aware ``moment``:
    itself with ``USE_TZ``, else its naive wall time in ``TIME_ZONE``."""
    if settings.USE_TZ:
        return moment
    return timezone.make_naive(moment, timezone.get_default_timezone())


def from_field(value: datetime.datetime) -> datetime.datetime:
    """The instant that a ``DateTimeField``'s ``value`` stands for, aware, in UTC: a naive
    value (``USE_TZ = False``) is a wall time in ``TIME_ZONE``."""
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    return value.astimezone(UTC)


def shown(value: datetime.datetime | None) -> str:
    """How the admin shows every time: in the current time zone (``TIME_ZONE``, or the one
    activated), to the second, without the zone (each page names it once: ``shown_zone``).
    ``value`` is a field's (naive without ``USE_TZ``) or an aware datetime; None is "—"."""
    if value is None:
        return "—"
    return f"{timezone.localtime(from_field(value)):%Y-%m-%d %H:%M:%S}"


def shown_zone() -> str:
    """The time zone of the times that ``shown`` gives."""
    return timezone.get_current_timezone_name()
