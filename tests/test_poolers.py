"""Session locks and connection poolers: a real PgBouncer, Django's own pool, persistent
connections, all against the real PostgreSQL server (no mocks).

Behind PgBouncer in transaction mode, one client connection's statements run on whichever
server connection is free: a session lock is taken on one and "released" on another. These
tests show that breakage with raw clients, then check the library's answers to it: detection
(the server pid changes), a declared POOL_MODE, transaction-scoped locks, DIRECT_ALIAS for
commands; and the resets for connections that outlive a borrower (the pool's reset callable,
the end-of-request release on CONN_MAX_AGE > 0 connections).
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket

import psycopg
import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.signals import request_finished
from django.db import connections
from django.db import transaction
from django.http import HttpResponse
from django.test import Client
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import path

from advisory_lock import LockLost
from advisory_lock import NotSupportedError
from advisory_lock import advisory_lock
from advisory_lock.backends.postgresql import POOLED_ALIASES
from advisory_lock.backends.postgresql import _prepared
from advisory_lock.backends.postgresql import lock_row_ids
from advisory_lock.backends.postgresql import reset_pooled_connection
from advisory_lock.holds import connection_locks
from advisory_lock.keys import make_key
from tests.pgbouncer import start_pgbouncer
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.servers import prepare_statement_sql

pytestmark = pytest.mark.parametrize("using", ["postgresql"], indirect=True)

RELEASE_LEFTOVERS = "advisory_lock.leftovers"  # dispatch_uid of the request handler


# Helpers: aliases added at run time, raw connections, what pg_locks says.


def database_name() -> str:
    """The run's PostgreSQL test database (the bouncer aliases use it too)."""
    return settings.DATABASES["postgresql"]["TEST"]["NAME"]


@contextlib.contextmanager
def database_alias(alias: str, **changes):
    """Add ``alias`` (a copy of "postgresql" on its test database, with ``changes``)."""
    settings_dict = copy.deepcopy(connections.settings["postgresql"])
    settings_dict.update(NAME=database_name(), **changes)
    # What ConnectionHandler.configure_settings fills in for aliases of settings.DATABASES.
    for key, default in (("OPTIONS", {}), ("TEST", {}), ("TIME_ZONE", None)):
        settings_dict.setdefault(key, default)
    settings_dict["TEST"] = {**settings_dict["TEST"], "NAME": database_name(), "MIRROR": None}
    connections.settings[alias] = settings_dict
    try:
        yield alias
    finally:
        connection = connections[alias]
        try:
            if settings_dict["OPTIONS"].get("pool") and connection.connection is not None:
                # psycopg_pool resets a returned connection in a worker task, and drops that
                # task if the pool closes first: the connection would stay open (and the
                # test database busy). Close it before it goes back.
                connection.connection.close()
            connection.close()
            if settings_dict["OPTIONS"].get("pool"):
                connection.close_pool()
        finally:
            del connections[alias]
            del connections.settings[alias]
            POOLED_ALIASES.discard(alias)


def direct_connection() -> psycopg.Connection:
    """A raw autocommit connection straight to PostgreSQL's test database."""
    server = connections.settings["postgresql"]
    return psycopg.connect(
        host=server["HOST"] or "127.0.0.1",
        port=server["PORT"] or "5432",
        user=server["USER"] or "postgres",
        password=server["PASSWORD"] or None,
        dbname=database_name(),
        autocommit=True,
        prepare_threshold=None,
        connect_timeout=5,
    )


def raw_key(key: str) -> int:
    """The bigint the library passes to pg_advisory_lock() for ``key``."""
    return make_key(key).as_int64()


def lock_holders(conn: psycopg.Connection, key: str) -> list[tuple[int, str]]:
    """(pid, application_name) of each server connection holding ``key``, from pg_locks."""
    rows = conn.execute(
        "SELECT l.pid, a.application_name FROM pg_locks l "
        "JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid AND l.objsubid = %s "
        "ORDER BY l.pid",
        lock_row_ids(raw_key(key)),
    )
    return rows.fetchall()


def backend_pid(alias: str) -> int:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def lock_settings(**advisory_lock_settings):
    """override_settings(ADVISORY_LOCK=...) that keeps the suite's NAMESPACE."""
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, **advisory_lock_settings})


