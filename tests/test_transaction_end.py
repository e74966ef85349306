"""A transaction-scoped lock is free the moment its transaction ends, however it ends.

A lock taken inside ``transaction.atomic()`` is held until the outermost transaction ends,
and not a moment longer: by the time ``atomic``'s exit returns or raises, any other session
and any other process can take it. That holds whether the block committed, raised, asked
for ``set_rollback(True)``, or its rollback failed and Django closed the connection; a lock
taken in a savepoint that rolls back is free at that savepoint's rollback, while the outer
transaction's locks stay held until the outer end. On PostgreSQL, a ``scope="session"``
lock whose block ended while a failed statement had aborted the transaction is free once
that failure ends: when the outermost ``atomic`` exits, or at the savepoint rollback that
ends it.

Each holder is a real process (tests/transaction_child.py) with the cyclic garbage collector
off, which ends its transaction, says ``ended``, and then does nothing at all: no later lock
operation, no end of request, no new connection may be what frees the lock. The test then
tries the lock with ``wait=False`` from another connection (``is_free``) and, in the basic
cases, from another process (tests/worker.py ``hold --try``). Events order everything; no
test measures time.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest
from django.db import connections

from tests.probes import in_other_connection
from tests.probes import is_free
from tests.processes import ROOT
from tests.processes import Worker
from tests.processes import Workers
from tests.servers import kill_connection_of

POSTGRESQL_ONLY = pytest.mark.parametrize("using", ["postgresql"], indirect=True)


class Holder(Worker):
    """One ``python -m tests.transaction_child`` process (a Worker: JSON lines out, cues in)."""

    def __init__(self, args, env):
        self.args = args
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by kill())
        self._buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.transaction_child", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )


class Processes(Workers):
    """The holders and probes of one test; ``kill_all`` ends every one of them."""

    def holder(self, using, case, key, *args):
        holder = Holder(["--using", using, case, key, *args], self.env)
        self.started.append(holder)
        return holder

    def free_for_another_process(self, key, using):
        """True if another process takes ``key`` at once (``wait=False``); it lets go."""
        probe = self.start("--using", using, "hold", key, "--try")
        event = probe.message()["event"]
        probe.finish()
        return event == "acquired"


@pytest.fixture
def processes():
    processes = Processes()
    try:
        yield processes
    finally:
        processes.kill_all()


def started_holding(processes, using, case, key, *args):
    """Start a holder of ``key`` and wait until its lock is held in an open transaction."""
    holder = processes.holder(using, case, key, *args)
    holder.expect("acquired")
    assert not is_free(key, using), "the lock is held until its transaction ends"
    return holder


#: How to ask a server whether a session still exists.
SESSION_EXISTS = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
    "mysql": "SELECT count(*) FROM information_schema.processlist WHERE id = %s",
}


def kill_session(using, session, timeout=15.0):
    """Kill the server session ``session`` from another connection, and wait (bounded) until
    the server has ended it: anything its client sends afterwards fails."""
    kill_connection_of(using, session)
    sql = SESSION_EXISTS[connections[using].vendor]

    def exists():
        with connections[using].cursor() as cursor:
            cursor.execute(sql, [session])
            return cursor.fetchone()[0] > 0

    deadline = time.monotonic() + timeout
    while in_other_connection(exists):
        assert time.monotonic() < deadline, f"session {session} still there {timeout:g}s later"
        time.sleep(0.02)


# The outermost transaction ends


def test_lock_taken_inside_atomic_is_free_once_it_commits(using, processes):
    key = "transaction-end:commit"
    holder = started_holding(processes, using, "commit", key)

    holder.send("commit")

    assert holder.expect("ended")["error"] is None
    assert is_free(key, using), "still held after its transaction committed"
    assert processes.free_for_another_process(key, using)


def test_lock_taken_inside_atomic_is_free_once_an_exception_rolls_it_back(using, processes):
    key = "transaction-end:raise"
    holder = started_holding(processes, using, "raise", key)

    holder.send("raise")

    assert holder.expect("ended")["error"] == "Boom"
    assert is_free(key, using), "still held after its transaction rolled back"
    assert processes.free_for_another_process(key, using)


def test_lock_taken_inside_atomic_is_free_once_set_rollback_rolls_it_back(using, processes):
    key = "transaction-end:set-rollback"
    holder = started_holding(processes, using, "set-rollback", key)

    holder.send("set-rollback")

    assert holder.expect("ended")["error"] is None
    assert is_free(key, using), "still held after set_rollback(True) rolled it back"
    assert processes.free_for_another_process(key, using)


def make_the_rollback_fail(holder, using, session, *, reconnecting_fails=False):
    """Break the holder's connection under Django before it raises out of ``atomic``, so
    that Django's ROLLBACK fails and Django closes the connection."""
    unreachable = " unreachable" if reconnecting_fails else ""
    if connections[using].vendor == "sqlite":
        # No server session to kill: the holder closes the sqlite3 connection under Django
        # ("Cannot operate on a closed database"), as a dead server closes a socket.
        holder.send("close-driver-connection" + unreachable)
    else:
        kill_session(using, session)
        holder.send("raise" + unreachable)


