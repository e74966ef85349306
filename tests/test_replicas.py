"""Locks on a replica refuse, loudly: a PostgreSQL hot standby grants advisory locks and a
read-only MariaDB grants GET_LOCK, but those locks exclude nobody on the primary.

The contract (``advisory_lock.ReplicaError``, a subclass of ``AdvisoryLockError`` and of
Django's ``ImproperlyConfigured``): before any lock is granted, once per driver connection,
the backend asks ``SELECT pg_is_in_recovery()`` / ``SELECT @@global.read_only``; when true,
every way of taking a lock raises ``ReplicaError``, whose message names the alias and says
that it points at a replica (read-only server) whose locks exclude nobody on the primary.

Each way of taking a lock is first taken on the primary (the control: the same call works
there), then on an alias that points at the replica, where it must raise before anything was
granted: no lock held there afterwards (``pg_locks`` / ``IS_USED_LOCK``), and no lock
statement in the server's statement log. The replicas are real servers (tests/replica.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
import time
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db import transaction

import advisory_lock as package
from advisory_lock import AdvisoryLockError
from advisory_lock import JobRun
from advisory_lock import advisory_lock
from advisory_lock import run_once
from advisory_lock import single_instance
from advisory_lock.backends import backend_for
from advisory_lock.keys import make_key
from tests.replica import Server
from tests.replica import connect_mariadb
from tests.replica import connect_standby
from tests.replica import mariadb_read_only  # noqa: F401 (a fixture, asked for by name)
from tests.replica import pg_standby  # noqa: F401 (a fixture, asked for by name)

#: The alias that points at each primary's replica. Neither name says "replica", "standby"
#: or "read-only": the error's message must.
REPLICA_ALIASES = {"postgresql": "pg_secondary", "mysql": "mysql_secondary"}
#: A statement that takes (or tries) a lock, as the servers log it. Preparing one grants
#: nothing, so PostgreSQL's ``statement: PREPARE`` lines don't count; running a prepared one
#: is logged with its text (``execute <name>: SELECT ...``, or ``DETAIL:  prepare: ...`` after
#: an SQL ``EXECUTE``).
LOCK_STATEMENTS = {
    "postgresql": re.compile(r"pg_(try_)?advisory_(xact_)?lock(_shared)?\b"),
    "mysql": re.compile(r"\bGET_LOCK\s*\(", re.IGNORECASE),
}


def replica_error() -> type[Exception]:
    """``advisory_lock.ReplicaError``, the contract these tests check."""
    try:
        from advisory_lock import ReplicaError
    except ImportError:
        pytest.fail(
            "advisory_lock.ReplicaError does not exist: the backends do not check for a "
            "replica yet.",
            pytrace=False,
        )
    return ReplicaError


@dataclass
class Replica:
    """An alias that points at a replica of ``primary``'s server (or a read-only server)."""

    alias: str
    primary: str
    server: Server

    def held(self, lock_key: str) -> list[str]:
        """What the replica's server says is held, from a connection outside the app: every
        advisory lock in ``pg_locks`` (PostgreSQL), or who holds ``lock_key``'s GET_LOCK
        name (MariaDB)."""
        if self.primary == "postgresql":
            with connect_standby(self.server) as connection:
                rows = connection.execute(
                    "SELECT pid, classid, objid, objsubid, mode, granted FROM pg_locks"
                    " WHERE locktype = 'advisory'"
                ).fetchall()
            return [repr(row) for row in rows]
        name = backend_for(connections[self.alias]).db_key(make_key(lock_key))
        connection = connect_mariadb(self.server)
        try:
            cursor = connection.cursor()
            cursor.execute("SELECT IS_USED_LOCK(%s)", [name])
            (holder,) = cursor.fetchone()
        finally:
            connection.close()
        return [] if holder is None else [f"{name!r} held by connection {holder}"]

    def lock_statements_since(self, offset: int) -> list[str]:
        """The lock statements the replica's server received since ``offset`` of its log."""
        pattern = LOCK_STATEMENTS[self.primary]
        return [
            line
            for line in self.server.log_since(offset).splitlines()
            if pattern.search(line) and "statement: PREPARE" not in line
        ]


