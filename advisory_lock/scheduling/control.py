"""Operators' requests to the scheduled jobs: pause, resume, run now (``job_controls``); and
the changes of the stored entries.

Each request is a row, kept: the table is the entries' history as well as their state, on the
ledger's database, so that it holds fleet-wide and across restarts. Every time is the database
server's, as in the ledger.

- **Pause / resume.** An entry is paused when its latest pause or resume row is a pause.
  Schedulers start no slot of a paused entry, and none that *fell due* while it was paused,
  even after the resume: those slots are ``paused``, not missed (``fell_due_while_paused``).
  A run already going when the pause comes finishes.
- **Run now.** A row naming a slot of its own, ``manual:<the request's time>`` (to the second,
  in the ledger's time zone: two clicks in one second ask for one run). The request is
  pending while the ledger has no attempt at that slot; every live scheduler sees it at its
  next poll and starts a job process for it, whose claim lets one of them in (as for any
  slot). A request is refused when no scheduler is alive (``advisory_lock.scheduling.liveness``):
  nobody would run it, and a scheduler started days later should not.
- **A change of a stored entry** (``scheduling.stored``: saved or deleted): a row too,
  committed with the change. The live schedulers' look for run-now requests finds the rows of
  the changes too, in the same statement (``pending_requests``), and they read the stored
  entries again: a change costs an idle scheduler no statement of its own.
"""

from __future__ import annotations

import datetime
import getpass
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from django.db import connections
from django.db import models
from django.db import transaction
from django.db.models import OuterRef
from django.db.models import Subquery

from advisory_lock.backends import inspector_for
from advisory_lock.datetimes import from_field
from advisory_lock.datetimes import to_field
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.ledger import JobRun
from advisory_lock.periods import ledger_time_zone
from advisory_lock.row_reads import Names
from advisory_lock.row_reads import placeholders
from advisory_lock.scheduling.liveness import live_schedulers
from advisory_lock.scheduling.liveness import no_scheduler_alive
from advisory_lock.scheduling.notifications import CONTROL
from advisory_lock.scheduling.notifications import SCHEDULE_CHANGED
from advisory_lock.scheduling.notifications import notify
from advisory_lock.validation import check_text

#: A run-now slot's name starts with this.
MANUAL = "manual:"
#: A run-now request older than this is not run any more (its requester has long given up).
REQUEST_EXPIRES = datetime.timedelta(hours=1)
#: The longest reason an operator can give for a request (``JobControl.reason``).
MAX_REASON_LENGTH = 500
#: How long after its row was stamped a change of a stored entry may commit and still be
#: found by the look for requests (``pending_requests``): a row is stamped with the database's
#: clock in the change's transaction, before it commits.
CHANGE_MARGIN = datetime.timedelta(minutes=1)


class NoSchedulerAlive(AdvisoryLockError):
    """A run-now request was refused: no ``run_jobs`` is alive to run it."""


class JobControl(models.Model):
    """One operator's request about a scheduled entry: pause, resume or run now."""

    class Action(models.TextChoices):
        PAUSE = "pause", "pause"
        RESUME = "resume", "resume"
        RUN_NOW = "run_now", "run now"
        CHANGE = "change", "change of a stored entry"

    job_name = models.CharField(max_length=200, help_text="The SCHEDULE entry's name.")
    action = models.CharField(max_length=16, choices=Action.choices)
    requested_at = models.DateTimeField(help_text="By the database server's clock.")
    requested_by = models.CharField(max_length=255, blank=True)
    slot = models.CharField(
        max_length=64, blank=True, help_text="Run now: the ledger slot of the run."
    )
    reason = models.CharField(
        max_length=MAX_REASON_LENGTH, blank=True, help_text="Why, in the operator's words."
    )

    class Meta:
        db_table = "job_controls"
        verbose_name = "job control"
        ordering = ["-requested_at", "-pk"]
        indexes = [
            models.Index(fields=["job_name", "action", "-requested_at"], name="job_controls_idx"),
            # The look for requests (``pending_requests``), several a second in a fleet: the
            # recent rows of two actions, of every job; the table keeps every request.
            models.Index(fields=["action", "requested_at"], name="job_controls_pending_idx"),
        ]
        permissions = [
            ("pause_job", "Can pause and resume scheduled jobs"),
            ("run_job_now", "Can run a scheduled job now"),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.job_name} ({self.requested_at:%Y-%m-%d %H:%M:%S})"


Action = JobControl.Action
_PAUSE_OR_RESUME = (Action.PAUSE, Action.RESUME)


@dataclass(frozen=True)
class Pause:
    """A span during which an entry was paused: ``until`` is None while it still is."""

    since: datetime.datetime
    until: datetime.datetime | None

    def covers(self, moment: datetime.datetime) -> bool:
        return self.since <= moment and (self.until is None or moment < self.until)