@pytest.fixture
def stack():
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def bouncer_alias(using, stack):
    """Start a private PgBouncer and add the Django alias "bouncer" that goes through it.

    Returns a function of (pool_mode, default_pool_size) giving the running PgBouncer.
    """

    def start(pool_mode: str, default_pool_size: int):
        bouncer = stack.enter_context(
            start_pgbouncer(pool_mode=pool_mode, default_pool_size=default_pool_size)
        )
        stack.enter_context(database_alias("bouncer", HOST=bouncer.host, PORT=str(bouncer.port)))
        # Prepared statements break behind transaction pooling: Django keeps them off.
        connections["bouncer"].ensure_connection()
        assert connections["bouncer"].connection.prepare_threshold is None
        return bouncer

    return start


def bouncer_client(stack, bouncer) -> psycopg.Connection:
    """A raw client of PgBouncer, as a naive application would have: autocommit."""
    return stack.enter_context(
        psycopg.connect(
            bouncer.conninfo(database_name(), user="postgres", connect_timeout="5"),
            autocommit=True,
            prepare_threshold=None,  # prepared statements break behind transaction pooling
        )
    )


def bouncer_server_pids(stack, bouncer) -> set[int]:
    """The PostgreSQL pids of PgBouncer's server connections (its SHOW SERVERS)."""
    console = stack.enter_context(
        psycopg.connect(
            bouncer.conninfo("pgbouncer", user="pgbouncer", connect_timeout="5"),
            autocommit=True,
            prepare_threshold=None,
        )
    )
    cursor = console.execute("SHOW SERVERS")
    column = [d.name for d in cursor.description].index("remote_pid")
    return {row[column] for row in cursor.fetchall()}


# 1. Why session locks don't work behind a transaction pooler.


def test_naive_session_lock_behind_transaction_pooler_is_held_by_two_clients_at_once(
    bouncer_alias, stack
):
    bouncer = bouncer_alias("transaction", 1)  # one server connection for every client
    a, b = bouncer_client(stack, bouncer), bouncer_client(stack, bouncer)
    key = raw_key("pooler:naive")

    a.execute("SELECT pg_advisory_lock(%s)", (key,))
    # B is another client, yet its "try" succeeds: both run on the same server connection,
    # whose session already holds the lock (PostgreSQL counts the second hold).
    assert b.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0] is True
    pid_a = a.execute("SELECT pg_backend_pid()").fetchone()[0]
    pid_b = b.execute("SELECT pg_backend_pid()").fetchone()[0]
    assert pid_a == pid_b
    with direct_connection() as direct:
        assert [pid for pid, _ in lock_holders(direct, "pooler:naive")] == [pid_a]


# 2. Detection: the server pid changes between acquire and release.


def test_release_on_another_server_connection_raises_lock_lost_then_session_locks_are_refused(
    bouncer_alias, stack
):
    bouncer = bouncer_alias("transaction", 2)
    c, d = bouncer_client(stack, bouncer), bouncer_client(stack, bouncer)
    direct = stack.enter_context(direct_connection())

    c.execute("BEGIN")
    s1 = c.execute("SELECT pg_backend_pid()").fetchone()[0]  # C keeps S1 until it commits
    with pytest.raises(LockLost) as lost:
        with advisory_lock("pooler:detected", using="bouncer") as handle:
            assert handle.acquired and handle.scope == "session"
            # S1 is busy with C's transaction: the lock statement ran on the other one, S2.
            [(s2, _)] = lock_holders(direct, "pooler:detected")
            assert s2 != s1
            d.execute("BEGIN")
            assert d.execute("SELECT pg_backend_pid()").fetchone()[0] == s2  # D now has S2
            c.execute("COMMIT")  # S1 is free: the release will run there
    assert "bouncer" in POOLED_ALIASES
    message = str(lost.value)
    assert "transaction-mode pooler" in message
    assert f"taken on server pid {s2}" in message and f"reached pid {s1}" in message
    # The unlock ran on S1, which did not hold it: the lock is left on S2.
    assert [pid for pid, _ in lock_holders(direct, "pooler:detected")] == [s2]
    d.execute("COMMIT")

    # From now on session locks on the alias are refused, naming both ways out.
    with pytest.raises(NotSupportedError) as refused:
        with advisory_lock("pooler:after", using="bouncer"):
            pytest.fail("a session lock must not be taken behind a transaction pooler")
    message = str(refused.value)
    assert "transaction.atomic(using='bouncer')" in message
    assert "ADVISORY_LOCK['DIRECT_ALIAS']" in message
    # Transaction scope still works behind the pooler.
    with transaction.atomic(using="bouncer"):
        with advisory_lock("pooler:after", using="bouncer") as handle:
            assert handle.acquired and handle.scope == "transaction"
            assert not is_free("pooler:after", "postgresql")
    assert is_free("pooler:after", "postgresql")

    # The leaked lock lives as long as S2: stopping PgBouncer closes it. Wait for that with a
    # bounded lock wait (the lock itself is the event), not a sleep.
    stack.close()
    with direct_connection() as check:
        check.execute("SET lock_timeout = '10s'")
        check.execute("SELECT pg_advisory_lock(%s)", (raw_key("pooler:detected"),))
        check.execute("SELECT pg_advisory_unlock_all()")