@contextlib.contextmanager
def extra_alias(alias: str, settings_dict: dict) -> Iterator[None]:
    """``alias`` in ``settings.DATABASES`` (and Django's connections) for the block; its
    connections closed and forgotten after it, in this thread and in asgiref's thread."""
    connections.settings[alias] = settings.DATABASES[alias] = settings_dict
    try:
        yield
    finally:
        _forget_connections(alias)
        for databases in (connections.settings, settings.DATABASES):
            databases.pop(alias, None)


def _forget_connections(alias: str, *, close_only: bool = False) -> None:
    def forget() -> None:
        if alias in connections.settings:
            connections[alias].close()
            if not close_only:
                del connections[alias]

    forget()
    # ``async with`` ran its statements in asgiref's thread for thread-sensitive calls.
    asyncio.run(sync_to_async(forget, thread_sensitive=True)())


@pytest.fixture(
    params=["postgresql", "mysql"], ids=["postgresql-hot-standby", "mariadb-read-only"]
)
def replica(request, django_db_setup, django_db_blocker) -> Iterator[Replica]:
    """An alias on a replica of the ``postgresql`` / ``mysql`` test server: a hot standby
    (the test database, replicated), or a read-only MariaDB server (its "mysql" database)."""
    primary = request.param
    if primary not in settings.DATABASES:
        pytest.skip(f"no server for {primary!r} (see the warning at the start of the run)")
    server = request.getfixturevalue(
        "pg_standby" if primary == "postgresql" else "mariadb_read_only"
    )
    settings_dict = copy.deepcopy(connections.settings[primary])
    settings_dict.update(HOST=server.host, PORT=str(server.port))
    if primary == "mysql":
        settings_dict["NAME"] = "mysql"
    alias = REPLICA_ALIASES[primary]
    with django_db_blocker.unblock(), extra_alias(alias, settings_dict):
        try:
            yield Replica(alias, primary, server)
        finally:
            _forget_connections(primary, close_only=True)  # the controls', async ones too


# The ways of taking a lock: each asserts that the lock was taken (the control, on the
# primary). Each locks ``key``, except run_once: ``job:<key>`` (LOCK_KEYS).


def session_lock(using: str, key: str) -> None:
    with advisory_lock(key, using=using) as handle:
        assert handle.acquired and handle.scope == "session"


def transaction_lock(using: str, key: str) -> None:
    with transaction.atomic(using=using), advisory_lock(key, using=using) as handle:
        assert handle.acquired and handle.scope == "transaction"


def try_lock(using: str, key: str) -> None:
    with advisory_lock(key, using=using, wait=False) as handle:
        assert handle.acquired


def async_lock(using: str, key: str) -> None:
    async def main() -> None:
        async with advisory_lock(key, using=using) as handle:
            assert handle.acquired and handle.scope == "session"

    asyncio.run(main())


def single_instance_function(using: str, key: str) -> None:
    @single_instance(key=key, using=using, on_busy="raise")
    def job() -> str:
        return "ran"

    assert job() == "ran"


def run_once_block(using: str, key: str) -> None:
    ran = False
    with run_once(key, period="once", using=using) as run:
        assert run is not None
        ran = True
    JobRun.objects.using(using).filter(job_name=key).delete()
    assert ran


WAYS: dict[str, Callable[[str, str], None]] = {
    "session": session_lock,
    "transaction-in-atomic": transaction_lock,
    "try-wait-false": try_lock,
    "async-with": async_lock,
    "single-instance-function": single_instance_function,
    "run-once": run_once_block,
}
#: The lock each way takes for ``key`` (run_once locks ``job:<job name>``).
LOCK_KEYS = {"run-once": "job:{}"}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_lock_on_a_replica_is_refused_before_anything_is_granted(replica, way):
    take = WAYS[way]
    key = f"replica:{way}:{uuid.uuid4().hex[:12]}"
    lock_key = LOCK_KEYS.get(way, "{}").format(key)
    take(replica.primary, key)  # the control: the same call takes the lock on the primary
    error_class = replica_error()
    log_offset = replica.server.log_size()
    with pytest.raises(error_class) as caught:
        take(replica.alias, key)
    assert_explains(caught.value, replica.alias)
    # Nothing granted: checked while the refused connection is still open.
    assert replica.held(lock_key) == []
    assert replica.lock_statements_since(log_offset) == []


