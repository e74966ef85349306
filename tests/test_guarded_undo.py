"""Whatever ends a run between taking its lock and recording its end, nothing is left held
(issue 19, item 8).

A heartbeat that can't be waited on (``1e300``, beyond ``threading.TIMEOUT_MAX``) is refused
with a ValueError before any lock or row: it used to pass the checks and raise OverflowError
once the lock was taken and the slot claimed, leaving both held. And any exception between
the take and the finish, ``KeyboardInterrupt`` and ``SystemExit`` included, and wherever it
comes from (the metrics recorder, the watchdog's start, the body, the ledger's write), lets
go of the lock, closes its connection, stops the watchdog, and records the run failed.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import advisory_lock.ledger as ledger_module
from advisory_lock import JobRun
from advisory_lock import metrics
from advisory_lock import run_once
from advisory_lock import single_instance
from advisory_lock.dedicated import DedicatedLock
from advisory_lock.single_instance import GuardedRun
from tests.leftovers import open_lock_connections
from tests.leftovers import run_threads
from tests.leftovers import track_dedicated_locks
from tests.probes import is_free

UNREPRESENTABLE = [1e300, threading.TIMEOUT_MAX, float("inf"), float("nan"), 0, -1]


@pytest.fixture
def dedicated_locks(monkeypatch):
    return track_dedicated_locks(monkeypatch)


@pytest.fixture
def ledger(using):
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


def assert_nothing_held(using, key, locks):
    assert is_free(key, using), f"the lock {key!r} is still held"
    assert not open_lock_connections(locks), "a lock connection is still open"
    assert not run_threads(), f"threads left: {run_threads()}"


def statuses(ledger, job_name):
    rows = ledger.filter(job_name=job_name).order_by("attempt")
    return list(rows.values_list("status", flat=True))


# A heartbeat that can't be waited on: refused before anything is taken.


@pytest.mark.parametrize("heartbeat", UNREPRESENTABLE)
def test_run_once_refuses_a_heartbeat_it_cannot_wait_on(using, ledger, dedicated_locks, heartbeat):
    with pytest.raises(ValueError, match="heartbeat"):
        with run_once("huge-heartbeat", using=using, heartbeat=heartbeat):
            pytest.fail("the body ran")
    assert ledger.count() == 0
    assert dedicated_locks == []
    assert_nothing_held(using, "job:huge-heartbeat", dedicated_locks)


@pytest.mark.parametrize("heartbeat", UNREPRESENTABLE)
def test_single_instance_refuses_a_heartbeat_it_cannot_wait_on(using, ledger, heartbeat):
    def job():
        pytest.fail("the body ran")

    async def ajob():
        pytest.fail("the body ran")

    for func in (job, ajob):
        with pytest.raises(ValueError, match="heartbeat"):
            single_instance(key="huge", using=using, ledger="once", heartbeat=heartbeat)(func)
    with pytest.raises(ValueError, match="heartbeat"):
        GuardedRun("huge", using=using, label="huge", heartbeat=heartbeat)
    assert ledger.count() == 0
    assert is_free("huge", using)


def test_the_longest_heartbeat_allowed_works(using, ledger, dedicated_locks):
    longest = threading.TIMEOUT_MAX / 2
    with run_once("long-heartbeat", using=using, period="once", heartbeat=longest) as run:
        assert run is not None
    assert statuses(ledger, "long-heartbeat") == ["succeeded"]
    assert_nothing_held(using, "job:long-heartbeat", dedicated_locks)


# An exception between the take and the finish.


class Interrupted(BaseException):
    """Raised where nothing expects it (a BaseException, as KeyboardInterrupt is)."""


def interrupt(*args, **kwargs):
    raise Interrupted("injected")


class RaisingRecorder:
    """A metrics recorder that raises once the lock is taken (its acquisition is recorded)."""

    def acquisition(self, outcome, *args, **kwargs):
        if outcome == "acquired":
            raise Interrupted("the metrics recorder failed")

    def held(self, *args, **kwargs):
        pass

    def lost(self, *args, **kwargs):
        pass

    def job_run(self, *args, **kwargs):
        pass


def run_sync(kind, using, name):
    """Run a sync job of ``kind`` once; its lock key."""
    if kind == "run_once":
        with run_once(name, using=using, period="once"):
            pass
        return f"job:{name}"

    @single_instance(key=name, using=using, ledger="once")
    def job():
        pass

    job()
    return name


def run_async(kind, using, name):
    """Run an async job of ``kind`` once; its lock key."""
    if kind == "run_once":

        async def main():
            async with run_once(name, using=using, period="once"):
                pass

        asyncio.run(main())
        return f"job:{name}"

    @single_instance(key=name, using=using, ledger="once")
    async def job():
        pass

    asyncio.run(job())
    return name


def job_name_of(kind, name, runner):
    """The ledger's job name of the job ``runner`` makes."""
    return name if kind == "run_once" else f"{__name__}.{runner.__name__}.<locals>.job"


