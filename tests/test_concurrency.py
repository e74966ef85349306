"""Concurrency between real OS processes (and threads): the lock excludes, and frees itself.

Each test runs on every database (fixture ``using``). Other processes are
``python -m tests.worker`` (see tests/worker.py for its commands); the test process itself
takes part through its own connection. The only time bounds asserted are the documented ones
(a 0.5 s timeout, a killed holder's lock freed within 1 s), with loose upper limits.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid

import pytest
from django.db import connections

from advisory_lock import LockNotAcquired
from advisory_lock import NotSupportedError
from advisory_lock import advisory_lock
from testproject.example.models import Counter
from tests.processes import Worker


@pytest.fixture
def key():
    """A key of this test's own, so that nothing left over from another test can hold it."""
    return f"concurrency-{uuid.uuid4().hex[:12]}"


def is_free(key: str, using: str, *, shared: bool = False) -> bool:
    """Try the lock once from this process; release it at once if it was free."""
    with advisory_lock(key, using=using, wait=False, shared=shared) as handle:
        return handle.acquired


def release(holder: Worker) -> dict:
    """Tell a ``hold`` worker to let go; return its ``releasing`` message once it has."""
    holder.send("release")
    releasing = holder.expect("releasing")
    holder.expect("released")
    holder.finish()
    return releasing


def test_eight_processes_never_hold_the_lock_at_once(using, workers, key, tmp_path):
    processes, iterations = 8, 40
    log, marker = tmp_path / "intervals.log", tmp_path / "inside"
    options = ("--iterations", iterations, "--log", log, "--marker", marker, "--hold-ms", 2)
    contenders = [
        workers.start("--using", using, "contend", key, "--id", i, *options)
        for i in range(processes)
    ]
    for contender in contenders:
        contender.expect("ready")
    for contender in contenders:  # all connected and waiting: start them together
        contender.send("go")
    results = [contender.expect("done") for contender in contenders]
    for contender in contenders:
        contender.finish()

    # Every worker did all its work: a lock that let nobody in, or skipped the critical
    # section, can't pass. Each critical section lasts 2 ms, so a lock that let everybody in
    # would show overlaps, both in the O_EXCL marker and in the intervals.
    assert [r["iterations"] for r in results] == [iterations] * processes
    assert [r["overlaps"] for r in results] == [0] * processes
    intervals = sorted(
        (float(enter), float(leave), int(worker))
        for worker, enter, leave in (line.split() for line in log.read_text().splitlines())
    )
    assert len(intervals) == processes * iterations
    overlapping = [(a, b) for a, b in itertools.pairwise(intervals) if b[0] < a[1]]
    assert overlapping == []


def test_a_try_fails_while_another_process_holds_the_lock_and_succeeds_after(using, workers, key):
    ran = []

    @advisory_lock(key, using=using, wait=False)
    def job():
        ran.append(True)

    holder = workers.start("--using", using, "hold", key)
    holder.expect("acquired")

    with advisory_lock(key, using=using, wait=False) as handle:
        assert not handle
        assert handle.acquired is False
    with pytest.raises(LockNotAcquired):
        job()
    assert ran == []

    release(holder)
    with advisory_lock(key, using=using, wait=False) as handle:
        assert handle
        assert handle.acquired is True
    job()
    assert ran == [True]


def test_a_bounded_wait_gives_up_after_its_timeout_and_a_longer_one_gets_the_lock(
    using, workers, key
):
    holder = workers.start("--using", using, "hold", key)
    holder.expect("acquired")
    waiter = workers.start("--using", using, "wait", key, "--timeout", 10)
    waiter.expect("waiting")

    started = time.monotonic()
    with pytest.raises(LockNotAcquired), advisory_lock(key, using=using, timeout=0.5):
        pytest.fail("the lock was taken while another process held it")
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 5, f"timeout=0.5 gave up after {elapsed:.3f}s"

    # The waiter has been waiting all along (half a second at least): it gets nothing yet...
    assert waiter.poll() is None
    releasing = release(holder)
    # ...and the lock as soon as the holder lets go.
    acquired = waiter.expect("acquired")
    assert acquired["at"] > releasing["at"]
    waiter.finish()
    assert is_free(key, using)