def test_the_refusal_lasts_for_the_connection(replica):
    """Checked once per driver connection, the answer is kept: the next lock is refused too,
    and so is one on a new connection."""
    error_class = replica_error()
    log_offset = replica.server.log_size()
    for _ in range(2):
        with pytest.raises(error_class):
            session_lock(replica.alias, "replica:again")
    connections[replica.alias].close()
    with pytest.raises(error_class):
        try_lock(replica.alias, "replica:again")
    assert replica.held("replica:again") == []
    assert replica.lock_statements_since(log_offset) == []
    session_lock(replica.primary, "replica:again")  # the control


def assert_explains(error: Exception, alias: str) -> None:
    message = str(error)
    assert alias in message, message
    assert re.search(r"replica|read.only|standby", message, re.IGNORECASE), message
    assert "primary" in message.lower(), message


def test_replica_error_is_a_configuration_error_of_the_app():
    error_class = replica_error()
    assert issubclass(error_class, AdvisoryLockError)
    assert issubclass(error_class, ImproperlyConfigured)
    assert "ReplicaError" in package.__all__
    from advisory_lock.exceptions import ReplicaError

    assert error_class is ReplicaError


# The harness: real replicas, not look-alikes, and checks that can see a lock.


def test_the_checks_see_a_lock_taken_on_the_replica(replica):
    """What the refusal tests look at does show a lock the replica granted: taken outside
    the app (a prepared statement on PostgreSQL, as the app sends them), it is held, and
    its statement is in the log."""
    key = f"replica:seen:{uuid.uuid4().hex[:12]}"
    log_offset = replica.server.log_size()
    if replica.primary == "postgresql":
        with connect_standby(replica.server) as connection:
            taken = "SELECT pg_try_advisory_lock(%s)"
            assert connection.execute(taken, [7], prepare=True).fetchone() == (True,)
            held = replica.held(key)
    else:
        name = backend_for(connections[replica.alias]).db_key(make_key(key))
        connection = connect_mariadb(replica.server)
        try:
            cursor = connection.cursor()
            cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
            assert cursor.fetchone() == (1,)
            held = replica.held(key)
        finally:
            connection.close()
    assert len(held) == 1
    assert len(replica.lock_statements_since(log_offset)) == 1
    assert replica.held(key) == []  # the connection closed, which released it


def test_the_standby_streams_the_primary(request, django_db_blocker):
    """A row written on the primary appears on the standby, which is in recovery, refuses
    writes, and is a streaming client in the primary's pg_stat_replication."""
    from psycopg.errors import ReadOnlySqlTransaction

    standby = request.getfixturevalue("pg_standby")
    table = f"replica_probe_{uuid.uuid4().hex[:12]}"
    token = uuid.uuid4().hex
    database = connections.settings["postgresql"]["NAME"]
    with django_db_blocker.unblock(), connections["postgresql"].cursor() as cursor:
        cursor.execute(
            "SELECT state FROM pg_stat_replication WHERE application_name = %s",
            [standby.extra["cluster_name"]],
        )
        assert cursor.fetchall() == [("streaming",)]
        cursor.execute(f"CREATE TABLE {table} (token text)")
        try:
            cursor.execute(f"INSERT INTO {table} VALUES (%s)", [token])
            with connect_standby(standby, database) as connection:
                assert connection.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
                deadline = time.monotonic() + 30
                while not _replicated(connection, table, token):
                    assert time.monotonic() < deadline, "the row never reached the standby"
                    time.sleep(0.05)
                with pytest.raises(ReadOnlySqlTransaction):
                    connection.execute(f"INSERT INTO {table} VALUES ('on the standby')")
        finally:
            cursor.execute(f"DROP TABLE {table}")
    connections["postgresql"].close()


def _replicated(connection, table: str, token: str) -> bool:
    """Is ``table`` on the standby, with the one row written on the primary?"""
    if not connection.execute("SELECT to_regclass(%s) IS NOT NULL", [table]).fetchone()[0]:
        return False
    return connection.execute(f"SELECT token FROM {table}").fetchall() == [(token,)]


def test_the_mariadb_server_is_read_only(request):
    connection = connect_mariadb(request.getfixturevalue("mariadb_read_only"))
    try:
        cursor = connection.cursor()
        cursor.execute("SELECT @@global.read_only")
        assert cursor.fetchone() == (1,)
    finally:
        connection.close()
