"""Fencing tokens: ``advisory_lock(key, fencing=True)`` gives each hold the key's next number,
and a holder that lost its lock writes nothing once a later holder has written.

Issue 31: nothing showed that fencing keeps the effects single around a loss. Here the loss is
real (the server ends the holder's session; on SQLite the lock's file is removed), the
superseded holder is a process of its own that goes on after the loss, and its write is the
documented fenced UPDATE.
"""

from __future__ import annotations

import uuid

import pytest
from django.db import connections

from advisory_lock import advisory_lock
from tests.test_async_locks import run
from tests.test_ledger_faults import children  # noqa: F401 (a fixture, asked for by name)
from tests.test_ledger_faults import lose_lock

TABLE = "fenced_effects"


@pytest.fixture
def effects(using):
    """A table of the user's own with a fence column: one row, fence 0."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, value VARCHAR(20) NOT NULL, "
            f"fence BIGINT NOT NULL)"
        )
        cursor.execute(f"INSERT INTO {TABLE} (id, value, fence) VALUES (1, '', 0)")
    yield TABLE
    with connections[using].cursor() as cursor:
        cursor.execute(f"DROP TABLE {TABLE}")


def fenced_write(using: str, value: str, token: int) -> int:
    """The documented fenced UPDATE: the rows it changed."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET value = %s, fence = %s WHERE id = 1 AND fence <= %s",
            [value, token, token],
        )
        return cursor.rowcount


def test_each_hold_gets_a_larger_token_of_its_key(using):
    key = f"report-{uuid.uuid4()}"
    tokens = []
    for _ in range(3):
        with advisory_lock(key, using=using, fencing=True) as lock:
            tokens.append(lock.token)
    assert tokens == [1, 2, 3]
    with advisory_lock(f"other-{uuid.uuid4()}", using=using, fencing=True) as other:
        assert other.token == 1  # a key's tokens are its own

    async def in_async_code() -> int | None:
        async with advisory_lock(key, using=using, fencing=True) as lock:
            return lock.token

    assert run(in_async_code()) == 4  # which closes the connections of asgiref's thread
    with advisory_lock(key, using=using) as plain:
        assert plain.token is None  # no fencing asked: no statement, no token


def test_a_superseded_holders_write_changes_nothing(using, effects, children):  # noqa: F811
    key = f"import:{uuid.uuid4()}"
    child = children.start("--using", using, "fenced-write", key, TABLE)
    superseded = child.expect("holding")["token"]
    lose_lock(key, using)  # the child holds it no more, and does not know yet
    with advisory_lock(key, using=using, fencing=True) as lock:
        assert lock.token > superseded
        assert fenced_write(using, "later holder", lock.token) == 1
    child.send("go")
    assert child.expect("wrote")["rows"] == 0  # its late write changed nothing
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT value, fence FROM {TABLE} WHERE id = 1")
        assert cursor.fetchone() == ("later holder", lock.token)
