"""``async with advisory_lock(...)``: the connection of Django's async ORM calls, exclusion between
tasks of one event loop, waits that never block the loop, cancellation that leaks nothing."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from advisory_lock import LockNotAcquired
from advisory_lock import advisory_lock
from advisory_lock.inspection import held_locks
from tests.commands import HANG
from tests.probes import in_other_connection
from tests.probes import is_free
from tests.test_locks import held_elsewhere


def run(coroutine):
    """Run ``coroutine`` in a new event loop, and close the connections its sync_to_async
    calls opened (in asgiref's thread for thread-sensitive calls)."""

    async def main():
        try:
            return await coroutine
        finally:
            await sync_to_async(connections.close_all, thread_sensitive=True)()

    return asyncio.run(main())


def test_async_with_holds_the_lock_in_the_block_and_releases_it_after(using):
    async def main():
        async with advisory_lock("async:block", using=using) as handle:
            assert handle.acquired and handle.scope == "session"
            held = await sync_to_async(is_free, thread_sensitive=False)("async:block", using)
        return held

    assert run(main()) is False
    assert is_free("async:block", using)


def test_the_lock_runs_on_the_connection_of_djangos_async_orm_calls(using):
    async def main():
        orm_connection = await sync_to_async(lambda: connections[using], thread_sensitive=True)()
        async with advisory_lock("async:same-connection", using=using) as handle:
            return handle.connection is orm_connection

    assert run(main()) is True


def test_two_gathered_tasks_sharing_a_connection_never_overlap(using):
    inside, overlaps, order = [], [], []

    async def worker(name):
        for _ in range(5):
            async with advisory_lock("async:gathered", using=using):
                if inside:
                    overlaps.append((name, list(inside)))
                inside.append(name)
                order.append(name)
                await asyncio.sleep(0.01)  # the other task runs meanwhile
                inside.remove(name)

    async def main():
        await asyncio.gather(worker("a"), worker("b"))

    run(main())
    assert overlaps == []
    assert sorted(order) == ["a"] * 5 + ["b"] * 5
    assert is_free("async:gathered", using)


def test_a_try_finds_a_lock_another_task_holds_busy_and_the_same_task_may_take_it_again(using):
    async def main():
        taken, other_try = asyncio.Event(), asyncio.Event()
        results = {}

        async def holder():
            async with advisory_lock("async:reentrant", using=using):
                async with advisory_lock("async:reentrant", using=using, wait=False) as again:
                    results["again"] = again.acquired  # re-entrant for the same task
                taken.set()
                await other_try.wait()

        async def other():
            await taken.wait()
            async with advisory_lock("async:reentrant", using=using, wait=False) as handle:
                results["other"] = handle.acquired
            other_try.set()

        await asyncio.gather(holder(), other())
        return results

    assert run(main()) == {"again": True, "other": False}
    assert is_free("async:reentrant", using)


def test_a_wait_is_awaited_the_event_loop_keeps_running(using):
    """The lock's wait is ended by a task of the waiter's own event loop, which can only run
    if the wait does not block the loop: it lets the holder go once the loop has turned
    ``TURNS`` times during the wait (and, on PostgreSQL, once the server shows the waiter
    waiting there). A wait that blocked the loop would never see its lock let go."""
    turns = 50
    ticks = []  # time.monotonic() of each turn of the ticker, while the waiter waits
    holder = held_elsewhere("async:waiting", using)  # taken and let go outside the loop

    async def waiting_in_the_server():
        # Asked from a thread of its own (its connections closed after): awaited.
        locks = await sync_to_async(in_other_connection, thread_sensitive=False)(held_locks, using)
        return any(lock.name == "async:waiting" and not lock.granted for lock in locks)

    async def main():
        async def wait_for_the_lock():
            # Its wait ends when the holder lets go: the bound is a hang guard, not a timing.
            async with advisory_lock("async:waiting", using=using, timeout=HANG) as handle:
                return handle.acquired

        turned = asyncio.Event()

        async def ticker():
            while not waiter.done():
                ticks.append(time.monotonic())
                if len(ticks) >= turns:
                    turned.set()
                await asyncio.sleep(0.01)

        waiter = asyncio.ensure_future(wait_for_the_lock())
        tick = asyncio.ensure_future(ticker())
        await asyncio.wait_for(turned.wait(), HANG)
        if using == "postgresql":  # the queue's first waiter waits inside the server
            deadline = time.monotonic() + HANG
            while not await waiting_in_the_server():
                assert time.monotonic() < deadline, "the server never showed the waiter"
        assert not waiter.done(), waiter  # it waited all along: the lock is held elsewhere
        holder.done.set()  # no blocking call: the holder's thread lets go
        acquired = await asyncio.wait_for(waiter, HANG)
        await tick
        return acquired

    holder.__enter__()
    try:
        assert run(main()) is True
    finally:
        holder.__exit__(None, None, None)
    assert len(ticks) >= turns
    # And never blocked for long: ticks 0.01 s apart, each gap an order of magnitude below
    # this generous bound on an idle machine (only the wait's own turns are measured).
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 2.0, max(gaps)
    assert is_free("async:waiting", using)


def test_cancelled_while_waiting_or_holding_leaks_no_lock(using):
    async def main():
        async def hold_forever():
            async with advisory_lock("async:cancel-holding", using=using):
                await asyncio.sleep(60)

        holding = asyncio.ensure_future(hold_forever())
        await asyncio.sleep(0.2)
        holding.cancel()
        with pytest.raises(asyncio.CancelledError):
            await holding

        with held_elsewhere("async:cancel-waiting", using):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    async with advisory_lock("async:cancel-waiting", using=using):
                        pytest.fail("the body must not run")
        # The waiting task's tries ended before it was let go: nothing is left behind.
        return await sync_to_async(is_free, thread_sensitive=False)("async:cancel-holding", using)

    assert run(main()) is True
    assert is_free("async:cancel-holding", using)
    assert is_free("async:cancel-waiting", using)


def test_a_decorated_async_function_takes_the_lock_at_each_call(using):
    @advisory_lock("async:decorated", using=using, wait=False)
    async def work(value):
        return value * 2

    async def main():
        first = await work(21)
        with held_elsewhere("async:decorated", using):
            with pytest.raises(LockNotAcquired, match="work"):
                await work(1)
        return first

    assert run(main()) == 42
    assert is_free("async:decorated", using)


# Fairness: waits are first come, first served among a loop's tasks.


def test_tasks_waiting_for_a_lock_get_it_in_the_order_they_came(using):
    """Regression: each waiter paused twice as long after each failed try (up to 50 ms), so
    the task that had waited longest tried least often and newcomers took the lock first."""
    order = []

    async def waiter(number):
        async with advisory_lock("async:fifo", using=using, timeout=30):
            order.append(number)
            await asyncio.sleep(0.01)

    async def main():
        waiters = []
        async with advisory_lock("async:fifo", using=using):
            for number in range(6):
                waiters.append(asyncio.ensure_future(waiter(number)))
                await asyncio.sleep(0.08)  # each waiter has tried, and paused, before the next
        await asyncio.gather(*waiters)

    run(main())
    assert order == list(range(6))
    assert is_free("async:fifo", using)


def test_a_queued_task_that_times_out_or_is_cancelled_leaves_the_queue_to_the_next(using):
    order = []

    async def waiter(name, timeout=30):
        async with advisory_lock("async:queue-exit", using=using, timeout=timeout):
            order.append(name)

    async def main():
        async with advisory_lock("async:queue-exit", using=using):
            first = asyncio.ensure_future(waiter("cancelled"))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(waiter("timed out", timeout=0.2))
            await asyncio.sleep(0.05)
            third = asyncio.ensure_future(waiter("served"))
            await asyncio.sleep(0.05)
            first.cancel()
            with pytest.raises(LockNotAcquired):
                await second
        await third
        with pytest.raises(asyncio.CancelledError):
            await first

    run(main())
    assert order == ["served"]
    assert is_free("async:queue-exit", using)
