"""Cancelling an async ``run_once`` or ``@single_instance`` function leaves nothing behind
(issue 19, item 1).

On each backend, hundreds of calls are cancelled at random points: before the task starts,
while the lock is taken and the slot claimed (in a worker thread), during the body, as the
body returns (while the end is recorded), twice in a row, and among concurrent calls of the
same job. After each call, from other connections and from this process: the lock is free,
every lock connection the calls opened is closed, no watchdog or check thread is alive, no
row of the job is left ``running``, every failed row says "cancelled", and a cancellation
that was requested propagated as ``CancelledError`` (or ``TimeoutError`` from ``wait_for``).
The order of events is made with events; the random delays are the cancellation points.

``ADVISORY_LOCK_CANCEL_ITERATIONS`` (default 150 per kind of job) and
``ADVISORY_LOCK_CANCEL_SEED`` (default: random, printed in every failure) reproduce a run.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import Counter

import pytest

from advisory_lock import JobRun
from advisory_lock import advisory_lock
from advisory_lock import run_once
from advisory_lock import single_instance
from tests.leftovers import lock_sessions
from tests.leftovers import open_lock_connections
from tests.leftovers import run_threads
from tests.leftovers import track_dedicated_locks
from tests.leftovers import wait_for_sessions
from tests.probes import in_other_connection

ITERATIONS = int(os.environ.get("ADVISORY_LOCK_CANCEL_ITERATIONS", "150"))
SEED = int(os.environ.get("ADVISORY_LOCK_CANCEL_SEED") or random.SystemRandom().randrange(10**9))
#: Random cancellations land within this many seconds of the call: taking the lock and
#: claiming the slot take a few milliseconds on every backend.
LONGEST_DELAY = 0.012
RUNNING, FAILED = JobRun.Status.RUNNING, JobRun.Status.FAILED


@pytest.fixture
def dedicated_locks(monkeypatch):
    return track_dedicated_locks(monkeypatch)


@pytest.fixture
def ledger(using):
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


class Body:
    """The body of a call: ``hold`` seconds (None: until cancelled), with events for the
    test to cancel on."""

    def __init__(self, hold):
        self.hold = hold
        self.entered = asyncio.Event()
        self.returning = asyncio.Event()

    async def __call__(self):
        self.entered.set()
        if self.hold is None:
            await asyncio.Event().wait()
        elif self.hold:
            await asyncio.sleep(self.hold)
        self.returning.set()  # no await after this: the call goes on to record the end
        return "done"


# The jobs under test: (the async job taking a Body, its lock key, its ledger job name or None).


def run_once_decorator(using, slot):
    @run_once("cancel-once", period=lambda now: slot[0], using=using)
    async def job(body):
        return await body()

    return job, "job:cancel-once", "cancel-once"


def run_once_block(using, slot):
    async def job(body):
        async with run_once("cancel-block", period=lambda now: slot[0], using=using) as run:
            if run is None:
                return None
            return await body()

    return job, "job:cancel-block", "cancel-block"


def single_instance_with_ledger(using, slot):
    @single_instance(key="cancel:ledger", using=using, ledger=lambda now: slot[0])
    async def job(body):
        return await body()

    return job, "cancel:ledger", f"{job.__module__}.{job.__qualname__}"


def single_instance_lock_only(using, slot):
    @single_instance(key="cancel:lock-only", using=using)
    async def job(body):
        return await body()

    return job, "cancel:lock-only", None


JOBS = {
    "run_once": run_once_decorator,
    "run_once-block": run_once_block,
    "single_instance-ledger": single_instance_with_ledger,
    "single_instance": single_instance_lock_only,
}


# The ways a call is cancelled. Each returns what happened: "cancelled", "done", "skipped".


async def until(event, task):
    """Wait until ``event`` is set or ``task`` is done (a skipped call never enters its body)."""
    waiter = asyncio.ensure_future(event.wait())
    await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


def outcome(task, requested):
    """What became of ``task``; a cancellation that was requested must have propagated."""
    if requested:
        assert task.cancelled(), f"cancelled, yet the call ended with {task!r}"
        return "cancelled"
    return "done" if task.result() == "done" else "skipped"


async def before_it_starts(job, rng):
    task = asyncio.ensure_future(job(Body(None)))
    task.cancel()
    await asyncio.wait({task})
    return outcome(task, True)


async def wait_for_timeout(job, rng):
    # The body never returns: the timeout always fires, wherever the call is then.
    try:
        result = await asyncio.wait_for(job(Body(None)), rng.uniform(0, LONGEST_DELAY))
    except TimeoutError:
        return "cancelled"
    assert result is None, f"wait_for returned {result!r}"
    return "skipped"


async def at_a_random_time(job, rng):
    body = Body(rng.choice([0, None, rng.uniform(0, LONGEST_DELAY)]))
    task = asyncio.ensure_future(job(body))
    fired, requested = asyncio.Event(), []

    def cancel():
        requested.append(task.cancel())
        fired.set()

    asyncio.get_running_loop().call_later(rng.uniform(0, LONGEST_DELAY), cancel)
    await fired.wait()
    await asyncio.wait({task})
    return outcome(task, requested[0])


async def twice(job, rng):
    """A second cancellation lands while the first one is being handled."""
    task = asyncio.ensure_future(job(Body(rng.choice([0, None]))))
    loop = asyncio.get_running_loop()
    fired, requested = asyncio.Event(), []
    first = rng.uniform(0, LONGEST_DELAY)

    def cancel():
        requested.append(task.cancel())
        if len(requested) == 2:
            fired.set()

    loop.call_later(first, cancel)
    loop.call_later(first + rng.uniform(0, LONGEST_DELAY / 3), cancel)
    await fired.wait()
    await asyncio.wait({task})
    return outcome(task, requested[0])


async def in_the_body(job, rng):
    body = Body(None)
    task = asyncio.ensure_future(job(body))
    await until(body.entered, task)
    requested = task.cancel()
    await asyncio.wait({task})
    return outcome(task, requested)


async def as_the_body_returns(job, rng):
    body = Body(0)
    task = asyncio.ensure_future(job(body))
    await until(body.returning, task)
    requested = task.cancel()  # the end is being recorded
    await asyncio.wait({task})
    return outcome(task, requested)


async def in_a_crowd(job, rng):
    """Three calls of the job at once, each cancelled at a random time or not at all."""
    loop = asyncio.get_running_loop()
    calls = []
    for _ in range(3):
        task = asyncio.ensure_future(job(Body(rng.uniform(0, LONGEST_DELAY))))
        fired, requested = asyncio.Event(), []

        def cancel(task=task, fired=fired, requested=requested):
            requested.append(task.cancel())
            fired.set()

        if rng.random() < 0.7:
            loop.call_later(rng.uniform(0, LONGEST_DELAY), cancel)
        else:
            fired.set()
            requested.append(False)
        calls.append((task, fired, requested))
    results = []
    for task, fired, requested in calls:
        await fired.wait()
        await asyncio.wait({task})
        results.append(outcome(task, requested[0]))
    return "+".join(sorted(results))


MODES = [
    before_it_starts,
    wait_for_timeout,
    at_a_random_time,
    at_a_random_time,
    twice,
    in_the_body,
    as_the_body_returns,
    in_a_crowd,
]


def assert_nothing_left(using, key, job_name, locks, threads, context):
    """Nothing of the job's calls is left: lock, connections, threads (beyond ``threads``,
    those alive before the test), running rows."""
    assert not open_lock_connections(locks), f"{context}: a lock connection is still open"
    assert run_threads() == threads, f"{context}: threads left: {run_threads()}"

    def look():
        with advisory_lock(key, using=using, wait=False) as handle:
            free = handle.acquired
        if job_name is None:
            return free, [], []
        rows = JobRun.objects.using(using).filter(job_name=job_name)
        running = list(rows.filter(status=RUNNING).values_list("pk", flat=True))
        failed = rows.filter(status=FAILED).exclude(error__contains="cancelled")
        return free, running, list(failed.values_list("error", flat=True))

    free, running, not_cancelled = in_other_connection(look)
    assert free, f"{context}: the lock {key!r} is still held"
    assert not running, f"{context}: rows {running} left running"
    assert not not_cancelled, f"{context}: failed rows that don't say cancelled: {not_cancelled}"


@pytest.mark.parametrize("kind", list(JOBS))
def test_cancelled_calls_leave_nothing_behind(using, ledger, dedicated_locks, kind):
    rng = random.Random(f"{SEED}:{using}:{kind}")
    slot = ["slot-0"]
    job, key, job_name = JOBS[kind](using, slot)
    sessions_before = lock_sessions(using)
    threads_before = run_threads()
    seen = Counter()

    async def main():
        for iteration in range(ITERATIONS):
            # A new slot every few calls: fresh claims, retries of cancelled (failed)
            # attempts, and skips of a slot that a call completed.
            slot[0] = f"slot-{iteration // 4}"
            mode = rng.choice(MODES)
            locks_before = len(dedicated_locks)
            context = f"seed {SEED}, {kind}, iteration {iteration}, {mode.__name__}"
            result = await mode(job, rng)
            took = len(dedicated_locks) > locks_before
            assert not (took and mode is before_it_starts), f"{context}: it ran"
            seen[(mode.__name__, result, "took a lock" if took else "took nothing")] += 1
            assert_nothing_left(using, key, job_name, dedicated_locks, threads_before, context)

    asyncio.run(main())
    wait_for_sessions(using, sessions_before if sessions_before is not None else 0)
    print(f"\nseed {SEED}, {kind} on {using}: {ITERATIONS} calls")
    for (mode, result, took), count in sorted(seen.items()):
        print(f"  {count:4d}  {mode}: {result}, {took}")
    if job_name is not None:
        statuses = Counter(ledger.filter(job_name=job_name).values_list("status", flat=True))
        print(f"  rows: {dict(statuses)}")
    # The cancellations reached the calls at every stage: before they took anything, once
    # they had taken their lock (the random ones), and in the body.
    cancelled = {(mode, took) for mode, result, took in seen if result == "cancelled"}
    assert ("before_it_starts", "took nothing") in cancelled
    assert ("in_the_body", "took a lock") in cancelled
    assert ("wait_for_timeout", "took a lock") in cancelled or (
        "at_a_random_time",
        "took a lock",
    ) in cancelled
