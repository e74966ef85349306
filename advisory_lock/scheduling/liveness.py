"""Scheduler liveness, a dead-man's switch: each ``run_jobs`` keeps a heartbeat row.

A scheduler inserts its row (``job_schedulers``: host, pid, started, last seen, version) when
it starts and sets ``last_seen`` to the database server's clock every ``heartbeat_interval()``
seconds (``ADVISORY_LOCK["SCHEDULER_HEARTBEAT"]``, 5) while it runs: one UPDATE. A scheduler
is alive while its ``last_seen`` is less than ``live_within()`` (3 heartbeats) old: one that
was SIGKILLed, lost its host or can't reach the database stops counting within that time, and
nothing has to clean up after it. Rows of schedulers not seen for ``FORGET_AFTER`` are
deleted by the others, so the table stays small while it still tells since when none is
alive. Every process of the fleet (the schedulers, ``run_jobs --check``, the admin) must read
the same setting: the window is computed by the one that asks.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import socket

from django.db import connections
from django.db import models

from advisory_lock.backends import inspector_for
from advisory_lock.conf import get_setting
from advisory_lock.conf import require_app
from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field
from advisory_lock.validation import check_seconds

#: Seconds between two looks at run-now requests and task ends (``run_jobs --poll-interval``).
POLL_INTERVAL = 1.0
#: The longest heartbeat interval: a dead scheduler still stops counting within 3 hours.
MAX_HEARTBEAT = 3600.0
#: Rows of schedulers not seen for this long are deleted.
FORGET_AFTER = datetime.timedelta(days=7)


def heartbeat_interval() -> float:
    """``ADVISORY_LOCK["SCHEDULER_HEARTBEAT"]``: seconds between two heartbeats (ValueError,
    which says why, if it is not a number of seconds in (0, ``MAX_HEARTBEAT``])."""
    return check_seconds(
        "ADVISORY_LOCK['SCHEDULER_HEARTBEAT']",
        get_setting("SCHEDULER_HEARTBEAT"),
        allow_zero=False,
        maximum=MAX_HEARTBEAT,
    )


def live_within() -> datetime.timedelta:
    """A scheduler seen less than this long ago is alive: 3 heartbeat intervals, so that one
    late heartbeat (a slow pass, a slow database) does not make a live scheduler look dead."""
    return datetime.timedelta(seconds=3 * heartbeat_interval())


def _version() -> str:
    try:
        return importlib.metadata.version("django-advisory-lock")
    except importlib.metadata.PackageNotFoundError:
        return ""


# Django defines a model of an installed app only: without the app, say what to do.
require_app()


class SchedulerHeartbeat(models.Model):
    """One ``run_jobs`` process, and when it was last seen."""

    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.DateTimeField(help_text="By the database server's clock.")
    last_seen = models.DateTimeField(help_text="By the database server's clock.")
    version = models.CharField(max_length=64, blank=True)

    class Meta:
        db_table = "job_schedulers"
        verbose_name = "scheduler heartbeat"
        ordering = ["-last_seen"]
        indexes = [models.Index(fields=["-last_seen"], name="job_schedulers_seen_idx")]

    def __str__(self) -> str:
        return f"run_jobs pid {self.pid} on {self.host}"

    def as_dict(self) -> dict[str, object]:
        return {
            "host": self.host,
            "pid": self.pid,
            "started": from_field(self.started_at).isoformat(),
            "last_seen": from_field(self.last_seen).isoformat(),
        }


def _now(using: str) -> datetime.datetime:
    return inspector_for(connections[using]).database_now()


class Heartbeat:
    """The heartbeat of this scheduler process on the ledger's database ``using``."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.row: SchedulerHeartbeat | None = None

    def beat(self, server_now: datetime.datetime) -> None:
        """Record that this scheduler is alive at ``server_now`` (the database server's clock,
        which the caller has just read): one UPDATE of its row, inserted again if deleted."""
        rows = SchedulerHeartbeat.objects.using(self.using)
        now = to_field(server_now)  # as the row holds it
        if self.row is not None and rows.filter(pk=self.row.pk).update(last_seen=now):
            self.row.last_seen = now
            return
        started = now if self.row is None else self.row.started_at
        self.row = rows.create(
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=started,
            last_seen=now,
            version=_version(),
        )

    def forget_the_dead(self, server_now: datetime.datetime) -> None:
        """Delete the rows of schedulers not seen for ``FORGET_AFTER`` before ``server_now``."""
        old = server_now - FORGET_AFTER
        SchedulerHeartbeat.objects.using(self.using).filter(last_seen__lt=to_field(old)).delete()


def live_schedulers(
    using: str, server_now: datetime.datetime | None = None
) -> list[SchedulerHeartbeat]:
    """The schedulers seen within ``live_within()``, the latest seen first; ``server_now``:
    the database server's clock, if the caller knows it (else it is read)."""
    since = (server_now or _now(using)) - live_within()
    return list(SchedulerHeartbeat.objects.using(using).filter(last_seen__gte=to_field(since)))


def last_seen(using: str) -> datetime.datetime | None:
    """When a scheduler was last seen, or None if none ever was (or not for a week)."""
    latest = SchedulerHeartbeat.objects.using(using).order_by("-last_seen").first()
    return None if latest is None else from_field(latest.last_seen)


def no_scheduler_alive(using: str) -> str:
    """The line that says since when no scheduler is alive."""
    seen = last_seen(using)
    if seen is None:
        return "no scheduler alive: none has run on this database in the last 7 days"
    return f"no scheduler alive since {seen.isoformat()} (the last heartbeat)"