def test_pooler_detected_when_acquiring_leaves_no_lock_behind(bouncer_alias, stack):
    bouncer = bouncer_alias("transaction", 2)
    c, d = bouncer_client(stack, bouncer), bouncer_client(stack, bouncer)
    direct = stack.enter_context(direct_connection())

    c.execute("BEGIN")
    s1 = c.execute("SELECT pg_backend_pid()").fetchone()[0]
    with advisory_lock("pooler:first", using="bouncer"):
        [(s2, _)] = lock_holders(direct, "pooler:first")  # the library's first server pid
    assert s2 != s1
    d.execute("BEGIN")
    assert d.execute("SELECT pg_backend_pid()").fetchone()[0] == s2
    c.execute("COMMIT")  # only S1 is free: the next lock statement runs there
    with pytest.raises(NotSupportedError, match="pooler"):
        with advisory_lock("pooler:second", using="bouncer"):
            pytest.fail("the block must not run when the pooler is detected on entry")
    assert "bouncer" in POOLED_ALIASES
    d.execute("COMMIT")
    # The statement is guarded by the known server pid: on S1 it locked nothing.
    assert lock_holders(direct, "pooler:second") == []
    assert is_free("pooler:second", "postgresql")


@pytest.mark.parametrize("other_server", ["unprepared", "prepared-by-another-client"])
def test_pooler_detected_after_the_lock_statements_were_prepared(
    bouncer_alias, stack, other_server
):
    # The try and unlock are prepared statements, on the server connection they first ran
    # on. Moved to another one, the statement is unknown there (it is run again unprepared,
    # guarded), or another client of this library prepared the
    # same name there: either way the guard keeps it from locking anything.
    bouncer = bouncer_alias("transaction", 2)
    c, d = bouncer_client(stack, bouncer), bouncer_client(stack, bouncer)
    direct = stack.enter_context(direct_connection())

    c.execute("BEGIN")
    s1 = c.execute("SELECT pg_backend_pid()").fetchone()[0]  # C keeps S1 until it commits
    for _ in range(4):
        with advisory_lock("pooler:warm", using="bouncer", wait=False) as handle:
            assert handle.acquired
            [(s2, _)] = lock_holders(direct, "pooler:warm")
    # Exclusive, bigint key: the first try before the pid was known, then guarded ones.
    names = {
        _prepared("pg_try_advisory_lock", False, False)[0].decode(),
        _prepared("pg_try_advisory_lock", False, True)[0].decode(),
        _prepared("pg_advisory_unlock", False, True)[0].decode(),
    }
    with connections["bouncer"].cursor() as cursor:  # S2 is the only free server connection
        cursor.execute("SELECT pg_backend_pid(), name FROM pg_prepared_statements")
        assert sorted(cursor.fetchall()) == sorted((s2, name) for name in names)
    if other_server == "prepared-by-another-client":
        c.execute(prepare_statement_sql("pg_try_advisory_lock", False, True))  # on S1
    d.execute("BEGIN")
    assert d.execute("SELECT pg_backend_pid()").fetchone()[0] == s2  # D now has S2
    c.execute("COMMIT")  # only S1 is free: the next lock statement runs there
    assert s1 != s2
    with pytest.raises(NotSupportedError, match="pooler"):
        with advisory_lock("pooler:warm", using="bouncer", wait=False):
            pytest.fail("the block must not run when the pooler is detected on entry")
    d.execute("COMMIT")
    assert "bouncer" in POOLED_ALIASES
    assert lock_holders(direct, "pooler:warm") == []


# 3. A declared transaction pooler: session locks refused up front, transaction locks work.


