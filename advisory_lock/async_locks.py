"""``async with advisory_lock(...)``: the lock's statements run where Django's async ORM calls
run, and waiting is awaited.

Django runs an async context's ORM calls with ``sync_to_async(thread_sensitive=True)``: outside
a request, every such call of the process runs in one thread, on one connection per alias.
The lock runs there too, so that the lock and the ORM calls of a block share a connection
(and its transaction). Two consequences shape this module:

- That thread serves every task of the event loop: a lock may never *wait* in it, or the
  holder could not run the ORM call that ends its block. A wait is a try, then an awaited
  pause, then another try (each try one statement, none blocking the thread or the loop).
- Tasks sharing the connection share its database session, which would grant each of them a
  lock another holds: the connection's holds remember their task, and a lock another task
  holds through the same connection is busy (``ConnectionLocks.held_by_another_task``).

Cancellation can't stop a call already running in that thread: the call is awaited to the
end, its lock released if it took one, and the cancellation raised after.

Waits are first come, first served among an event loop's tasks: a task whose first try finds
the lock busy joins the lock's queue, only the queue's first task keeps trying, and a release
by a task of the same loop wakes it at once. Without a queue, a task that has waited longest
(and so pauses longest between tries) would keep losing the lock to newcomers.

Between its tries the queue's first task waits inside the database server, where it can
(``server_waits``: PostgreSQL), so that any release wakes it at once; elsewhere it pauses,
2 ms at first, doubling up to 25 ms.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from asgiref.sync import sync_to_async

from advisory_lock.holds import Lock
from advisory_lock.holds import LockHandle
from advisory_lock.server_waits import ServerWait
from advisory_lock.server_waits import server_waits_available

T = TypeVar("T")
_FIRST_PAUSE = 0.002
_LONGEST_PAUSE = 0.025

#: Per event loop, per (alias, lock identity): the tasks waiting for it, first come first.
QueueKey = tuple[str, str]


class _Queue:
    """An event loop's waiters for one lock: their turns, first come first, and the
    connection on which the first waits in the server (if the database has such waits)."""

    __slots__ = ("server", "turns")

    def __init__(self, lock: Lock) -> None:
        self.turns: deque[asyncio.Event] = deque()
        self.server = ServerWait(lock.using, lock.lock_key)


_Queues = dict[QueueKey, _Queue]
_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Queues] = (
    weakref.WeakKeyDictionary()
)


async def acquire_in_turn(
    attempt: Callable[[], LockHandle],
    release: Callable[[LockHandle, BaseException | None], None],
    lock: Lock,
    *,
    wait: bool,
    timeout: float | None,
    reentrant: bool,
) -> tuple[LockHandle, float]:
    """Take ``lock`` for the current task; return its handle and the seconds it took.

    ``attempt`` tries once (in the thread of Django's async ORM calls); ``release`` ends a
    hold there (an attempt that succeeded while the task was cancelled is undone). Without
    ``wait`` one try; else tries with awaited pauses until the lock is taken or ``timeout``
    runs out (the last handle, falsy, is returned then). ``reentrant``: the task holds the
    lock already (an enclosing block), so that the first try takes it again at once.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if timeout is None else started + timeout
    queue_key = queue_key_of(lock)
    queues = _queues.setdefault(loop, {})
    queue = queues.get(queue_key)

    def undo(handle: LockHandle) -> None:
        release(handle, None)

    async def try_once() -> LockHandle:
        return await _to_the_end(attempt, undo=undo)

    # A free lock costs one try and no queue. While tasks of this loop wait for the lock in
    # the server (where the database has such waits), a newcomer queues behind them without
    # a try, unless it holds the lock already: a try would take it ahead of them (and of the
    # waiters of other processes), in the moment between a release and their own try.
    skip_try = wait and queue is not None and not reentrant and server_waits_available(lock.using)
    handle = None
    if not skip_try:
        handle = await try_once()
        if handle.acquired or not wait or (deadline is not None and loop.time() >= deadline):
            return handle, loop.time() - started
        queue = queues.get(queue_key)  # the try let other tasks run
    if queue is None:
        queue = queues[queue_key] = _Queue(lock)
    turn = asyncio.Event()
    queue.turns.append(turn)
    pause = _FIRST_PAUSE
    pause_for: float | None
    try:
        while True:
            left = None if deadline is None else deadline - loop.time()
            if queue.turns[0] is turn:
                if not skip_try or (left is not None and left <= 0):
                    handle = await try_once()
                    if handle.acquired:
                        return handle, loop.time() - started
                    left = None if deadline is None else deadline - loop.time()
                    if left is not None and left <= 0:
                        return handle, loop.time() - started
                skip_try = False
                if await queue.server.until_free(lock.shared, left) is not None:
                    continue  # free now, or its time ran out: try (the last time) again
                if handle is None:
                    continue  # no wait in the server after all: try first
                pause_for = pause if left is None else min(pause, left)
                pause = min(pause * 2, _LONGEST_PAUSE)
            else:
                pause_for = left  # until this task's turn (or its deadline)
            if left is not None and left <= 0:
                if handle is None:  # it skipped its first try: one before it gives up
                    handle = await try_once()
                return handle, loop.time() - started
            try:
                await asyncio.wait_for(turn.wait(), pause_for)
            except TimeoutError:
                pass
            else:
                pause = _FIRST_PAUSE  # woken by a release, or it is this task's turn now
            turn.clear()
    finally:
        first = queue.turns[0] is turn
        queue.turns.remove(turn)
        if queue.turns:
            if first:
                queue.server.leave_line()  # before the next one's wait, on that connection
            queue.turns[0].set()
        else:
            queue.server.close()
            del queues[queue_key]


def queue_key_of(lock: Lock) -> QueueKey:
    """What an event loop's waiters for ``lock`` queue under."""
    return lock.using, lock.lock_key.identity


async def release_in_thread(
    release: Callable[[LockHandle, BaseException | None], None],
    handle: LockHandle,
    exc: BaseException | None,
    lock: Lock,
) -> None:
    """End ``handle``'s hold in the thread that took it, even if the task is cancelled; then
    wake the first task of this loop that waits for the lock."""
    await _to_the_end(release, handle, exc)
    queue = _queues.get(asyncio.get_running_loop(), {}).get(queue_key_of(lock))
    if queue is not None and queue.turns:
        queue.turns[0].set()


class _Hop:
    """One call run in the thread of the async ORM calls, and what the task knows of it.

    When the awaiting task is cancelled, asgiref stops waiting for the call, but a call that
    has started runs on to its end in its thread (a thread can't be interrupted). The call
    records its start and its outcome here, so the cancelled task can tell whether it ran,
    wait for its end and undo it; a call that had not started is abandoned: it then does
    nothing when the executor gets to it.
    """

    __slots__ = ("func", "guard", "outcome", "state")

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.guard = threading.Lock()
        self.state = "waiting"  # then "running", or "abandoned"
        self.outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def __call__(self, *args: object) -> Any:
        with self.guard:
            if self.state == "abandoned":
                return None
            self.state = "running"
        try:
            result = self.func(*args)
        except BaseException as error:
            self.outcome.set_exception(error)
            raise
        self.outcome.set_result(result)
        return result

    def abandon(self) -> bool:
        """True if the call had not started (it never will); False if it runs or ran."""
        with self.guard:
            if self.state == "waiting":
                self.state = "abandoned"
                return True
            return False


async def _to_the_end(
    func: Callable[..., T],
    *args: object,
    undo: Callable[[T], object] | None = None,
) -> T:
    """Run ``func(*args)`` in the thread of the async ORM calls. If this task is cancelled
    meanwhile, a call that started is awaited to its end and its result undone (``undo``)
    before the cancellation is raised again."""
    hop = _Hop(func)
    try:
        result: T = await sync_to_async(hop, thread_sensitive=True)(*args)
        return result
    except asyncio.CancelledError:
        if hop.abandon():
            raise
    # The call runs on in its thread: wait for its end through any further cancellation.
    outcome = asyncio.wrap_future(hop.outcome)
    while True:
        try:
            result = await asyncio.shield(outcome)
            break
        except asyncio.CancelledError:
            if outcome.done() and not outcome.cancelled():
                result = outcome.result()
                break
        except BaseException:
            raise asyncio.CancelledError from None  # it failed: nothing to undo
    if undo is not None:
        await _to_the_end(undo, result)
    raise asyncio.CancelledError