def command_line_user() -> str:
    """Who asked, from a command line: the OS user, host and pid."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()} (pid {os.getpid()})"


def _now(using: str) -> datetime.datetime:
    return inspector_for(connections[using]).database_now()


def _latest_switch(using: str, job_name: str) -> JobControl | None:
    return (
        JobControl.objects.using(using)
        .filter(job_name=job_name, action__in=_PAUSE_OR_RESUME)
        .order_by("-requested_at", "-pk")
        .first()
    )


def is_paused(using: str, job_name: str) -> bool:
    latest = _latest_switch(using, job_name)
    return latest is not None and latest.action == Action.PAUSE


def paused_entries(using: str, job_names: Iterable[str]) -> set[str]:
    """Which of ``job_names`` are paused now."""
    return {name for name in job_names if is_paused(using, name)}


def check_reason(reason: str) -> str:
    """``reason`` as a request stores it (stripped); ``ValueError`` if the column can't hold
    it (longer than ``MAX_REASON_LENGTH``, or a NUL, which PostgreSQL refuses in text)."""
    check_text("the reason", reason, max_length=MAX_REASON_LENGTH)
    return reason.strip()


def latest_pauses(using: str, job_names: Iterable[str]) -> dict[str, JobControl]:
    """The pause row of each of ``job_names`` that is paused now (who, when and why), in one
    statement: the latest pause or resume of each job (a subquery per job), kept if a pause."""
    latest = (
        JobControl.objects.using(using)
        .filter(job_name=OuterRef("job_name"), action__in=_PAUSE_OR_RESUME)
        .order_by("-requested_at", "-pk")
        .values("pk")[:1]
    )
    rows = JobControl.objects.using(using).filter(
        job_name__in=list(job_names), action=Action.PAUSE, pk=Subquery(latest)
    )
    return {row.job_name: row for row in rows}


def set_paused(
    using: str, job_name: str, paused: bool, requested_by: str, reason: str = ""
) -> JobControl | None:
    """Pause or resume ``job_name``; return the new row, or None if it already was so."""
    reason = check_reason(reason)
    if is_paused(using, job_name) == paused:
        return None
    with transaction.atomic(using=using):
        switch = JobControl.objects.using(using).create(
            job_name=job_name,
            action=Action.PAUSE if paused else Action.RESUME,
            requested_at=to_field(_now(using)),
            requested_by=requested_by,
            reason=reason,
        )
        notify(using, CONTROL, job_name)  # heard when the row is committed
    return switch


def pauses(using: str, job_name: str, since: datetime.datetime) -> list[Pause]:
    """The spans during which ``job_name`` was paused, from ``since`` on, oldest first."""
    switches = JobControl.objects.using(using).filter(
        job_name=job_name, action__in=_PAUSE_OR_RESUME
    )
    stored = to_field(since)
    before = switches.filter(requested_at__lte=stored).order_by("-requested_at", "-pk").first()
    later = switches.filter(requested_at__gt=stored).order_by("requested_at", "pk")
    paused_since = since if before is not None and before.action == Action.PAUSE else None
    return _spans(paused_since, list(later))


def pauses_of(
    using: str, job_names: list[str], since: datetime.datetime
) -> dict[str, list[Pause]]:
    """``pauses()`` of each job of ``job_names`` from ``since`` on, in one statement: the
    last switch of each at or before ``since`` (a subquery per job), and the later ones.
    Asked at every batch of due slots: written as SQL (``row_reads``), read through
    ``QuerySet.raw()``, which converts the times as the ORM does."""
    if not job_names:
        return {}
    connection = connections[using]
    controls = Names(JobControl, connection)
    inner = connection.ops.quote_name("last_switch")
    table, name, action, at, pk = (
        controls.table,
        controls["job_name"],
        controls["action"],
        controls["requested_at"],
        controls["pk"],
    )
    field_since = to_field(since)
    stored = controls.param("requested_at", field_since)
    sql = (
        f"SELECT {pk}, {name}, {action}, {at} FROM {table} "
        f"WHERE {name} IN ({placeholders(len(job_names))}) AND {action} IN (%s, %s) "
        f"AND ({at} > %s OR {pk} = (SELECT {inner}.{pk} FROM {table} AS {inner} "
        f"WHERE {inner}.{name} = {table}.{name} AND {inner}.{action} IN (%s, %s) "
        f"AND {inner}.{at} <= %s ORDER BY {inner}.{at} DESC, {inner}.{pk} DESC LIMIT 1)) "
        f"ORDER BY {at}, {pk}"
    )
    switches = [kind.value for kind in _PAUSE_OR_RESUME]
    params = [*job_names, *switches, stored, *switches, stored]
    paused_at_since: set[str] = set()
    later: dict[str, list[JobControl]] = {}
    for switch in JobControl.objects.using(using).raw(sql, params):
        if switch.requested_at > field_since:
            later.setdefault(switch.job_name, []).append(switch)
        elif switch.action == Action.PAUSE:
            paused_at_since.add(switch.job_name)
    spans: dict[str, list[Pause]] = {}
    for name in paused_at_since | set(later):
        spans[name] = _spans(since if name in paused_at_since else None, later.get(name, []))
    return spans


def _spans(paused_since: datetime.datetime | None, later: list[JobControl]) -> list[Pause]:
    spans: list[Pause] = []
    for switch in later:
        if switch.action == Action.PAUSE and paused_since is None:
            paused_since = from_field(switch.requested_at)
        elif switch.action == Action.RESUME and paused_since is not None:
            spans.append(Pause(paused_since, from_field(switch.requested_at)))
            paused_since = None
    if paused_since is not None:
        spans.append(Pause(paused_since, None))
    return spans


def fell_due_while_paused(using: str, job_name: str, due: datetime.datetime) -> bool:
    """Was ``job_name`` paused at the instant ``due``?"""
    return any(span.covers(due) for span in pauses(using, job_name, due))


def manual_slot(moment: datetime.datetime) -> str:
    """The slot of a run-now request made at ``moment``."""
    local = moment.astimezone(ledger_time_zone()).replace(microsecond=0)
    return MANUAL + local.isoformat()


def request_run(using: str, job_name: str, requested_by: str, reason: str = "") -> JobControl:
    """Ask the live schedulers to run ``job_name`` once now, in a slot of its own; raise
    ``NoSchedulerAlive`` (and record nothing) if none is alive."""
    reason = check_reason(reason)
    if not live_schedulers(using):
        raise NoSchedulerAlive(
            f"{no_scheduler_alive(using)}: nobody would run {job_name!r}, so it was not "
            f"requested. Start 'manage.py run_jobs' on an instance, then ask again."
        )
    now = _now(using)
    with transaction.atomic(using=using):
        request = JobControl.objects.using(using).create(
            job_name=job_name,
            action=Action.RUN_NOW,
            requested_at=to_field(now),
            requested_by=requested_by,
            slot=manual_slot(now),
            reason=reason,
        )
        notify(using, CONTROL, job_name)  # heard when the row is committed
    return request


def record_change(using: str, job_name: str) -> JobControl:
    """Record that the stored entry ``job_name`` was saved or deleted, and announce it: both
    committed with the caller's transaction (at once in autocommit)."""
    row = JobControl.objects.using(using).create(
        job_name=job_name, action=Action.CHANGE, requested_at=to_field(_now(using))
    )
    notify(using, SCHEDULE_CHANGED, job_name)  # heard when the row is committed
    return row