def try_transaction_lock(key: str, alias: str) -> bool:
    with transaction.atomic(using=alias):
        with advisory_lock(key, using=alias, wait=False) as handle:
            assert handle.scope == "transaction"
            return handle.acquired


def test_declared_transaction_pooler_refuses_session_locks_before_any_sql(bouncer_alias):
    bouncer_alias("transaction", 2)
    with lock_settings(POOL_MODE={"bouncer": "transaction"}):
        with CaptureQueriesContext(connections["bouncer"]) as queries:
            with pytest.raises(NotSupportedError) as refused:
                with advisory_lock("pooler:declared", using="bouncer"):
                    pytest.fail("a session lock must not be taken behind a transaction pooler")
        assert len(queries) == 0
    message = str(refused.value)
    assert "POOL_MODE" in message
    assert "transaction.atomic(using='bouncer')" in message
    assert "ADVISORY_LOCK['DIRECT_ALIAS']" in message
    assert not POOLED_ALIASES


def test_declared_transaction_pooler_transaction_locks_exclude_each_other_until_commit(
    bouncer_alias,
):
    bouncer_alias("transaction", 2)
    with lock_settings(POOL_MODE={"bouncer": "transaction"}):
        with transaction.atomic(using="bouncer"):
            with advisory_lock("pooler:xact", using="bouncer") as handle:
                assert handle.acquired and handle.scope == "transaction"
            # Held until the commit, through the pooler and directly alike.
            assert not in_other_connection(try_transaction_lock, "pooler:xact", "bouncer")
            assert not is_free("pooler:xact", "postgresql")
        assert in_other_connection(try_transaction_lock, "pooler:xact", "bouncer")
        assert is_free("pooler:xact", "postgresql")


# 4. Session pooling keeps session semantics.


def test_session_pooler_keeps_session_locks_working_without_detection(bouncer_alias):
    bouncer_alias("session", 2)
    pid = backend_pid("bouncer")
    for _ in range(3):
        with advisory_lock("pooler:session", using="bouncer") as handle:
            assert handle.acquired and handle.scope == "session"
            assert not is_free("pooler:session", "bouncer")  # another client of the pooler
            assert not is_free("pooler:session", "postgresql")
        assert is_free("pooler:session", "bouncer")
        assert is_free("pooler:session", "postgresql")
    assert backend_pid("bouncer") == pid  # one server connection for this client throughout
    assert not POOLED_ALIASES


# 5. DIRECT_ALIAS: single-instance commands lock on a direct connection.

COMMAND_KEY = "command:lockapp.decorated_job"


@pytest.fixture
def decorated_job_on_bouncer(bouncer_alias, stack, monkeypatch):
    """decorated_job locking on "bouncer"; its handle() records what the database shows."""
    from tests.lockapp.management.commands import decorated_job

    bouncer = bouncer_alias("transaction", 2)
    seen = {}

    def handle(self, *args, **options):
        seen["data_pid"] = backend_pid("bouncer")  # the job's own queries use the pooler
        seen["bouncer_pids"] = bouncer_server_pids(stack, bouncer)
        with direct_connection() as direct:
            seen["holders"] = lock_holders(direct, COMMAND_KEY)

    monkeypatch.setattr(decorated_job.Command, "lock_using", "bouncer")
    monkeypatch.setattr(decorated_job.Command, "handle", handle)
    return seen


def test_single_instance_command_behind_declared_pooler_locks_through_direct_alias(
    decorated_job_on_bouncer,
):
    seen = decorated_job_on_bouncer
    with lock_settings(
        POOL_MODE={"bouncer": "transaction"}, DIRECT_ALIAS={"bouncer": "postgresql"}
    ):
        call_command("decorated_job")
    [(holder, application)] = seen["holders"]
    # The lock's connection names this process (call_command ran the command here) and its
    # host first, then the command.
    assert application == (
        f"pid={os.getpid()} host={socket.gethostname()} lockapp.decorated_job (advisory_lock)"
    )
    # The holder is none of PgBouncer's server connections: it connected directly.
    assert seen["data_pid"] in seen["bouncer_pids"]
    assert holder not in seen["bouncer_pids"]
    assert is_free(COMMAND_KEY, "postgresql")


