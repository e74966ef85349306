"""The lock directory's tables: ``lock_names`` (which name a database key stands for) and
``lock_clients`` (which client process a server session belongs to), written by the holders
(``advisory_lock.directory``), read by the inspector (``advisory_lock.inspection``).

A session id is the server's: PostgreSQL's backend pid, MySQL's connection id. Either may
name another session later (a pid is reused, a restarted server counts connections from 1
again), so a row keeps when its session began as the server told the writer
(``LockInspector.session_started``), and is believed only while the session with that id
began then. Rows of sessions that have ended are pruned by the writer now and then.
"""

from __future__ import annotations

from time import monotonic

from django.db import connections
from django.db import models
from django.db import transaction

from advisory_lock.backends import inspector_for
from advisory_lock.conf import require_app
from advisory_lock.directory import NameNote
from advisory_lock.directory import SessionNote
from advisory_lock.directory import Tables
from advisory_lock.directory import install
from advisory_lock.own_connection import table_checked

require_app()  # before the models: Django can only define a model of an installed app

#: Seconds between two prunes of ``lock_clients`` by one process, per alias.
PRUNE_EVERY = 600.0
_pruned: dict[str, float] = {}


class LockName(models.Model):
    """The string key that a database key stands for."""

    #: ``str()`` of the database's key: PostgreSQL's bigint or int pair, MySQL's lock name.
    key = models.CharField(max_length=255, primary_key=True)
    name = models.TextField()
    namespace = models.CharField(max_length=64)

    class Meta:
        app_label = "advisory_lock"
        db_table = "lock_names"
        verbose_name = "lock name"

    def __str__(self) -> str:
        return f"{self.key}: {self.name}"


class LockClient(models.Model):
    """The client process (host name, OS pid) of a server session that took locks."""

    #: PostgreSQL's backend pid, MySQL's connection id.
    session = models.BigIntegerField(primary_key=True)
    #: When the session began, as its server tells (``LockInspector.session_started``).
    started = models.BigIntegerField()
    host = models.CharField(max_length=255)
    pid = models.BigIntegerField()

    class Meta:
        app_label = "advisory_lock"
        db_table = "lock_clients"
        verbose_name = "lock client"

    def __str__(self) -> str:
        return f"session {self.session}: process {self.pid} on {self.host}"


def record(using: str, names: list[NameNote], sessions: list[SessionNote]) -> None:
    """Write what the holders noted, on this thread's connection to ``using`` (a connection
    of the directory's writer thread, in autocommit), then close it. ``LedgerNotMigrated``
    if a write failed because the app's tables are missing there."""
    connection = connections[using]
    try:
        with table_checked(using):
            if names:
                LockName.objects.using(using).bulk_create(
                    [LockName(key=n.key[:255], name=n.name, namespace=n.namespace) for n in names],
                    ignore_conflicts=True,
                )
            if sessions:
                inspector = inspector_for(connection)
                started = inspector.session_started([note.session for note in sessions])
                rows = [
                    LockClient(
                        session=note.session,
                        started=started[note.session],
                        host=note.host[:255],
                        pid=note.pid,
                    )
                    for note in sessions
                    if note.session in started  # a session gone already needs no row
                ]
                if rows:
                    _upsert(using, rows)
                # Not at a process's first write (job processes come and go): every PRUNE_EVERY
                # seconds of a process that lives that long.
                if _pruned.setdefault(using, monotonic()) < monotonic() - PRUNE_EVERY:
                    _pruned[using] = monotonic()
                    _prune(using, inspector.session_started(None))
    finally:
        connection.close()


def _upsert(using: str, rows: list[LockClient]) -> None:
    features = connections[using].features
    unique = ["session"] if features.supports_update_conflicts_with_target else None
    LockClient.objects.using(using).bulk_create(
        rows,
        update_conflicts=True,
        unique_fields=unique,
        update_fields=["started", "host", "pid"],
    )


def _prune(using: str, live: dict[int, int]) -> None:
    """Delete the rows of sessions that have ended (``live``: every session now)."""
    clients = LockClient.objects.using(using)
    with transaction.atomic(using=using):
        ended = [
            session
            for session, started in clients.values_list("session", "started")
            if not _same(live.get(session), started)
        ]
        for start in range(0, len(ended), 500):
            clients.filter(session__in=ended[start : start + 500]).delete()


def _same(now: int | None, recorded: int) -> bool:
    # MySQL's start is computed from two clocks read a moment apart: it may be a second off.
    return now is not None and abs(now - recorded) <= 1


def names(using: str, keys: list[str]) -> dict[str, str]:
    """``{str(db_key): name}`` of the keys of ``keys`` that the directory knows."""
    found: dict[str, str] = {}
    rows = LockName.objects.using(using)
    for start in range(0, len(keys), 500):
        found.update(rows.filter(key__in=keys[start : start + 500]).values_list("key", "name"))
    return found


def clients(using: str, started: dict[int, int]) -> dict[int, tuple[str, int]]:
    """``{session: (host, pid)}`` of the sessions of ``started`` (``{session: when it began,
    now}``) that the directory knows, if the row is of that very session."""
    found = {}
    sessions = list(started)
    rows = LockClient.objects.using(using)
    for start in range(0, len(sessions), 500):
        chunk = sessions[start : start + 500]
        for session, began, host, pid in rows.filter(session__in=chunk).values_list(
            "session", "started", "host", "pid"
        ):
            if _same(started.get(session), began):
                found[session] = (host, pid)
    return found


install(Tables(write=record, names_table=LockName._meta.db_table, names=names, clients=clients))