def test_lock_taken_inside_atomic_is_free_once_a_failed_rollback_closed_the_connection(
    using, processes
):
    key = "transaction-end:failed-rollback"
    holder = processes.holder(using, "failed-rollback", key)
    session = holder.expect("acquired")["session"]
    assert not is_free(key, using), "the lock is held until its transaction ends"

    make_the_rollback_fail(holder, using, session)

    ended = holder.expect("ended")
    assert ended["error"] == "Boom", "the block's own exception leaves atomic unchanged"
    assert ended["dropped"], "Django's rollback failed, so Django closed the connection"
    # Django then opens a new connection at once, in atomic's exit (to turn autocommit back
    # on), which may release what the old one held: the next test is the same without it.
    assert is_free(key, using), "still held after the failed rollback closed the connection"
    assert processes.free_for_another_process(key, using)


def test_lock_taken_inside_atomic_is_free_once_a_failed_rollback_closed_the_connection_for_good(
    using, processes
):
    key = "transaction-end:failed-rollback-for-good"
    holder = processes.holder(using, "failed-rollback", key)
    session = holder.expect("acquired")["session"]
    assert not is_free(key, using), "the lock is held until its transaction ends"

    make_the_rollback_fail(holder, using, session, reconnecting_fails=True)

    ended = holder.expect("ended")
    # Django 5.2 connects again in atomic's exit; that fails here, and its OperationalError
    # leaves atomic in place of the block's exception, which is in its __context__ chain.
    assert "Boom" in [ended["error"], *ended["context"]], ended
    assert ended["dropped"], "Django's rollback failed, so Django closed the connection"
    assert is_free(key, using), "still held after the failed rollback closed the connection"
    assert processes.free_for_another_process(key, using)


def test_lock_taken_inside_a_durable_atomic_block_is_free_once_it_rolls_back(using, processes):
    key = "transaction-end:durable"
    holder = started_holding(processes, using, "durable", key)

    holder.send("raise")

    assert holder.expect("ended")["error"] == "Boom"
    assert is_free(key, using), "still held after its durable block rolled back"


def test_lock_kept_alive_by_user_code_is_free_once_its_transaction_rolls_back(using, processes):
    key = "transaction-end:kept-alive"
    holder = started_holding(processes, using, "kept-alive", key)

    holder.send("raise")

    ended = holder.expect("ended")
    assert ended["error"] == "Boom" and ended["kept"] == 2, ended
    # The lock object, its handle and the caught exception (with its traceback) are all alive
    # in the holder: the release can't come from any of them being freed.
    assert is_free(key, using), "still held after its transaction rolled back"


# Savepoints


def test_lock_taken_in_a_savepoint_is_free_once_the_savepoint_rolls_back(using, processes):
    key, outer_key = "transaction-end:savepoint-inner", "transaction-end:savepoint-outer"
    holder = started_holding(processes, using, "savepoint", key, "--outer-key", outer_key)

    holder.send("raise")

    holder.expect("inner_ended")
    # The outer transaction is still open: the holder waits for a cue inside it.
    assert is_free(key, using), "still held after its savepoint rolled back"


def test_lock_of_the_outer_transaction_stays_held_after_a_savepoint_rolls_back(using, processes):
    key, outer_key = "transaction-end:savepoint-inner-2", "transaction-end:savepoint-outer-2"
    holder = started_holding(processes, using, "savepoint", key, "--outer-key", outer_key)
    holder.send("raise")
    holder.expect("inner_ended")

    assert not is_free(outer_key, using), "the outer transaction has not ended yet"
    holder.send("commit")
    assert holder.expect("ended")["error"] is None
    assert is_free(outer_key, using), "still held after the outer transaction committed"


# ATOMIC_REQUESTS views: free before the request ends (before the request_finished signal)


def test_lock_taken_by_a_view_under_atomic_requests_is_free_once_the_view_raised(using, processes):
    key = "transaction-end:view-raises"
    holder = started_holding(processes, using, "view-raises", key)

    holder.send("raise")

    # Said from the middleware's process_exception, which waits there for our cue: the
    # request has not ended, request_finished has not been sent.
    assert holder.expect("ended")["error"] == "Boom"
    assert is_free(key, using), "still held after the view's transaction rolled back"


def test_lock_taken_by_a_view_under_atomic_requests_is_free_once_set_rollback_rolled_it_back(
    using, processes
):
    key = "transaction-end:view-set-rollback"
    holder = started_holding(processes, using, "view-set-rollback", key)

    holder.send("set-rollback")

    # Said by the innermost middleware once the view returned, before the request ends.
    ended = holder.expect("ended")
    assert ended["error"] is None and ended["status"] == 200, ended
    assert is_free(key, using), "still held after the view's transaction rolled back"


# PostgreSQL: a session lock whose block ended in an aborted transaction (25P02)


@POSTGRESQL_ONLY
def test_session_lock_whose_block_failed_in_an_aborted_transaction_is_free_once_atomic_exits(
    using, processes
):
    key = "transaction-end:session-aborted"
    holder = started_holding(processes, using, "session-aborted", key)

    holder.send("fail")

    ended = holder.expect("ended")
    assert ended["error"] == "DataError" and ended["original"], (
        "the failed statement's own exception leaves the blocks unchanged"
    )
    assert is_free(key, using), "still held after the aborted transaction rolled back"


@POSTGRESQL_ONLY
def test_session_lock_whose_block_failed_in_an_aborted_savepoint_is_free_once_it_rolls_back(
    using, processes
):
    key = "transaction-end:session-aborted-savepoint"
    holder = started_holding(processes, using, "session-aborted-savepoint", key)

    holder.send("fail")

    inner = holder.expect("inner_ended")
    assert inner["error"] == "DataError" and inner["original"], (
        "the failed statement's own exception leaves the blocks unchanged"
    )
    # The outer transaction is still open: the holder waits for a cue inside it.
    assert is_free(key, using), "still held after the savepoint's rollback ended the failure"
