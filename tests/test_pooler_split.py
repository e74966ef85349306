"""Two processes, one transaction-mode PgBouncer, POOL_MODE undeclared (issue 19, item 4).

Behind a transaction pooler a client's statements run on whichever server connection is free,
and between them that server connection serves other clients. A session lock taken there stays
on the server connection: PostgreSQL grants it again, re-entrantly, to any other client whose
statement runs there next, and the pid that client sees is the same one throughout (with one
server connection it never changes). The server pid alone can't tell; these tests hold the
library to the promise that such a split is noticed anyway: a try is refused
(``NotSupportedError``) or finds the lock busy, never granted; a release either frees the lock
or raises ``LockLost``; two ``@single_instance`` calls never run at once.

Each process is ``python -m tests.test_pooler_split`` (the ``child`` below), with the suite's
settings and its "postgresql" alias pointed at the PgBouncer: fresh processes each round, so
that each round starts undetected. The last tests run in this process: the release side, a
stale mark, and no false alarm without a pooler. Everything runs against the real PgBouncer
and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import psycopg
import pytest
from django.conf import settings
from django.db import connections
from django.db import transaction

from advisory_lock import LockLost
from advisory_lock import NotSupportedError
from advisory_lock import advisory_lock
from advisory_lock.backends.postgresql import POOLED_ALIASES
from tests.pgbouncer import start_pgbouncer
from tests.probes import is_free
from tests.processes import ROOT
from tests.processes import Worker
from tests.processes import Workers
from tests.test_poolers import database_alias

pytestmark = pytest.mark.parametrize("using", ["postgresql"], indirect=True)

ROUNDS = 4


# The child process.


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def child() -> None:
    """Read commands on stdin, one a line; answer each with one JSON line (or two).

    ``try KEY``: ``advisory_lock(KEY, wait=False).acquire()``: granted, busy or refused.
    ``release``: release the last lock granted: released or lost.
    ``xact KEY``: the same try inside ``transaction.atomic()``.
    ``single KEY LOG``: call a ``@single_instance`` function on KEY whose body appends
    ``<pid> enter <time>`` to LOG, says ``running``, waits for a line on stdin, then appends
    ``<pid> leave <time>``; then ran, skipped, refused or lost.
    """
    import django

    django.setup()
    from django.db import connections as child_connections

    from advisory_lock import LockLost
    from advisory_lock import NotSupportedError
    from advisory_lock import advisory_lock
    from advisory_lock import single_instance

    alias = "postgresql"
    held = []

    def server_pid() -> int:
        with child_connections[alias].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    def log_event(log: str, what: str) -> None:
        descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one small O_APPEND write per line: lines of two processes never interleave
            os.write(descriptor, f"{os.getpid()} {what} {time.monotonic()!r}\n".encode())
        finally:
            os.close(descriptor)

    say("ready", pid=os.getpid())
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command in ("try", "xact"):
                lock = advisory_lock(args[0], using=alias, wait=False)
                if command == "xact":
                    with transaction.atomic(using=alias):
                        handle = lock.acquire()
                        say("granted" if handle else "busy", scope=handle.scope)
                    continue
                handle = lock.acquire()
                if handle:
                    held.append((lock, handle))
                    say("granted", server_pid=server_pid())
                else:
                    say("busy")
            elif command == "release":
                lock, handle = held.pop()
                lock.release(handle)
                say("released")
            elif command == "single":
                key, log = args

                @single_instance(key=key, using=alias, heartbeat=0.5)
                def job(log: str) -> str:
                    log_event(log, "enter")
                    say("running")
                    sys.stdin.readline()
                    log_event(log, "leave")
                    return "done"

                say("ran" if job(log) == "done" else "skipped")
            else:
                say("error", message=f"unknown command {command!r}")
        except NotSupportedError as error:
            say("refused", message=str(error))
        except LockLost as error:
            say("lost", message=str(error))


# The test side.


class Child(Worker):
    """One ``python -m tests.test_pooler_split`` process (a tests.processes.Worker)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.args = ["child"]
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_pooler_split"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    def ask(self, command: str) -> dict:
        self.send(command)
        return self.message()


def database_name() -> str:
    return settings.DATABASES["postgresql"]["TEST"]["NAME"]


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


def holders(key: str) -> list[int]:
    """The pids of the server connections that hold ``key`` (pg_locks, asked directly)."""
    from advisory_lock.backends.postgresql import lock_row_ids
    from advisory_lock.keys import make_key

    with direct_connection() as direct:
        rows = direct.execute(
            "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid "
            "AND l.objsubid = %s ORDER BY l.pid",
            lock_row_ids(make_key(key).as_int64()),
        )
        return [pid for (pid,) in rows.fetchall()]