def test_shared_holds_coexist_and_exclude_an_exclusive_one(using, workers, key):
    if connections[using].vendor == "mysql":
        with pytest.raises(NotSupportedError), advisory_lock(key, using=using, shared=True):
            pytest.fail("MySQL has no shared named locks")
        return

    first = workers.start("--using", using, "hold", key, "--shared", "--try")
    first.expect("acquired")
    # A second reader gets in at once (a try, not a wait) while the first one holds it.
    second = workers.start("--using", using, "hold", key, "--shared", "--try")
    second.expect("acquired")
    assert is_free(key, using, shared=True)
    assert not is_free(key, using)
    release(first)
    assert not is_free(key, using), "the second reader still holds it"
    release(second)

    writer = workers.start("--using", using, "hold", key, "--try")
    writer.expect("acquired")
    assert not is_free(key, using, shared=True)
    assert not is_free(key, using)
    release(writer)
    assert is_free(key, using, shared=True)
    assert is_free(key, using)


def test_a_holder_killed_with_sigkill_frees_the_lock_within_a_second(using, workers, key):
    holder = workers.start("--using", using, "hold", key)
    holder.expect("acquired")
    assert not is_free(key, using)

    killed_at = time.monotonic()
    holder.proc.send_signal(signal.SIGKILL)
    while not is_free(key, using):
        assert time.monotonic() - killed_at < 10, "the lock is still held 10 s after the kill"
        time.sleep(0.02)
    freed_after = time.monotonic() - killed_at
    # Tens of ms when idle (printed); the bound is generous for a loaded machine.
    assert freed_after < 10, f"freed {freed_after:.3f}s after the kill"
    assert holder.proc.wait(5) == -signal.SIGKILL


def test_a_lock_ended_inside_atomic_is_held_until_commit_so_no_update_is_lost(using, workers, key):
    """Six processes increment one counter ten times each: read, then write value + 1.

    Each worker runs ``with atomic(): with advisory_lock(): read; sleep; write`` and then
    sleeps after the lock block, before the commit. A naive lock released at the end of its
    block would let the next process read the counter there, before our commit: it reads
    the old value (READ COMMITTED / a snapshot) and writes the same value + 1 as we do, once
    our row lock goes, so an increment is lost. (Measured with ``--scope session``, which is
    exactly that naive lock: lost updates on PostgreSQL and MariaDB; on SQLite the second
    writer fails with "database is locked" instead.) The lock taken inside atomic must be
    held until the commit, so the count is exact.
    """
    processes, iterations = 6, 10
    name = f"counter-{key}"
    Counter.objects.using(using).create(name=name, value=0)
    try:
        counters = [
            workers.start("--using", using, "count", key, name, "--iterations", iterations)
            for _ in range(processes)
        ]
        for counter in counters:
            counter.expect("ready")
        for counter in counters:
            counter.send("go")
        results = [counter.expect("done") for counter in counters]
        for counter in counters:
            counter.finish()
        assert [r["committed"] for r in results] == [iterations] * processes
        assert Counter.objects.using(using).get(name=name).value == processes * iterations
    finally:
        Counter.objects.using(using).filter(name=name).delete()


def test_two_threads_of_one_process_exclude_each_other(using, key):
    a_holds, b_tried, a_released = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    errors: list[BaseException] = []

    def thread_a():
        try:
            with advisory_lock(key, using=using, wait=False) as handle:
                seen["a holds"] = handle.acquired
                seen["a connection"] = connections[using]
                a_holds.set()
                assert b_tried.wait(10)
            a_released.set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            a_holds.set()
            a_released.set()
            connections.close_all()

    def thread_b():
        try:
            assert a_holds.wait(10)
            seen["b connection"] = connections[using]
            seen["b while a holds"] = is_free(key, using)
            b_tried.set()
            assert a_released.wait(10)
            seen["b after a released"] = is_free(key, using)
        except BaseException as exc:
            errors.append(exc)
        finally:
            b_tried.set()
            connections.close_all()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    if errors:
        raise errors[0]
    assert seen["a connection"] is not seen["b connection"]
    assert seen["a holds"] is True
    assert seen["b while a holds"] is False
    assert seen["b after a released"] is True
