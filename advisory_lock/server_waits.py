"""Async waiters woken by the release itself: a wait inside the database server.

An async waiter can't wait on Django's connection (see ``async_locks``). Where the database
can (``LockBackend.release_wait``: PostgreSQL), the first waiter of an event loop's queue for
a lock waits inside the server on a connection of its own, then tries again on Django's
connection: the lock's release ends that wait, whoever releases it and however (a block's
exit, a commit, a rollback, a dead session), with no statement from the releaser and no
polling; and the waiters of all processes are served in the order they came (see
``PostgreSQLReleaseWait``). Elsewhere (MySQL/MariaDB, SQLite) the waiter pauses between
tries.

- One connection per event loop and lock, while any of its tasks waits for that lock: opened
  by the first wait, handed from one waiter to the next, closed when none is left waiting.
  Its statements run in order in a thread of its own (a daemon: a wait that never ends does
  not keep the process from exiting).
- At most ``CONNECTIONS_PER_ALIAS`` such connections per process and database alias at a
  time; beyond them, waiters poll as elsewhere.
- A failed connection or wait is closed, and the alias's waiters poll for ``RETRY_AFTER``
  seconds before a new connection is tried: a server that is down is not hammered.
- A waiter cancelled while it waits interrupts the server's wait (the driver's cancel, sent
  from another thread: it makes a round trip, and again every ``INTERRUPT_AGAIN`` seconds
  until the wait has ended, for a cancel that came before the wait's statement), and the
  connection is closed after it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

from django.db import connections

from advisory_lock.backends import backend_class
from advisory_lock.backends import backend_for
from advisory_lock.backends.base import ReleaseWait
from advisory_lock.keys import LockKey

logger = logging.getLogger("advisory_lock")

CONNECTIONS_PER_ALIAS = 4
RETRY_AFTER = 1.0
INTERRUPT_AGAIN = 0.1  # seconds between two cancels of a wait that has not ended

_guard = threading.Lock()
_open: collections.Counter[str] = collections.Counter()  # per alias, under _guard
_polling_until: dict[str, float] = {}  # per alias: after a failure, under _guard


class ServerWait:
    """The connection on which the waiters of one event loop's queue for one lock wait in
    the server, one at a time (the queue's first). Its methods run in the event loop's
    thread."""

    __slots__ = ("alias", "db_key", "lock_key", "release_wait", "unsupported", "worker")

    def __init__(self, alias: str, lock_key: LockKey) -> None:
        self.alias = alias
        self.lock_key = lock_key
        self.db_key: Any = None
        self.release_wait: ReleaseWait | None = None
        self.worker: _Worker | None = None
        self.unsupported = False

    async def until_free(self, shared: bool, timeout: float | None) -> bool | None:
        """Wait in the server until the lock could be granted in the mode asked for (True),
        or at most ``timeout`` seconds (False); None when there is no wait in the server for
        it now (the database has none, the connections are all in use, or a connection
        failed): the caller pauses and tries again."""
        if self.release_wait is None and not self._open():
            return None
        release_wait, worker = self.release_wait, self.worker
        assert release_wait is not None and worker is not None
        done = worker.submit(release_wait.wait, self.db_key, shared=shared, timeout=timeout)
        try:
            free: bool = await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            # The driver's cancel makes a round trip: not in the event loop's thread.
            threading.Thread(target=_interrupt, args=(release_wait, done), daemon=True).start()
            self.close()  # after the interrupted wait, in the worker
            raise
        except Exception:
            logger.warning(
                "An async waiter's wait inside database %r failed; the waiters of that database "
                "poll for %gs.",
                self.alias,
                RETRY_AFTER,
                exc_info=True,
            )
            self.close(failed=True)
            return None
        return free

    def leave_line(self) -> None:
        """The queue's first took the lock, or stopped waiting: the next waiter in the line
        (of any process) may be served. Nothing is awaited: the statement runs before the
        next wait, in the worker."""
        if self.release_wait is not None and self.worker is not None:
            self.worker.submit(self.release_wait.leave_line)

    def close(self, *, failed: bool = False) -> None:
        """No task of the loop waits for the lock any more (or the connection failed)."""
        release_wait, worker = self.release_wait, self.worker
        self.release_wait = self.worker = None
        if release_wait is not None and worker is not None:
            worker.submit(_close, self.alias, release_wait, failed)
            worker.stop()

    def _open(self) -> bool:
        if self.unsupported:
            return False
        # This thread's connection object for the alias: its settings, never its session.
        connection = connections[self.alias]
        backend = backend_for(connection)
        with _guard:
            if _open[self.alias] >= CONNECTIONS_PER_ALIAS:
                return False
            if monotonic() < _polling_until.get(self.alias, 0.0):
                return False
            release_wait = type(backend).release_wait(connection)
            if release_wait is None:
                self.unsupported = True
                return False
            _open[self.alias] += 1
        self.db_key = backend.db_key(self.lock_key)
        self.release_wait = release_wait
        self.worker = _Worker()
        return True


class _Worker:
    """A daemon thread that runs the calls submitted to it, in order, until ``stop()``."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None
        ] = queue.SimpleQueue()
        threading.Thread(target=self.run, name="advisory_lock waiter", daemon=True).start()

    def submit(
        self, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.calls.put((future, lambda: func(*args, **kwargs)))
        return future

    def stop(self) -> None:
        self.calls.put(None)

    def run(self) -> None:
        while (call := self.calls.get()) is not None:
            future, func = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(func())
            except BaseException as error:
                future.set_exception(error)


def _interrupt(release_wait: ReleaseWait, done: concurrent.futures.Future[Any]) -> None:
    """Interrupt the wait until it has ended: a cancel that reaches the server before the
    wait's statement (still connecting, or between two statements) cancels nothing."""
    while not done.done():
        try:
            release_wait.interrupt()
        except Exception:  # the wait ended and its connection closed meanwhile
            logger.debug("Interrupting an async waiter's wait failed.", exc_info=True)
        concurrent.futures.wait([done], timeout=INTERRUPT_AGAIN)


def _close(alias: str, release_wait: ReleaseWait, failed: bool) -> None:
    try:
        release_wait.close()
    except Exception:  # closing a broken connection may fail; it is gone either way
        logger.debug("Closing an async waiter's connection failed.", exc_info=True)
    with _guard:
        _open[alias] -= 1
        if failed:
            _polling_until[alias] = monotonic() + RETRY_AFTER


def server_waits_available(alias: str) -> bool:
    """Would a waiter for a lock on ``alias`` wait in the server now (the database has such
    waits, a connection is free, none failed lately)?"""
    if not backend_class(connections[alias]).waits_in_server:
        return False
    with _guard:
        return _open[alias] < CONNECTIONS_PER_ALIAS and monotonic() >= _polling_until.get(
            alias, 0.0
        )


def open_connections(alias: str) -> int:
    """How many waiting connections this process has open to ``alias`` now."""
    with _guard:
        return _open[alias]