def test_single_instance_command_behind_declared_pooler_without_direct_alias_is_refused(
    decorated_job_on_bouncer,
):
    with lock_settings(POOL_MODE={"bouncer": "transaction"}):
        with pytest.raises(NotSupportedError) as refused:
            call_command("decorated_job")
    assert decorated_job_on_bouncer == {}  # the command did not run
    assert "ADVISORY_LOCK['DIRECT_ALIAS']" in str(refused.value)


# 6. Django's connection pool (OPTIONS["pool"]) and its reset callable.


@pytest.fixture
def pooled_alias(using, stack):
    """Add the alias "pooled": Django's pool of ONE connection straight to PostgreSQL."""
    try:
        import psycopg_pool  # noqa: F401
    except ImportError:
        message = "psycopg_pool is not installed (it comes with psycopg[pool], the test extra)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {message}.", pytrace=False)
        pytest.skip(f"\n\n*** {message}: the tests of Django's pool are SKIPPED. ***\n")

    def add(*, reset: bool) -> str:
        pool = {"min_size": 1, "max_size": 1, "timeout": 10}
        if reset:
            pool["reset"] = reset_pooled_connection
        return stack.enter_context(database_alias("pooled", OPTIONS={"pool": pool}))

    return add


def test_pooled_view_that_raises_inside_the_lock_leaves_it_free_for_the_next_borrower(
    pooled_alias,
):
    alias = pooled_alias(reset=True)

    def view():
        with advisory_lock("pooler:view", using=alias):
            raise ValueError("the view failed")

    with pytest.raises(ValueError):
        view()
    first = backend_pid(alias)
    connections[alias].close()  # the request ends: back to the pool
    assert backend_pid(alias) == first  # the next borrower has the same server connection
    with advisory_lock("pooler:view", using=alias, wait=False) as handle:
        assert handle.acquired
    assert is_free("pooler:view", "postgresql")


@pytest.mark.parametrize("reset", [True, False], ids=["with_reset", "without_reset"])
def test_pooled_connection_returned_holding_a_leaked_lock_is_reset_only_by_the_callable(
    pooled_alias, reset
):
    alias = pooled_alias(reset=reset)
    leaked = advisory_lock("pooler:leak", using=alias)
    assert leaked.__enter__()  # and never exited: the borrower leaks it
    first = backend_pid(alias)
    connections[alias].close()  # back to the pool (the reset runs in the pool's worker)

    # The next borrower: with max_size=1 it waits until the connection is back in the pool,
    # so after the reset callable has run.
    assert backend_pid(alias) == first
    with direct_connection() as direct:
        holders = [pid for pid, _ in lock_holders(direct, "pooler:leak")]
    if reset:
        assert holders == []
        assert is_free("pooler:leak", "postgresql")
    else:
        # Without the reset the next borrower inherits the previous one's lock.
        assert holders == [first]
        assert not is_free("pooler:leak", "postgresql")
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock_all()")


# 7. Persistent connections (CONN_MAX_AGE > 0): the end-of-request release.


def leaky_view(request):
    """Take a session lock and never release it (as a view that forgot to would)."""
    advisory_lock("pooler:request", using="persistent").__enter__()
    return HttpResponse("leaked")


urlpatterns = [path("leaky/", leaky_view)]


@pytest.fixture
def persistent_alias(using, stack):
    stack.enter_context(override_settings(ROOT_URLCONF=__name__))
    return stack.enter_context(database_alias("persistent", CONN_MAX_AGE=600))


def test_request_that_leaves_a_session_lock_on_a_persistent_connection_releases_it_at_the_end(
    persistent_alias, caplog
):
    alias = persistent_alias
    pid = backend_pid(alias)
    assert Client().get("/leaky/").content == b"leaked"
    assert backend_pid(alias) == pid  # the connection persists across the request...
    assert is_free("pooler:request", "postgresql")  # ...but not the lock
    assert connection_locks(connections[alias]).session_holds == []
    assert "A request ended holding 1 session lock(s) on database 'persistent'" in caplog.text


def test_without_the_request_finished_handler_the_leaked_lock_would_outlive_the_request(
    persistent_alias,
):
    alias = persistent_alias
    assert request_finished.disconnect(dispatch_uid=RELEASE_LEFTOVERS)
    try:
        assert Client().get("/leaky/").content == b"leaked"
        assert not is_free("pooler:request", "postgresql")
    finally:
        from advisory_lock.holds import release_leftovers

        request_finished.connect(release_leftovers, dispatch_uid=RELEASE_LEFTOVERS)
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock_all()")
    assert is_free("pooler:request", "postgresql")