KINDS = pytest.mark.parametrize("kind", ["run_once", "single_instance"])
RUNNERS = pytest.mark.parametrize("runner", [run_sync, run_async], ids=["sync", "async"])


@KINDS
@RUNNERS
def test_a_failing_metrics_recorder_after_the_take_leaves_nothing_held(
    using, ledger, dedicated_locks, monkeypatch, kind, runner
):
    monkeypatch.setattr(metrics, "recorder", RaisingRecorder())
    name = f"recorder-{runner.__name__}"
    with pytest.raises(Interrupted):
        runner(kind, using, name)
    monkeypatch.setattr(metrics, "recorder", None)
    key = name if kind == "single_instance" else f"job:{name}"
    assert ledger.count() == 0  # the slot was never claimed
    assert_nothing_held(using, key, dedicated_locks)


@KINDS
@RUNNERS
def test_a_failure_to_start_the_watchdog_after_the_claim_leaves_nothing_held(
    using, ledger, dedicated_locks, monkeypatch, kind, runner
):
    monkeypatch.setattr(DedicatedLock, "watch", interrupt)
    name = f"watch-{runner.__name__}"
    with pytest.raises(Interrupted):
        runner(kind, using, name)
    monkeypatch.undo()
    key = name if kind == "single_instance" else f"job:{name}"
    assert_nothing_held(using, key, dedicated_locks)
    job_name = job_name_of(kind, name, runner)
    assert statuses(ledger, job_name) == ["failed"]
    assert "Interrupted: injected" in ledger.get(job_name=job_name).error
    # The slot's failed attempt is claimed again by the next run.
    runner(kind, using, name)
    assert statuses(ledger, job_name) == ["failed", "succeeded"]


@KINDS
@RUNNERS
def test_a_failing_ledger_write_at_the_end_still_lets_go_of_the_lock(
    using, ledger, dedicated_locks, monkeypatch, kind, runner
):
    monkeypatch.setattr(ledger_module, "finish", interrupt)
    name = f"finish-{runner.__name__}"
    with pytest.raises(Interrupted):
        runner(kind, using, name)
    monkeypatch.undo()
    key = name if kind == "single_instance" else f"job:{name}"
    assert_nothing_held(using, key, dedicated_locks)
    # Its row could not be finished; its lock is free, so the next run marks it abandoned.
    job_name = job_name_of(kind, name, runner)
    assert statuses(ledger, job_name) == ["running"]
    runner(kind, using, name)
    assert statuses(ledger, job_name) == ["abandoned", "succeeded"]


@pytest.mark.parametrize("exception", [KeyboardInterrupt, SystemExit, Interrupted])
def test_a_body_that_raises_a_base_exception_is_recorded_and_lets_go(
    using, ledger, dedicated_locks, exception
):
    @run_once("base-exception", using=using, period="once")
    def job():
        raise exception("from the body")

    with pytest.raises(exception):
        job()
    assert statuses(ledger, "base-exception") == ["failed"]
    assert exception.__name__ in ledger.get().error
    assert_nothing_held(using, "job:base-exception", dedicated_locks)