@pytest.fixture
def bouncer(using):
    """A transaction-mode PgBouncer (POOL_MODE undeclared): a function of the pool size
    that starts it and returns a function starting children that lock through it."""
    with contextlib.ExitStack() as stack:
        workers = Workers()
        stack.callback(workers.kill_all)

        def start(pool_size: int):
            running = stack.enter_context(
                start_pgbouncer(pool_mode="transaction", default_pool_size=pool_size)
            )
            server = connections.settings["postgresql"]
            user = server["USER"] or "postgres"
            password = f":{server['PASSWORD']}" if server["PASSWORD"] else ""
            env = {
                **workers.env,
                "TEST_POSTGRES_URL": (
                    f"postgres://{user}{password}@{running.host}:{running.port}/postgres"
                ),
            }

            def spawn() -> Child:
                started = Child(copy.deepcopy(env))
                workers.started.append(started)
                started.expect("ready")
                return started

            return spawn

        yield start


def intervals(log: str) -> list[tuple[float, float, int]]:
    """(enter, leave, pid) of each run of the job body in ``log``, ordered by entry."""
    entered: dict[int, float] = {}
    runs = []
    with open(log) as lines:
        for line in lines:
            pid, what, at = line.split()
            if what == "enter":
                entered[int(pid)] = float(at)
            else:
                runs.append((entered.pop(int(pid)), float(at), int(pid)))
    assert not entered, f"a run never left: {entered}"
    return sorted(runs)


@pytest.mark.parametrize("pool_size", [1, 2])
def test_a_second_process_never_gets_a_session_lock_another_holds_through_the_pooler(
    bouncer, pool_size
):
    spawn = bouncer(pool_size)
    for round_ in range(ROUNDS):
        key = f"split:try:{pool_size}:{round_}"
        a, b = spawn(), spawn()
        granted = a.ask(f"try {key}")
        assert granted["event"] == "granted", granted
        [server] = holders(key)
        assert server == granted["server_pid"]

        # B's try runs on a server connection the pool lends it; with A idle that is the
        # one holding A's lock, which PostgreSQL would grant again to whoever asks there.
        second = b.ask(f"try {key}")
        assert second["event"] in ("refused", "busy"), f"round {round_}: B got {second}"
        if second["event"] == "refused":
            assert "transaction-mode pooler" in second["message"]
            assert "ADVISORY_LOCK['DIRECT_ALIAS']" in second["message"]
        assert holders(key) == [server]  # B took nothing, not even a second hold

        released = a.ask("release")
        assert released["event"] in ("released", "lost"), released
        if released["event"] == "released":
            # Released for real: nobody holds it any more, anywhere.
            assert holders(key) == []
        a.finish()
        b.finish()


def test_a_lock_left_on_a_server_connection_by_a_killed_client_is_not_granted_to_the_next(
    bouncer,
):
    for round_ in range(ROUNDS):
        spawn = bouncer(1)  # a PgBouncer of its own each round: the leftover stays on it
        key = f"split:killed:{round_}"
        a = spawn()
        assert a.ask(f"try {key}")["event"] == "granted"
        a.kill()  # the client is gone; its server connection (and the lock) stay
        [server] = holders(key)
        b = spawn()
        second = b.ask(f"try {key}")
        assert second["event"] in ("refused", "busy"), f"round {round_}: B got {second}"
        assert holders(key) == [server]
        # Transaction scope still works on that server connection, for any other key.
        assert b.ask(f"xact {key}:other") == {"event": "granted", "scope": "transaction"}
        assert b.ask(f"xact {key}")["event"] in ("refused", "busy")
        assert holders(key) == [server]
        b.finish()


