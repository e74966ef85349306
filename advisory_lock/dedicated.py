"""A session lock on a connection of its own, and the watchdog that notices its loss.

Single-instance commands and the ledger hold their lock this way: nothing the caller does to
Django's connections (closing them, pooling them, a transaction-mode pooler in front of them)
can drop or leak it, and the lock lives exactly as long as its connection, which the
database closes when the process dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable
from time import monotonic
from typing import TypeVar

from django.db import DatabaseError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock import directory
from advisory_lock import metrics
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_wait
from advisory_lock.watchdog import Watch
from advisory_lock.watchdog import Watchdog

logger = logging.getLogger("advisory_lock")
T = TypeVar("T")

#: Seconds that a statement on the way out of an unwatched lock may take (see ``deadline``).
EXIT_DEADLINE = 10.0


def direct_alias(alias: str) -> str:
    """The alias that reaches ``alias``'s database without a pooler (``DIRECT_ALIAS``)."""
    direct: str = get_setting("DIRECT_ALIAS").get(alias, alias)
    return direct


#: The lock backend of each kept connection (see ``DedicatedLock``).
_kept_backends: weakref.WeakKeyDictionary[BaseDatabaseWrapper, LockBackend] = (
    weakref.WeakKeyDictionary()
)
#: The watchdog of each kept connection: one thread watches its locks, one after the other.
_kept_watchdogs: weakref.WeakKeyDictionary[BaseDatabaseWrapper, Watchdog] = (
    weakref.WeakKeyDictionary()
)


def dedicated_connection(using: str, label: str) -> BaseDatabaseWrapper:
    """A new connection to the database ``using`` (already a direct alias), for locks alone:
    not one of Django's (``connections``), so that nothing done to those can drop or leak
    its locks. Opened at its first statement."""
    shared = connections[using]
    backend_class = type(backend_for(shared))
    settings_dict = backend_class.dedicated_settings(
        shared.settings_dict, f"{label} (advisory_lock)"
    )
    connection = type(shared)(settings_dict, using)
    # The watchdog checks the lock from its own thread, never at the same time as the
    # owner (the mutex): Django must let both threads use the connection.
    connection.inc_thread_sharing()
    return connection


def close_dedicated_connection(connection: BaseDatabaseWrapper) -> None:
    """Close a connection of ``dedicated_connection()`` that was kept from lock to lock, and
    end its watchdog's thread (a later lock on it starts another)."""
    watchdog = _kept_watchdogs.pop(connection, None)
    if watchdog is not None:
        watchdog.close()
    connection.close()


