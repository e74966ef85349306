"""A plain lock's heartbeat: ``advisory_lock(key, heartbeat=N)`` learns of a loss during its
block, not at its end.

Issue 31: tried as a new user would, a server restart let a second process take
``import:tenant-42`` at once while the first kept working inside its block, and learned of it
only at the block's end. The losses here are real: the server ends the holding session
(PostgreSQL ``pg_terminate_backend``, MySQL ``KILL``), or the lock's file is removed
(SQLite), and another process or connection then takes the lock. Every wait is for a state (the
handle's flag, the callback, the server's own view), guarded against a hang only.
"""

from __future__ import annotations

import asyncio

import pytest
from django.db import connections

from advisory_lock import LockLost
from advisory_lock import advisory_lock
from advisory_lock.backends import backend_for
from tests.probes import freed
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.schedulers import wait_for
from tests.test_async_locks import run
from tests.test_ledger_faults import children  # noqa: F401 (a fixture)
from tests.test_ledger_faults import lose_lock

KEY = "import:tenant-42"
#: Seconds between a heartbeat's checks in these tests.
BEAT = 0.05


def test_a_lost_lock_is_known_inside_its_block(using, children):  # noqa: F811
    """The holder is a process of its own. Once the server has ended its session (SQLite:
    its lock file removed), ``on_lost`` is called once, with the handle's ``lost`` set, while
    its block still runs; this process can take the lock meanwhile; ``check()`` then raises
    ``LockLost`` saying that the block no longer runs alone."""
    child = children.start("--using", using, "heartbeat", KEY, "--beat", BEAT)
    child.expect("holding")
    lose_lock(KEY, using)
    assert child.expect("lost")["flag"] is True  # said by on_lost, inside the block
    assert is_free(KEY, using)  # another process takes it while that block runs
    child.send("go")
    checked = child.expect("checked")["error"]  # and no second "lost" before it
    assert "was lost during the block" in checked, checked
    assert "no longer running alone" in checked, checked
    ended = child.expect("ended")["error"]
    if connections[using].vendor != "sqlite":  # a removed file releases nothing
        assert "was lost during the block" in ended, ended


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_a_held_lock_is_not_reported_lost(using):
    """Checks that find the lock held change nothing: the heartbeat's connection has asked
    (the server's own view of it), and the block ends as usual."""
    called = []
    asked: set[object] = set()  # when each check of the heartbeat's connection started

    def checks() -> int:
        asked.update(_heartbeat_checks(using))
        return len(asked)

    with advisory_lock(KEY, using=using, heartbeat=BEAT, on_lost=called.append) as lock:
        wait_for(lambda: checks() >= 3, "three checks of the heartbeat")
        assert not lock.lost
        lock.check()
    assert called == []
    assert is_free(KEY, using)


def _heartbeat_checks(using: str) -> list[object]:
    """When the last check of each heartbeat connection started (PostgreSQL's own view)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT query_start FROM pg_stat_activity WHERE application_name LIKE %s "
            "AND query LIKE %s",
            ["%heartbeat%", "%pg_locks%"],
        )
        return [start for (start,) in cursor.fetchall()]


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_the_heartbeat_cancels_the_holding_task_which_raises_lock_lost(using):
    """``on_lost="cancel"`` in async code: the task that holds the lock is cancelled, and the
    block ends with ``LockLost``, not a bare cancellation."""

    async def hold() -> str:
        async with advisory_lock(KEY, using=using, heartbeat=BEAT, on_lost="cancel"):
            session = await asyncio.to_thread(_session_of_holder, using)
            await asyncio.to_thread(_kill_session, using, session)
            # The hang guard only: the cancellation comes first.
            await asyncio.wait_for(asyncio.Event().wait(), timeout=300)
        return "the block ran to its end"

    with pytest.raises(LockLost) as lost:
        run(hold())  # which closes the connections of asgiref's thread after it
    error = str(lost.value)
    assert "was lost during the block" in error, error
    assert freed(KEY, using)


def _session_of_holder(using: str) -> int:
    """The server's id of the session holding KEY (its lock table's view)."""
    from advisory_lock.backends import inspector_for
    from advisory_lock.keys import make_key

    def ask() -> int:
        connection = connections[using]
        holder = inspector_for(connection).holder(backend_for(connection).db_key(make_key(KEY)))
        assert holder is not None
        return holder.id

    result: list[int] = []
    in_other_connection(lambda: result.append(ask()))
    return result[0]


def _kill_session(using: str, session: int) -> None:
    from tests.servers import kill_connection_of

    in_other_connection(lambda: kill_connection_of(using, session))


def test_the_heartbeat_is_checked_when_the_lock_is_made(using):
    with pytest.raises(ValueError, match="pass heartbeat="):
        advisory_lock(KEY, using=using, on_lost=print)
    with pytest.raises(TypeError, match="callable or 'cancel'"):
        advisory_lock(KEY, using=using, heartbeat=1, on_lost="raise")
    with pytest.raises(ValueError, match="heartbeat"):
        advisory_lock(KEY, using=using, heartbeat=0)
    with pytest.raises(ValueError, match="async with"):
        with advisory_lock(KEY, using=using, heartbeat=1, on_lost="cancel"):
            pass
    assert is_free(KEY, using)  # the refused heartbeat let go of the lock
