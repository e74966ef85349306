"""A heartbeat names the holding session and its server: an id given again by another server,
or by the same one restarted, is not the holder.

A heartbeat asks from a connection of its own whether the session that took the lock still
holds it (``held_by``). The server knows that session by an id (PostgreSQL's backend pid,
MySQL's connection id) that is unique on one running server only: after a failover, or a
restart, another session may get the same id and take the same lock, and a heartbeat that
asked by the id alone would find its lock "held". MySQL's ids start again from 1 at each
start, so this happens after a restart as soon as as many connections have been made; the
test makes them. (PostgreSQL's pids can't be steered: there, the test asks about the new
holder's pid with the old server's name.) These tests restart this machine's servers: they
run after every other test, wait for other pytest runs on the machine, and leave the server
running.
"""

from __future__ import annotations

import pytest
from django.db import connections

from advisory_lock.backends import backend_for
from advisory_lock.dedicated import dedicated_connection
from advisory_lock.keys import make_key
from tests.faults.helpers import require_restartable
from tests.faults.helpers import server_is_up
from tests.faults.helpers import start_server
from tests.faults.helpers import stop_server
from tests.faults.helpers import wait_for_other_pytest_runs
from tests.schedulers import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.restarts_servers]

KEY = make_key("import:tenant-42")
#: A bound on the connections made to get a restarted MariaDB's id: a guard, not a count.
MAX_CONNECTIONS = 10_000


@pytest.fixture
def restartable(using):
    require_restartable(using)
    wait_for_other_pytest_runs()
    try:
        yield
    finally:
        if not server_is_up(using):
            start_server(using)
        connections[using].close()


def restart(using: str) -> None:
    try:
        stop_server(using)
    finally:
        start_server(using)


def uptime(connection) -> int:
    """The server's Uptime status, in seconds."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Uptime'")
        return int(cursor.fetchone()[1])


def taken(using: str, label: str):
    """A new connection of ``using`` holding KEY, and its backend."""
    connection = dedicated_connection(using, label)
    backend = backend_for(connection)
    assert backend.acquire(backend.db_key(KEY), shared=False, timeout=0, transaction=False)
    return connection, backend


@pytest.mark.parametrize("using", ["mysql"], indirect=True)
def test_a_connection_id_given_again_after_a_restart_is_not_the_holder(using, restartable):
    restart(using)  # a small id for the holder: as few connections as that to make again
    holder, backend = taken(using, "holder")
    session = backend.server_session()
    # A server is named by when it started, in whole seconds (its Uptime status): a start
    # within a second of the last one passes for it. The server's own view says when the
    # next start is a later one.
    wait_for(lambda: uptime(holder) >= 3, "the server up for 3 seconds")
    restart(using)  # the holder's session, and its lock, are gone
    holder.close()
    # New connections until the restarted server gives one the holder's id; it takes KEY.
    for _ in range(MAX_CONNECTIONS):
        impostor = dedicated_connection(using, "impostor")
        impostor_backend = backend_for(impostor)
        if impostor_backend.server_session()[0] == session[0]:
            break
        impostor.close()
    else:
        pytest.fail(f"no connection got the id {session[0]} again")
    db_key = impostor_backend.db_key(KEY)
    assert impostor_backend.acquire(db_key, shared=False, timeout=0, transaction=False)
    watcher = dedicated_connection(using, "watcher")
    try:
        watching = backend_for(watcher)
        assert watching.held_by(db_key, impostor_backend.server_session())  # the new holder
        assert not watching.held_by(db_key, session)  # the same id, but not the holder
    finally:
        impostor.close()
        watcher.close()


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_pid_of_another_server_start_is_not_the_holder(using, restartable):
    holder, backend = taken(using, "holder")
    session = backend.server_session()
    restart(using)
    holder.close()
    impostor, impostor_backend = taken(using, "impostor")
    db_key = impostor_backend.db_key(KEY)
    now = impostor_backend.server_session()
    watcher = dedicated_connection(using, "watcher")
    try:
        watching = backend_for(watcher)
        assert watching.held_by(db_key, now)
        # The new holder's pid, as a session of the server before the restart would have it.
        assert now[1] != session[1]
        assert not watching.held_by(db_key, (now[0], session[1]))
    finally:
        impostor.close()
        watcher.close()