def test_a_transaction_lock_is_not_granted_where_another_client_holds_a_session_lock(bouncer):
    spawn = bouncer(1)
    for round_ in range(ROUNDS):
        key = f"split:xact:{round_}"
        a, b = spawn(), spawn()
        assert a.ask(f"try {key}")["event"] == "granted"
        # B locks inside atomic(): transaction scope, which works behind a pooler unless the
        # transaction's server connection holds another client's session lock.
        second = b.ask(f"xact {key}")
        assert second["event"] in ("refused", "busy"), f"round {round_}: B got {second}"
        assert a.ask("release")["event"] in ("released", "lost")
        a.finish()
        b.finish()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_two_single_instance_calls_through_the_pooler_never_run_at_once(
    bouncer, pool_size, tmp_path
):
    spawn = bouncer(pool_size)
    log = str(tmp_path / "runs.log")
    outcomes = []
    for round_ in range(ROUNDS):
        key = f"split:single:{pool_size}:{round_}"
        a, b = spawn(), spawn()
        assert a.ask(f"single {key} {log}")["event"] == "running"
        second = b.ask(f"single {key} {log}")
        if second["event"] == "running":  # the bug: B is inside too; let it finish
            b.send("")
            b.expect("ran")
        a.send("")  # A's body returns
        first = a.message()
        outcomes.append((first["event"], second["event"]))
        a.finish()
        b.finish()
    runs = intervals(log)
    overlaps, latest = [], None
    for run in runs:  # ordered by entry: a run that enters before the latest leave overlaps
        if latest is not None and run[0] < latest[1]:
            overlaps.append((latest, run))
        if latest is None or run[1] > latest[1]:
            latest = run
    assert overlaps == [], f"bodies ran at once: {overlaps} (outcomes {outcomes})"
    for first, second in outcomes:
        assert first in ("ran", "lost")
        assert second in ("refused", "skipped")
    assert len(runs) == ROUNDS


# The release side, and no false alarm without a pooler (in this process).


def test_a_release_on_a_server_connection_that_holds_another_clients_locks_raises_lock_lost(
    using,
):
    with (
        start_pgbouncer(pool_mode="transaction", default_pool_size=1) as running,
        database_alias("bouncer", HOST=running.host, PORT=str(running.port)),
    ):
        lock = advisory_lock("split:release", using="bouncer")
        handle = lock.acquire()  # on the pool's only server connection
        [server] = holders("split:release")
        # Another client of the pooler marks that server connection as holding its session
        # locks (as this library does: a client whose mark a rollback undid could do so).
        with psycopg.connect(
            running.conninfo(database_name(), user="postgres", connect_timeout="5"),
            autocommit=True,
            prepare_threshold=None,
        ) as other:
            other.execute("SELECT set_config('advisory_lock.client', '12345', false)")
        with pytest.raises(LockLost, match="another client connection's session locks"):
            lock.release(handle)
        assert holders("split:release") == [server]  # nothing was released there
        assert "bouncer" in POOLED_ALIASES
        with pytest.raises(NotSupportedError, match="another client connection's session"):
            advisory_lock("split:after", using="bouncer").acquire()


def test_a_server_connection_whose_client_released_everything_serves_the_next_client(using):
    # The mark stays after the last release (writing and clearing it at every lock would cost
    # more). A client that finds another's mark on a session that holds no advisory lock
    # takes the lock there (after a look at pg_locks); one that finds locks there refuses.
    with (
        start_pgbouncer(pool_mode="transaction", default_pool_size=1) as running,
        database_alias("bouncer", HOST=running.host, PORT=str(running.port)),
        database_alias("bouncer2", HOST=running.host, PORT=str(running.port)),
    ):
        for _ in range(3):
            with advisory_lock("split:first", using="bouncer") as first:
                assert first
        with advisory_lock("split:second", using="bouncer2", wait=False) as second:
            assert second
            [server] = holders("split:second")
            with pytest.raises(NotSupportedError, match="another client connection's session"):
                advisory_lock("split:second", using="bouncer", wait=False).acquire()
            assert holders("split:second") == [server]
        assert holders("split:second") == []
        assert "bouncer" in POOLED_ALIASES and "bouncer2" not in POOLED_ALIASES


def test_without_a_pooler_a_session_lock_outliving_a_rolled_back_transaction_is_released(
    using,
):
    # The mark is a setting, which a rollback restores; the session lock outlives it. On a
    # direct connection the release still finds the session its own.
    lock = advisory_lock("split:rollback", using=using, scope="session")
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic(using=using):
            with connections[using].cursor() as cursor:
                cursor.execute("SELECT 1")  # the transaction is open on the server
            handle = lock.acquire()
            1 / 0  # noqa: B018
    assert not is_free("split:rollback", using)
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT current_setting('advisory_lock.client', true)")
        assert cursor.fetchone()[0] in (None, "")  # the rollback undid the mark
    lock.release(handle)
    assert is_free("split:rollback", using)
    for _ in range(3):  # and locks go on working there, nested or not
        with advisory_lock("split:rollback", using=using) as outer:
            with advisory_lock("split:rollback", using=using) as inner:
                assert outer and inner
        assert is_free("split:rollback", using)
    assert not POOLED_ALIASES


if __name__ == "__main__":
    child()