def run_going_on(using: str, job_name: str) -> JobRun | None:
    """The latest run of ``job_name`` that the ledger shows going on (``running``), or None:
    a run-now request's run waits for its lock, so it starts when that run ends."""
    return (
        JobRun.objects.using(using)
        .filter(job_name=job_name, status=JobRun.Status.RUNNING)
        .order_by("-started_at", "-pk")
        .first()
    )


class Request(NamedTuple):
    """A pending run-now request, or a change of a stored entry, as ``pending_requests``
    reads it: what a scheduler acts on, no model instance."""

    pk: int
    action: str
    job_name: str
    slot: str


def pending_requests(
    using: str, now: datetime.datetime, changes_since: datetime.datetime | None = None
) -> list[Request]:
    """The run-now requests whose slot has no attempt yet (at most ``REQUEST_EXPIRES``
    old), and with ``changes_since`` the changes of stored entries stamped since then,
    oldest first: one statement (``row_reads``: several a second in a fleet). Of every
    job: there are few, and the scheduler keeps those of its idle entries; with the
    changes' condition, which names no job, the database could not serve it from the
    index on the names anyway."""
    connection = connections[using]
    controls, runs = Names(JobControl, connection), Names(JobRun, connection)
    at = controls["requested_at"]
    wanted = (
        f"({controls['action']} = %s AND {at} >= %s AND NOT EXISTS ("
        f"SELECT 1 FROM {runs.table} WHERE {runs.table}.{runs['job_name']} = "
        f"{controls.table}.{controls['job_name']} AND {runs.table}.{runs['period']} = "
        f"{controls.table}.{controls['slot']}))"
    )
    params = [
        Action.RUN_NOW.value,
        controls.param("requested_at", to_field(now - REQUEST_EXPIRES)),
    ]
    if changes_since is not None:
        wanted += f" OR ({controls['action']} = %s AND {at} >= %s)"
        params += [Action.CHANGE.value, controls.param("requested_at", to_field(changes_since))]
    columns = ", ".join(controls[field] for field in Request._fields)
    sql = f"SELECT {columns} FROM {controls.table} WHERE {wanted} ORDER BY {at}, {controls['pk']}"
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return [Request(*row) for row in cursor.fetchall()]
