"""The network between a @single_instance command and its database turns into a black hole.

The command's lock connection goes through a BlackHoleProxy (a thread of this test process;
the worker runs with tests.faults.proxy_settings: its "default" alias through the proxy, or
only a "locks" alias that ADVISORY_LOCK["DIRECT_ALIAS"] names). Then the proxy stops
forwarding both ways without closing anything: the holder hears nothing, nor does the server.

* The holder: its watchdog counts a check that gets no answer within the heartbeat as a
  lost lock, so it stops within 2 heartbeats (the next check, then its wait) and exits 1.
* The server: it still sees a healthy, idle session holding the lock. TCP keepalive does not
  help (the proxy's kernel ACKs the probes, as a hung but living peer or middlebox does);
  only an idle timeout on the server ends the session and frees the lock: PostgreSQL
  ``idle_session_timeout``, MySQL/MariaDB ``wait_timeout``. A healthy holder's checks keep
  its session busy (idle at most a heartbeat); a timeout over 2 heartbeats (plus the time
  the command takes to stop) ends the session only after the holder has stopped, so two
  instances never overlap.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.conf import settings
from django.db import connections

from advisory_lock import JobRun
from tests.commands import finish
from tests.commands import wait_for_line
from tests.faults.helpers import killed_at_the_end
from tests.faults.helpers import report
from tests.faults.helpers import start_through_proxy
from tests.faults.helpers import wait_until
from tests.faults.proxy import BlackHoleProxy
from tests.probes import is_free
from tests.servers import kill_connection_of

pytestmark = pytest.mark.faults

HEARTBEAT = 0.5  # of decorated_job and ledger_job
#: The server-side idle timeout of the holder's session, in seconds: 20 heartbeats. The
#: holder stops about 2 heartbeats after the black hole on an idle machine, and a few seconds
#: after on a loaded one; what the tests check is the order (the holder had stopped while
#: the server still held its lock), with the times only reported.
IDLE_TIMEOUT = 10.0
#: How long a step may take before the test counts it as hung: a guard, not a timing.
HANG = 120.0


@pytest.fixture
def proxy(using):
    """A BlackHoleProxy in front of ``using``'s server, closed after the test."""
    settings_dict = settings.DATABASES[using]
    with BlackHoleProxy(settings_dict["HOST"] or "127.0.0.1", settings_dict["PORT"]) as proxy:
        yield proxy


def black_hole_a_holder(
    using: str, proxy: BlackHoleProxy, until: str, *, layout: str, healthy_for: float
) -> tuple[float, float]:
    """Start decorated_job through the proxy, let it run ``healthy_for`` seconds, black-hole
    the proxy; return when the holder exited and when the server freed its lock (seconds
    after the black hole)."""
    key = "command:lockapp.decorated_job"
    holder = start_through_proxy(
        using,
        proxy.port,
        "decorated_job",
        "--until",
        until,
        idle_timeout=IDLE_TIMEOUT,
        layout=layout,
    )
    with killed_at_the_end(holder):
        wait_for_line(holder, "running")
        time.sleep(healthy_for)
        assert holder.poll() is None, holder.stderr.read()
        assert not is_free(key, using)

        black_holed_at = proxy.black_hole()
        status, _, err = finish(holder, timeout=HANG)
        holder_noticed = time.monotonic() - black_holed_at
        assert status == 1, err
        assert "was lost" in err and "CommandError" in err, err

        # The holder is gone, but nothing told the server: it holds the lock until the
        # session's idle timeout ends it. So the holder stopped before anyone else could
        # start (no overlap): that takes an idle timeout over 2 heartbeats.
        assert not is_free(key, using), "the server freed the lock before the holder stopped"
        # Only the idle timeout can free it (keepalive does not: the test below).
        wait_until(lambda: is_free(key, using), IDLE_TIMEOUT + HANG)
        server_freed = time.monotonic() - black_holed_at
    setting = {"postgresql": "idle_session_timeout", "mysql": "wait_timeout"}[using]
    report(
        f"{using} ({layout} through the proxy): black hole -> holder exited (1, lock lost) "
        f"after {holder_noticed:.2f}s; server freed the lock after {server_freed:.2f}s "
        f"({setting} = {IDLE_TIMEOUT:g}s)"
    )
    return holder_noticed, server_freed


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_black_hole_holder_stops_and_the_server_frees_the_lock(using, proxy, tmp_path):
    # A healthy holder outlives the idle timeout first: its checks keep the session busy.
    black_hole_a_holder(
        using, proxy, str(tmp_path / "never"), layout="default", healthy_for=IDLE_TIMEOUT + 0.5
    )


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_black_hole_with_the_idle_timeout_on_a_lock_only_alias(using, proxy, tmp_path):
    """The layout to recommend: ADVISORY_LOCK["DIRECT_ALIAS"] = {"default": "locks"}, and the
    idle timeout in the OPTIONS of "locks" only, so that it never ends the app's sessions."""
    black_hole_a_holder(using, proxy, str(tmp_path / "never"), layout="lock_alias", healthy_for=0)


