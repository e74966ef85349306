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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

from advisory_lock.holds import connection_locks

if TYPE_CHECKING:
    from advisory_lock.locks import AdvisoryLock
    from advisory_lock.locks import LockHandle

T = TypeVar("T")
_FIRST_PAUSE = 0.002
_LONGEST_PAUSE = 0.05


async def async_acquire(lock: AdvisoryLock) -> LockHandle:
    """Take ``lock`` for the current task: tries, with awaited pauses between them."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if lock._timeout is None else started + lock._timeout
    pause = _FIRST_PAUSE

    def attempt() -> LockHandle:
        connection = connections[lock.using]
        return lock._take(connection, connection_locks(connection), 0, task)

    while True:
        handle = await _to_the_end(
            sync_to_async(attempt, thread_sensitive=True),
            undo=lambda h: async_release(lock, h, None),
        )
        if handle.acquired:
            lock._record(handle, loop.time() - started)
            return handle
        left = None if deadline is None else deadline - loop.time()
        if not lock.wait or (left is not None and left <= 0):
            lock._record(handle, loop.time() - started)
            lock._busy(handle)  # raises LockNotAcquired when it had to wait
            return handle
        await asyncio.sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, _LONGEST_PAUSE)


async def async_release(lock: AdvisoryLock, handle: LockHandle, exc: BaseException | None) -> None:
    """End ``handle``'s hold in the thread that took it, even if the task is cancelled."""
    await _to_the_end(sync_to_async(lock.release, thread_sensitive=True), handle, exc)


async def _to_the_end(
    call: Callable[..., Awaitable[T]],
    *args: object,
    undo: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """Await ``call(*args)`` to its end even if this task is cancelled meanwhile; then
    ``undo`` its result and re-raise the cancellation."""
    future = asyncio.ensure_future(call(*args))
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done() and future.cancelled():
                raise
            cancelled = True
            if future.done():
                result = future.result()
                break
    if cancelled:
        if undo is not None:
            await _to_the_end(undo, result)
        raise asyncio.CancelledError
    return result