class DedicatedLock:
    """A session lock on ``key`` held on a connection opened for it alone.

    ``acquire()`` takes it, ``watch()`` starts the watchdog, ``check()`` raises ``LockLost``
    once a loss was found, ``release()`` stops the watchdog, releases and closes.
    """

    def __init__(
        self,
        key: Key | LockKey,
        *,
        using: str | None,
        label: str,
        connection: BaseDatabaseWrapper | None = None,
    ) -> None:
        self.key = make_key(key)
        self.using = direct_alias(check_alias(using))
        self.label = label
        #: A ``connection`` passed in (``dedicated_connection()``'s, kept by a scheduler's
        #: worker from one run to the next) is closed only after trouble: a lock lost, a
        #: statement that failed or went unanswered. Its locks are then dropped with it.
        self.kept = connection is not None
        self._trouble = False
        self.connection = connection or dedicated_connection(self.using, label)
        # A kept connection keeps its backend too: what the backend knows of its session
        # (its server pid, the statements it prepared there) stays true from lock to lock.
        backend = _kept_backends.get(self.connection) if self.kept else None
        if backend is None:
            backend = backend_for(self.connection)
            if self.kept:
                _kept_backends[self.connection] = backend
        self.backend = backend
        if problem := self.backend.session_lock_problem():
            raise NotSupportedError(problem)
        self.db_key = self.backend.db_key(self.key)
        self.lost = False
        self.acquired_at: float | None = None
        #: How long a statement on the way out (a release, the close) may go unanswered
        #: before the lock counts as lost and the connection is left to the process: the
        #: heartbeat once ``watch()`` started, else ``EXIT_DEADLINE``.
        self.deadline = EXIT_DEADLINE
        self._mutex = threading.Lock()
        self._watchdog: Watchdog | None = None
        self._watch: Watch | None = None
        self._checkers: set[threading.Thread] = set()  # checks still waiting for an answer

    def acquire(self, wait: float) -> bool:
        """Take the lock, waiting at most ``wait`` seconds (0: try once)."""
        check_wait("wait", wait, self.backend)  # before anything is taken
        started = monotonic()
        with self._mutex:
            try:
                acquired = self.backend.acquire(
                    self.db_key, shared=False, timeout=wait, transaction=False
                )
            except BaseException:
                self._trouble = True  # the session's state is unknown: not kept
                raise
            if acquired:
                # At once: whatever fails from here on, let_go() knows there is a lock.
                self.acquired_at = monotonic()
        if directory.recorder is not None:  # no statement: see advisory_lock.directory
            directory.recorder.note(self.backend, self.using, self.db_key, self.key, self._holds)
        waited = monotonic() - started
        if metrics.recorder is not None:
            outcome = "acquired" if acquired else "timeout" if wait else "busy"
            vendor = self.connection.vendor
            metrics.recorder.acquisition(outcome, vendor, self.using, waited, self.label)
        if acquired:
            logger.info("%s: acquired lock %s after %.3fs.", self.label, self.key.label, waited)
        else:
            logger.info("%s: lock %s busy after %.3fs.", self.label, self.key.label, waited)
        return acquired

    def _holds(self, db_key: object) -> bool:
        """Is the lock held (asked by the lock directory's writer, from its thread)?"""
        return self.acquired_at is not None

    def busy_message(self) -> str:
        """Why this instance skipped: who holds the lock. Closes the lock's connection (it
        holds nothing: the lock was busy)."""
        try:
            with self._mutex:
                holder = inspector_for(self.connection).holder(self.db_key)
        except DatabaseError:
            holder = None
            self._trouble = True
        finally:
            self.close()
        held_by = f" by {holder.describe()}" if holder else ""
        return (
            f"{self.label}: skipped, another instance holds lock {self.key.label} on database "
            f"{self.using!r}{held_by}."
        )

    def lost_message(self) -> str:
        return (
            f"{self.label}: lock {self.key.label} on database {self.using!r} was lost (its "
            f"connection was closed or killed): another instance may now run. Stopping."
        )

    def check(self) -> None:
        """Raise ``LockLost`` if the watchdog found the lock lost (cheap: no statement)."""
        if self.lost:
            raise LockLost(self.lost_message())

    def verify(self, timeout: float = 10) -> bool:
        """Is the lock still held? Asks the database (one statement), within ``timeout``. A
        lock this can't prove held counts as lost from then on."""
        if not self.lost and not self._held_within(timeout, on_this_thread=True):
            self.lost = True
        return not self.lost

    def watch(self, heartbeat: float, on_lost: Callable[[], None]) -> None:
        """Check every ``heartbeat`` seconds (one statement) that the lock is still held;
        on a loss, set ``lost`` and call ``on_lost`` (from the watchdog's thread).

        A check that gets no answer within ``heartbeat`` counts as a loss too: on a silent
        network (a partition, a black-holed route) the statement would wait for ever, and a
        lock we can't prove we hold must be treated as lost.
        """

        self.deadline = heartbeat

        def lost() -> None:
            self.lost = True
            on_lost()

        name = f"advisory_lock:{self.label}"
        if self.kept:
            # A kept connection's locks share one watchdog thread, started with the first.
            watchdog = _kept_watchdogs.get(self.connection)
            if watchdog is None:
                watchdog = _kept_watchdogs[self.connection] = Watchdog(name)
        else:
            watchdog = Watchdog(name)
        self._watchdog = watchdog
        self._watch = watchdog.watch(self._held_within, heartbeat, lost)

    def _held_within(self, seconds: float, *, on_this_thread: bool = False) -> bool:
        """Is the lock still held? False on an error, or on no answer within ``seconds``."""
        try:
            return self._within(
                seconds, lambda: self.backend.is_held(self.db_key), on_this_thread=on_this_thread
            )
        except Exception:
            return False

    def _within(
        self, seconds: float, statement: Callable[[], T], *, on_this_thread: bool = False
    ) -> T:
        """``statement()`` on the lock's connection, under the mutex, answered within
        ``seconds``: its result or its error; ``TimeoutError`` if no answer came by then.

        A socket read has no deadline of its own here (libpq and mysqlclient wait for as long
        as the kernel keeps the connection, and on a silent network, a black-holed route or
        a hung middlebox that still ACKs, that is for ever). So the statement runs in a
        thread of its own that the caller stops waiting for. Such a thread is remembered
        until it ends: it owns the connection, which nothing else may touch (see close()).

        ``on_this_thread``: on a kept connection whose watchdog thread runs (a scheduler's
        worker, between its runs' checks), the statement runs on the caller's thread instead,
        and the watchdog keeps its deadline (``Watchdog.within``): at the deadline it shuts
        the connection's socket down, which ends the statement's read at once with an error.
        A thread started and joined per statement cost a worker more than the statement.
        Locks that are this process's own (``local_locks``: SQLite's files) wait on no
        network: there, such a statement runs on the caller's thread without a deadline.
        """
        if on_this_thread and self.backend.local_locks:
            with self._mutex:
                return statement()
        watchdog = self._watchdog if on_this_thread and self.kept else None
        if watchdog is not None and watchdog.can_keep_deadlines():
            socket_fd = self.backend.session_socket()
            if socket_fd is not None:
                return self._within_deadline(watchdog, socket_fd, seconds, statement)
        outcome: list[tuple[bool, object]] = []

        def run() -> None:
            try:
                with self._mutex:
                    outcome.append((True, statement()))
            except Exception as error:
                outcome.append((False, error))
            finally:
                self._checkers.discard(thread)

        # Each statement has its own thread (the watchdog's checks and verify() may
        # overlap; the mutex keeps their statements apart).
        thread = threading.Thread(target=run, name=f"advisory_lock:{self.label}", daemon=True)
        self._checkers.add(thread)
        thread.start()
        thread.join(seconds)
        if not outcome:
            raise TimeoutError(f"the database did not answer within {seconds:g}s")
        answered, value = outcome[0]
        if not answered:
            assert isinstance(value, Exception)
            raise value
        return value  # type: ignore[return-value]

    def _within_deadline(
        self, watchdog: Watchdog, socket_fd: int, seconds: float, statement: Callable[[], T]
    ) -> T:
        """``statement()`` on this thread, its deadline kept by ``watchdog`` (see
        ``_within``). A statement whose socket was shut down raises ``TimeoutError``, even
        if its answer came just before: the connection can't be used again."""
        with watchdog.within(seconds, lambda: shut_down(socket_fd)) as deadline:
            try:
                with self._mutex:
                    result = statement()
            except Exception as error:
                if deadline.expired:
                    raise TimeoutError(
                        f"the database did not answer within {seconds:g}s"
                    ) from error
                raise
        if deadline.expired:
            self._trouble = True
            raise TimeoutError(f"the database did not answer within {seconds:g}s")
        return result

    def stop_watching(self) -> None:
        """Stop the watchdog and wait for it: after this, ``on_lost`` is never called. A
        kept connection's watchdog only stops watching this lock; its thread goes on."""
        watchdog, watch = self._watchdog, self._watch
        if watchdog is None or watch is None:
            return
        if self.kept:
            watchdog.unwatch(watch)
        else:
            watchdog.close()

    def release(self) -> None:
        """Stop the watchdog, release the lock (``LockLost`` if it was gone), close."""
        self.stop_watching()
        held_for = monotonic() - (self.acquired_at or monotonic())
        try:
            if self.lost:
                raise LockLost(self.lost_message())
            try:
                released = self._within(
                    self.deadline, self._release_statement, on_this_thread=True
                )
            except (DatabaseError, TimeoutError) as error:
                self._trouble = True
                self.lost = True
                raise LockLost(
                    f"{self.label}: releasing lock {self.key.label} on database {self.using!r} "
                    f"failed ({error}): it was lost, and another instance may have run."
                ) from error
            if not released:
                self._trouble = True
                raise LockLost(
                    f"{self.label}: lock {self.key.label} on database {self.using!r} was no "
                    f"longer held when released: another instance may have run."
                )
            logger.info("%s: released lock %s after %.3fs.", self.label, self.key.label, held_for)
            if metrics.recorder is not None:
                vendor = self.connection.vendor
                metrics.recorder.held(held_for, vendor, self.using, self.label)
        except LockLost:
            if metrics.recorder is not None:
                metrics.recorder.lost(self.connection.vendor, self.using, self.label)
            raise
        finally:
            self.close()

    def let_go(self) -> None:
        """Undo whatever this object took, in whatever state a failure or a cancellation left
        it: stop the watchdog, release the lock if it was taken (so that it is free the
        moment this returns: a closed connection's locks are dropped a moment later, when the
        server notices), close the connection. Never raises: it is what runs after another
        error (a failure to release is logged; closing the connection drops the lock)."""
        self.stop_watching()
        try:
            held = self.acquired_at is not None and not self.lost and not self._checkers
            if held and not self._within(
                self.deadline, self._release_statement, on_this_thread=True
            ):
                self._trouble = True
        except Exception:
            self._trouble = True
            logger.debug(
                "%s: releasing lock %s failed.", self.label, self.key.label, exc_info=True
            )
        finally:
            self.close()

    def _release_statement(self) -> bool:
        return self.backend.release(self.db_key, shared=False)

    def close(self) -> None:
        """Close the lock's connection, which drops whatever it still holds. A statement
        still waiting on a silent network owns the connection: it goes with the process.
        Closing sends the server a goodbye (PostgreSQL's Terminate, MySQL's COM_QUIT), a
        blocking write: it too has ``deadline`` seconds."""
        self.acquired_at = None
        if self.kept and not (self.lost or self._trouble or self._checkers):
            return  # nothing held any more, and the connection sound: kept for the next lock
        if not self._checkers:
            try:
                self._within(self.deadline, self.connection.close)
            except (DatabaseError, TimeoutError):
                logger.debug(
                    "%s: closing the lock's connection failed.", self.label, exc_info=True
                )
            self.backend.end_session()


def shut_down(socket_fd: int) -> None:
    """Shut down the socket ``socket_fd`` both ways (shutdown(2)): a read waiting on it, in
    any thread, returns at once (end of file). The descriptor stays open, the driver's to
    close: the shutdown goes through a duplicate, which is closed here."""
    with contextlib.suppress(OSError):
        with socket.socket(fileno=os.dup(socket_fd)) as duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)