@pytest.mark.parametrize("using", ["postgresql"], indirect=True)
def test_tcp_keepalive_does_not_free_the_lock_behind_a_black_hole(using, proxy, tmp_path):
    """Keepalive probes every second on both ends, no idle timeout: the lock stays held,
    because the proxy's kernel answers the probes. Closing the proxy frees it at once."""
    key = "command:lockapp.decorated_job"
    holder = start_through_proxy(
        using, proxy.port, "decorated_job", "--until", str(tmp_path / "never"), keepalive=True
    )
    with killed_at_the_end(holder):
        wait_for_line(holder, "running")
        black_holed_at = proxy.black_hole()
        assert finish(holder, timeout=HANG)[0] == 1
    # Keepalive would have given up after 1 s idle + 2 probes 1 s apart on a dead peer.
    time.sleep(max(0.0, black_holed_at + 4.0 - time.monotonic()))
    assert not is_free(key, using), "keepalive freed it: the proxy no longer models a black hole"
    proxy.close()  # the server's side of the connection closes: the lock goes with it
    wait_until(lambda: is_free(key, using), HANG)


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_black_hole_ledger_command_exits_with_lock_lost(using, proxy, tmp_path):
    """A ledger command records the end of its run in `finally`: on a black-holed network
    that must not keep it from stopping (its row stays running; the next claim, finding the
    lock free, marks it abandoned)."""
    holder = start_through_proxy(
        using,
        proxy.port,
        "ledger_job",
        "--until",
        str(tmp_path / "never"),
        idle_timeout=IDLE_TIMEOUT,
    )
    try:
        with killed_at_the_end(holder):
            wait_for_line(holder, "running")
            black_holed_at = proxy.black_hole()
            # Stuck in its `finally` on the silent network, it would never exit: the guard
            # tells that from a slow exit.
            deadline = black_holed_at + HANG
            while holder.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            exited = holder.poll() is not None
            assert exited, "the ledger command did not exit after losing its lock"
            status, _, err = finish(holder)
            assert status == 1 and "CommandError" in err and "was lost" in err, err
    finally:
        proxy.close()  # the server's side closes: it drops the lock now, not in 3 s
        wait_until(lambda: is_free("command:lockapp.ledger_job", using), HANG)
        JobRun.objects.using(using).filter(job_name="lockapp.ledger_job").delete()


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_holder_waiting_in_a_query_behind_the_black_hole_exits_1_after_the_loss(
    using, proxy, tmp_path
):
    """The command's body waits for an answer on its own connection through the proxy when
    the network goes silent: no answer will come (mysqlclient waits in C, out of reach of
    the watchdog's SIGINT), yet the process must end with status 1, within the exit
    deadline of the loss (10 s at this heartbeat), whatever its way out waits for."""
    holder = start_through_proxy(using, proxy.port, "decorated_job", "--query", "3600")
    try:
        with killed_at_the_end(holder):
            wait_for_line(holder, "running")
            wait_until(lambda: query_waits(using), HANG)  # the body's query reached the server
            proxy.black_hole()
            status, _, err = finish(holder, timeout=HANG)
            assert status == 1, err
            assert "was lost" in err, err
    finally:
        proxy.close()  # the server's side closes: the lock goes with it
        # The server notices the closed socket only when the query ends: end it.
        for session in sleeping_sessions(using):
            kill_connection_of(using, session)
    wait_until(lambda: is_free("command:lockapp.decorated_job", using), HANG)


def sleeping_sessions(using: str) -> list[int]:
    """The server's ids of this test database's sessions sleeping in the job's query."""
    sql = {
        "postgresql": (
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'SELECT pg_sleep(%%'"
        ),
        "mysql": (
            "SELECT ID FROM information_schema.PROCESSLIST WHERE DB = DATABASE() "
            "AND INFO LIKE 'SELECT SLEEP(%%'"
        ),
    }[using]
    with connections[using].cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


def query_waits(using: str) -> bool:
    """Is a session of this test database sleeping in the job's query, as the server says?"""
    return bool(sleeping_sessions(using))


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_kept_lock_connections_check_behind_the_black_hole_ends_at_its_deadline(using, proxy):
    """A scheduler's worker checks its run's lock on its own thread, with the deadline kept
    by its watchdog's thread (no thread per statement): behind a black hole the check still
    ends, the lock counted lost, and the release after it fails as lost, not hangs."""
    from advisory_lock.dedicated import DedicatedLock
    from advisory_lock.dedicated import close_dedicated_connection
    from advisory_lock.exceptions import LockLost

    shared = connections[using]
    through_proxy = {**shared.settings_dict, "HOST": "127.0.0.1", "PORT": proxy.port}
    connection = type(shared)(through_proxy, using)
    connection.inc_thread_sharing()
    lock = DedicatedLock("kept-black-hole", using=using, label="kept", connection=connection)
    assert lock.acquire(0)
    lock.watch(3600, lambda: None)  # its own checks never fall due here
    proxy.black_hole()
    outcome: list[object] = []

    def check_and_release() -> None:
        outcome.append(lock.verify(HEARTBEAT))
        try:
            lock.release()
        except LockLost as lost:
            outcome.append(lost)

    checker = threading.Thread(target=check_and_release, daemon=True)
    checker.start()
    checker.join(HANG)
    assert not checker.is_alive(), "the check behind the black hole did not end"
    close_dedicated_connection(connection)
    assert outcome[0] is False and lock.lost
    assert isinstance(outcome[1], LockLost)
