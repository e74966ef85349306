"""When a scheduler first loaded each scheduled entry (``job_entries_seen``).

An entry's slots before that moment were never due to anyone: the timeline
(``advisory_lock.scheduling.timeline``) does not call them missed. Each ``run_jobs`` writes
the entries it loads once, at its start (``FirstSeen.note``): one ``INSERT`` of every entry
with the database server's time, the rows already there left as they are (``bulk_create``
with ``ignore_conflicts``: PostgreSQL's ``ON CONFLICT DO NOTHING``, MariaDB's and MySQL's
``INSERT IGNORE``, SQLite's ``INSERT OR IGNORE``), so that the first scheduler's time stays.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterable

from django.db import models

from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field

#: Entries per INSERT: a few hundred rows of two columns keep every backend's statement small.
BATCH_SIZE = 500


class EntrySeen(models.Model):
    """A scheduled entry, and when a scheduler first loaded it."""

    job_name = models.CharField(
        max_length=200, primary_key=True, help_text="The SCHEDULE entry's name."
    )
    first_seen = models.DateTimeField(help_text="By the database server's clock.")

    class Meta:
        db_table = "job_entries_seen"
        verbose_name = "scheduled entry first seen"
        verbose_name_plural = "scheduled entries first seen"

    def __str__(self) -> str:
        return f"{self.job_name} (first seen {self.first_seen:%Y-%m-%d %H:%M:%S})"


class FirstSeen:
    """A scheduler's record of the entries it has loaded: each is written once per
    scheduler, the first time ``note`` sees it (a statement per ``BATCH_SIZE`` new entries;
    none when every entry is already noted)."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.noted: set[str] = set()

    def note(self, job_names: Collection[str], now: Callable[[], datetime.datetime]) -> None:
        """Record ``job_names`` not noted yet as first seen at ``now()`` (aware), unless a
        scheduler saw them before. A scheduler calls this at every pass: when every name is
        noted (after the first pass), a set's check, no list."""
        if self.noted.issuperset(job_names):
            return
        new = [name for name in job_names if name not in self.noted]
        if not new:
            return
        moment = to_field(now())
        EntrySeen.objects.using(self.using).bulk_create(
            [EntrySeen(job_name=name, first_seen=moment) for name in new],
            ignore_conflicts=True,
            batch_size=BATCH_SIZE,
        )
        self.noted.update(new)


def first_seen(using: str, job_names: Iterable[str]) -> dict[str, datetime.datetime]:
    """When a scheduler first loaded each of ``job_names`` (aware, UTC); an entry no
    scheduler has loaded yet is left out."""
    names = list(job_names)
    seen: dict[str, datetime.datetime] = {}
    for start in range(0, len(names), BATCH_SIZE):
        rows = EntrySeen.objects.using(using).filter(
            job_name__in=names[start : start + BATCH_SIZE]
        )
        seen.update((row.job_name, from_field(row.first_seen)) for row in rows)
    return seen
