"""Timeouts longer than the server can wait are refused before any SQL, naming the limit.

PostgreSQL bounds a wait with ``lock_timeout``, an int of milliseconds: at most 2**31 - 1 ms,
2147483.647 s (about 24.8 days). MySQL and MariaDB take ``GET_LOCK``'s timeout in seconds:
at most 2**31 - 1 here (beyond it MariaDB returns NULL, as if the connection were killed). A
longer timeout must not reach the server, whether the lock is busy or free: the same call
must not work or fail depending on who holds the lock. SQLite's file locks have no limit.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from advisory_lock import advisory_lock
from tests.probes import in_other_connection

servers = pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)

#: The longest timeout each server can take, in seconds.
LONGEST = {"postgresql": 2147483.647, "mysql": 2**31 - 1}
#: Just over it (one millisecond, one second), and far over it.
TOO_LONG = {
    "postgresql": {"just_over": 2147483.648, "far_over": 1e20},
    "mysql": {"just_over": 2**31, "far_over": 1e20},
}


class held_elsewhere:
    """Another connection holds ``key`` for at most ``seconds`` (it lets go earlier at exit)."""

    def __init__(self, key, using, seconds=5.0):
        self.ready, self.done = threading.Event(), threading.Event()

        def hold():
            with advisory_lock(key, using=using):
                self.ready.set()
                self.done.wait(seconds)

        self.thread = threading.Thread(target=lambda: in_other_connection(hold))

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10), "the other connection did not take the lock"
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(30)


@servers
@pytest.mark.parametrize("lock", ["busy", "free"])
@pytest.mark.parametrize("length", ["just_over", "far_over"])
def test_a_timeout_longer_than_the_server_can_wait_is_refused_before_any_sql(using, lock, length):
    key = f"timeouts:{lock}"
    timeout = TOO_LONG[connections[using].vendor][length]
    holder = held_elsewhere(key, using) if lock == "busy" else None
    if holder:
        holder.__enter__()
    try:
        with CaptureQueriesContext(connections[using]) as queries:
            with pytest.raises(ValueError, match="2147483"):
                with advisory_lock(key, using=using, timeout=timeout):
                    pytest.fail("the body must not run")
    finally:
        if holder:
            holder.__exit__(None, None, None)
    assert queries.captured_queries == [], "refused before any statement"


@servers
def test_the_limit_is_exactly_the_longest_timeout_the_server_can_wait(using):
    vendor = connections[using].vendor
    with advisory_lock("timeouts:longest", using=using, timeout=LONGEST[vendor]) as handle:
        assert handle.acquired  # a free key: taken at once
    with pytest.raises(ValueError, match="2147483"):
        with advisory_lock("timeouts:longest", using=using, timeout=TOO_LONG[vendor]["just_over"]):
            pytest.fail("the body must not run")


@pytest.mark.parametrize("using", ["default"], indirect=True)
def test_sqlite_accepts_any_finite_timeout(using):
    with advisory_lock("timeouts:sqlite", using=using, timeout=1e20) as handle:
        assert handle.acquired
