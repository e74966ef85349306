"""The holds of a lock, and how each ends: ``LockHandle`` (what ``with`` gives), its two
kinds of holds, and what each Django connection holds (``ConnectionLocks``).

A session hold (``SessionHold``) is released when its block exits, on the session that took
it. A transaction hold (``TransactionHold``) ends with its transaction: PostgreSQL releases
it itself; elsewhere it is released when its transaction ends, commit or rollback:

- Each such hold registers one ``transaction.on_commit`` callback of its own, a
  ``_TransactionEnd``. At the commit Django calls it, and it releases the hold.
- At a rollback Django discards the callbacks of the transaction (at a savepoint rollback,
  those registered inside the savepoint), as it documents. Nothing else refers to the
  callback, so CPython frees it at once by reference counting, and its ``weakref.finalize``
  releases the hold, before ``atomic`` returns or raises. No cyclic garbage collection is
  involved: the callback holds no reference back to itself.
- A release runs only in the thread that owns the connection. Whatever escapes (the callback
  freed in another thread, or kept alive by a traceback that holds Django's frame, or
  another Python implementation) stays in ``pending`` and is released by the fallbacks: the
  connection's next lock operation outside a transaction, the end of the request, a new
  connection, or a test's teardown.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from time import monotonic
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import Protocol

from django.core.signals import request_finished
from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.signals import connection_created

from advisory_lock import metrics
from advisory_lock import signals
from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.exceptions import LockLost
from advisory_lock.heartbeat import Heartbeat
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey

logger = logging.getLogger("advisory_lock")


class Lock(Protocol):
    """What a hold needs of the lock it holds (an ``AdvisoryLock``)."""

    @property
    def key(self) -> Key: ...

    @property
    def lock_key(self) -> LockKey: ...

    @property
    def using(self) -> str: ...

    @property
    def shared(self) -> bool: ...


class LockHandle:
    """What ``with advisory_lock(...) as handle`` gives: falsy when a try found the lock busy.

    A lock that was taken is a ``SessionHold`` or a ``TransactionHold``, which know how it
    ends.
    """

    __slots__ = (
        "_heartbeat",
        "_lock",
        "_outer",
        "acquired_at",
        "connection",
        "db_key",
        "lost",
        "scope",
        "token",
        "wait_time",
    )

    #: Whether the lock was taken.
    acquired: ClassVar[bool] = False

    def __init__(
        self,
        lock: Lock,
        connection: BaseDatabaseWrapper,
        scope: Literal["session", "transaction"],
        db_key: Any,
        wait_time: float,
        acquired_at: float | None,
    ) -> None:
        self._lock = lock
        #: The Django connection the lock was taken through (this thread's, for the alias).
        self.connection = connection
        self.scope = scope
        #: What the database locks: an int, an int pair, a lock name or a file path.
        self.db_key = db_key
        #: Seconds spent taking (or failing to take) the lock.
        self.wait_time = wait_time
        #: ``time.monotonic()`` when the lock was taken; None if it was not.
        self.acquired_at = acquired_at
        self._outer: LockHandle | None = None  # the handle of the block this one is in
        #: Set when the lock's heartbeat (``advisory_lock(..., heartbeat=N)``) found it lost.
        self.lost = False
        self._heartbeat: Heartbeat | None = None
        #: The lock's fencing token (``advisory_lock(..., fencing=True)``), else None.
        self.token: int | None = None

    def __bool__(self) -> bool:
        return self.acquired

    def __repr__(self) -> str:
        return (
            f"<LockHandle key={self.key!r} using={self.using!r} scope={self.scope!r} "
            f"shared={self.shared!r} acquired={self.acquired!r} wait_time={self.wait_time:.6f}>"
        )

    @property
    def key(self) -> Key:
        return self._lock.key

    @property
    def using(self) -> str:
        return self._lock.using

    @property
    def shared(self) -> bool:
        return self._lock.shared

    @property
    def lock_key(self) -> LockKey:
        return self._lock.lock_key

    def check(self) -> None:
        """Raise ``LockLost`` if the lock's heartbeat found it lost (no statement): call it
        between steps of long work under the lock."""
        if self.lost:
            raise LockLost(
                f"Lock {self.lock_key.label} on database {self.using!r} was lost during the "
                f"block: its heartbeat found it no longer held by the session that took it "
                f"(the connection was killed or cut, or the server failed over). Another "
                f"process may have taken it since: the block is no longer running alone."
            )

    def end_of_block(self, exc: BaseException | None) -> None:
        """The block ends: nothing to release, the lock was not taken."""

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None


class SessionHold(LockHandle):
    """A session lock: released when its block exits, on the session that took it."""

    __slots__ = ("_ended", "_locks", "_session", "_task")
    acquired = True

    def __init__(
        self,
        lock: Lock,
        connection: BaseDatabaseWrapper,
        db_key: Any,
        wait_time: float,
        acquired_at: float,
        locks: ConnectionLocks,
        task: object = None,
    ) -> None:
        # LockHandle.__init__'s fields, set here: a hold is made on the hot path.
        self._lock = lock
        self.connection = connection
        self.scope = "session"
        self.db_key = db_key
        self.wait_time = wait_time
        self.acquired_at = acquired_at
        self._outer = None
        self.lost = False
        self._heartbeat = None
        self.token = None
        self._locks = locks
        self._session = locks.backend.session()  # the lock lives as long as it
        self._ended = False
        self._task = task  # the asyncio task that holds it, in async code
        locks.session_holds.append(self)

    def end_of_block(self, exc: BaseException | None) -> None:
        if self._heartbeat is not None:
            self._stop_heartbeat()
        if self._ended:
            return  # the request-end safety net released it already
        self._ended = True
        locks = self._locks
        backend = locks.backend
        holds = locks.session_holds
        if holds and holds[-1] is self:  # nearly always the last one that began
            holds.pop()
        else:
            locks.forget(self)
        if backend.session() is not self._session:
            # The database dropped the lock when the session closed: the block did not run
            # under it to the end.
            return self._lost(
                exc, "was lost during the block: the connection holding it was closed."
            )
        if self.connection.in_atomic_block and backend.transaction_aborted():
            # PostgreSQL refuses every statement until the rollback: release right after it
            # (or after the savepoint rollback that ends the failure).
            locks.release_at_transaction_end(self)
            return None
        try:
            released = backend.release(self.db_key, shared=self._lock.shared)
        except LockLost as error:
            return self._lost(exc, str(error))
        except DatabaseError as error:
            usable = self.connection.is_usable()
            # Close the connection, which releases the lock, so that nobody reuses a
            # connection whose locks are in an unknown state.
            locks.discard_session()
            if not usable:
                # The session broke (killed, the server restarted or failed over): the
                # database released its locks when it ended, at some point during the block.
                return self._lost(
                    exc,
                    f"was lost during the block: the connection holding it broke ({error}).",
                    error,
                )
            return self._lost(
                exc,
                f"could not be released ({error}); the connection was closed, which releases it.",
                error,
                during=False,
            )
        if not released:
            return self._lost(
                exc,
                "was not held by this connection when released: it was lost during the block "
                "(connection reset, pg_advisory_unlock_all(), or a transaction-mode pooler).",
            )
        if signals.lock_released.receivers or metrics.recorder is not None:
            locks.released(self)
        return None

    def _lost(
        self,
        exc: BaseException | None,
        what: str,
        cause: BaseException | None = None,
        *,
        during: bool = True,
    ) -> None:
        """Raise LockLost, unless an exception is already propagating (then log and keep it).
        ``during``: the lock went during the block, so exclusion may have been broken."""
        message = f"Lock {self.lock_key.label} on database {self.using!r} {what}"
        if during:
            message += (
                " Another process may have taken it since the loss: the block may not have "
                "run alone."
            )
        signals.send(signals.lock_lost, self._lock, self)
        if metrics.recorder is not None:
            metrics.recorder.lost(self._locks.backend.vendor, self.using)
        if exc is not None:
            logger.error(message)
            return
        raise LockLost(message) from cause


class TransactionHold(LockHandle):
    """A lock held until the transaction it was taken in ends (see the module docstring).

    ``native``: the database releases it itself (PostgreSQL); else the hold is released when
    its transaction ends (``ConnectionLocks.release_at_transaction_end``).
    """

    __slots__ = ()
    acquired = True

    def __init__(
        self,
        lock: Lock,
        connection: BaseDatabaseWrapper,
        db_key: Any,
        wait_time: float,
        acquired_at: float,
        locks: ConnectionLocks,
        native: bool,
    ) -> None:
        super().__init__(lock, connection, "transaction", db_key, wait_time, acquired_at)
        if not native:
            locks.release_at_transaction_end(self)
        elif signals.lock_released.receivers or metrics.recorder is not None:
            # The server releases it; the signals and metrics hear of it at the same moment.
            locks.at_transaction_end(locks.released_by_the_server, self)

    def end_of_block(self, exc: BaseException | None) -> None:
        """The block ends: its transaction ends the hold; the heartbeat stops now."""
        if self._heartbeat is not None:
            self._stop_heartbeat()


class _TransactionEnd:
    """The ``on_commit`` callback of one hold: called at the commit, freed (and so
    finalized) when Django discards it at a rollback. It refers to its finalizer only, which
    refers to the hold and its connection's locks, never back to this object."""

    __slots__ = ("__weakref__", "finalizer")
    finalizer: weakref.finalize[Any, Any]

    def __call__(self) -> None:
        self.finalizer()  # a finalizer runs at most once, whichever comes first


class ConnectionLocks:
    """The locks held through one Django connection object (one alias, one thread).

    It knows the session holds (for the request-end safety net) and the holds waiting for
    the end of a transaction. Its methods run in the thread that owns the connection.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        # Weakly: this object lives as long as the connection (see connection_locks()).
        self.connection: BaseDatabaseWrapper = weakref.proxy(connection)
        self.backend: LockBackend = backend_for(connection)
        #: Session holds whose block has not ended, oldest first.
        self.session_holds: list[SessionHold] = []
        #: Holds to release when their transaction has ended.
        self.pending: list[LockHandle] = []

    def held_by_another_task(self, db_key: object, task: object, shared: bool) -> bool:
        """True if a hold of ``db_key`` through this connection belongs to another owner than
        the asyncio ``task`` and excludes the wanted mode: the database would grant it (one
        session), but that other task holds it."""
        return any(
            hold.db_key == db_key and hold._task is not task and not (shared and hold.shared)
            for hold in self.session_holds
        )

    def holds(self, db_key: object) -> bool:
        """Does a hold of this connection (a session's, or one waiting for its transaction's
        end) hold ``db_key``?"""
        return any(hold.db_key == db_key for hold in (*self.session_holds, *self.pending))

    def holds_now(self, db_key: object) -> bool:
        """``holds()`` (any key when ``db_key`` is None), as another thread can tell (the
        lock directory's writer)."""
        if db_key is None:
            return bool(self.session_holds or self.pending)
        return self.holds(db_key)

    def in_transaction(self, db_key: object) -> bool:
        """Whether a transaction-scoped lock may still be held, as another thread can tell:
        the connection is in a transaction (PostgreSQL releases its transaction locks itself,
        so no hold of ours is left to see)."""
        return bool(self.connection.in_atomic_block)

    def forget(self, hold: SessionHold) -> None:
        """``hold``'s block ended (nearly always the last one that began)."""
        holds = self.session_holds
        if holds and holds[-1] is hold:
            holds.pop()
        else:
            holds.remove(hold)

    def release_at_transaction_end(self, handle: LockHandle) -> None:
        """Release ``handle``'s lock when the current transaction (or the savepoint it was
        taken in) ends, commit or rollback."""
        self.pending.append(handle)
        self.at_transaction_end(self.transaction_ended, handle)

    def at_transaction_end(
        self, ended: Callable[[LockHandle, int], None], handle: LockHandle
    ) -> None:
        """Call ``ended(handle, thread)`` once, when the current transaction (or savepoint)
        ends: commit or rollback (see the module docstring)."""
        callback = _TransactionEnd()
        # The thread that takes the hold runs the transaction: the only one that may
        # release through the connection.
        thread = threading.get_ident()
        callback.finalizer = weakref.finalize(callback, ended, handle, thread)
        # At exit the process's end releases everything. (``atexit`` is a documented, writable
        # property of weakref.finalize; typeshed lists it in __slots__ only.)
        callback.finalizer.atexit = False  # type: ignore[misc]
        transaction.on_commit(callback, using=self.connection.alias, robust=True)

    def released_by_the_server(self, handle: LockHandle, thread: int) -> None:
        """A lock the server released with its transaction (or savepoint): tell the signals
        and metrics, from the thread that ran the transaction."""
        if threading.get_ident() == thread:
            self.released(handle)

    def transaction_ended(self, handle: LockHandle, thread: int) -> None:
        """``handle``'s transaction (or savepoint) ended: release it, in the owning thread.

        Called at a commit, or while Django discards the callbacks at a rollback (between
        its ROLLBACK and restoring autocommit, or in ``close()`` after a failed rollback):
        the backend's statement must leave the connection as Django expects it, and an error
        must not escape into Django's rollback. A release that fails, or a call from another
        thread, leaves the hold to the fallbacks.
        """
        if threading.get_ident() != thread or handle not in self.pending:
            return
        try:
            released = self.backend.release(handle.db_key, shared=handle.shared)
        except (DatabaseError, LockLost):
            # The connection is broken (the database drops its locks with it) or Django is
            # closing it: the fallbacks release what remains.
            logger.warning(
                "Releasing lock %s on database %r at the end of its transaction failed; it "
                "is released with the connection, or at its next lock operation.",
                handle.lock_key.label,
                handle.using,
                exc_info=True,
            )
            return
        self.pending.remove(handle)
        if released:
            self.released(handle)

    def released(self, handle: LockHandle) -> None:
        """``handle``'s lock was released: tell the signals and metrics."""
        if signals.lock_released.receivers:
            signals.send(signals.lock_released, handle._lock, handle)
        if metrics.recorder is not None and handle.acquired_at is not None:
            held = monotonic() - handle.acquired_at
            metrics.recorder.held(held, self.backend.vendor, handle.using)

    def end_pending(self, *, late: bool = True) -> None:
        """The fallback: release the pending holds, whose transaction has ended.

        ``late``: their transaction's end did not release them (the callback was kept alive
        or freed in another thread): say so.
        """
        pending, self.pending = self.pending, []
        for handle in pending:
            if late:
                logger.warning(
                    "Lock %s on database %r was released after its transaction ended, not "
                    "at its end: the transaction's on_commit callback was kept alive (a "
                    "traceback holding Django's frame) or freed in another thread.",
                    handle.lock_key.label,
                    handle.using,
                )
            try:
                released = self.backend.release(handle.db_key, shared=handle.shared)
            except (DatabaseError, LockLost):
                logger.exception(
                    "Releasing lock %s on database %r failed; closing the connection, which "
                    "releases it.",
                    handle.lock_key.label,
                    handle.using,
                )
                self.discard_session()
                return
            if released:
                self.released(handle)

    def release_leftovers(self) -> None:
        """The end of a request: release what the request's code left held."""
        if self.pending and not self.connection.in_atomic_block:
            self.end_pending()
        holds, self.session_holds = self.session_holds, []
        if not holds:
            return
        logger.error(
            "A request ended holding %d session lock(s) on database %r (%s); releasing them.",
            len(holds),
            self.connection.alias,
            ", ".join(hold.lock_key.label for hold in holds[:5]),
        )
        for hold in reversed(holds):
            hold._ended = True  # its block can no longer release it
            if hold._session is not self.backend.session():
                continue  # its session closed, and the database dropped the lock with it
            if self.connection.in_atomic_block and self.backend.transaction_aborted():
                self.release_at_transaction_end(hold)
                continue
            try:
                self.backend.release(hold.db_key, shared=hold.shared)
            except (DatabaseError, LockLost):
                self.discard_session()
                return

    def reopened(self) -> None:
        """Django opened a new connection: every transaction of the old one has ended."""
        if self.pending:
            self.end_pending()

    def discard_session(self) -> None:
        """Close the driver connection for good (never back to a pool), then Django's: the
        database releases its locks."""
        raw = self.connection.connection
        try:
            if raw is not None:
                raw.close()  # first, so that a pool discards it instead of lending it again
        except Exception:  # closing a broken connection may fail; it is gone either way
            logger.debug("Closing a broken connection failed.", exc_info=True)
        try:
            self.connection.close()
        except DatabaseError:
            logger.debug("Closing a broken connection failed.", exc_info=True)
        self.backend.end_session()


_connection_locks: weakref.WeakKeyDictionary[BaseDatabaseWrapper, ConnectionLocks] = (
    weakref.WeakKeyDictionary()
)


def connection_locks(connection: BaseDatabaseWrapper) -> ConnectionLocks:
    """The locks held through ``connection`` (made on first use)."""
    locks = _connection_locks.get(connection)
    if locks is None:
        locks = _connection_locks[connection] = ConnectionLocks(connection)
    return locks


def release_leftovers(**kwargs: Any) -> None:
    """``request_finished``: release the locks a request left held on this thread's
    connections. A view that left a session lock behind (it never reached the block's
    exit) must not hand it to the next request served on the same connection, and file
    locks (SQLite) outlive even a closed connection."""
    for connection in connections.all(initialized_only=True):
        locks = _connection_locks.get(connection)
        if locks is not None:
            locks.release_leftovers()


def end_rolled_back_holds() -> None:
    """Release the transaction-scoped locks this thread's connections still hold for
    transactions that have ended, even inside an enclosing ``atomic`` block.

    Meant for test teardown, for holds that escaped their rollback (see the module
    docstring). PostgreSQL drops its own at the savepoint's rollback.
    """
    for connection in connections.all(initialized_only=True):
        locks = _connection_locks.get(connection)
        if locks is not None and locks.pending:
            locks.end_pending(late=False)  # an expected rollback: nothing to warn about


def connection_reopened(*, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """``connection_created``: holds waiting for the end of a transaction of the old
    connection can go now."""
    locks = _connection_locks.get(connection)
    if locks is not None:
        locks.reopened()


# Connected when the locks load, not in the app's ready(): a project that takes locks without
# "advisory_lock" in INSTALLED_APPS gets the same fallbacks. (The dispatch_uid makes a second
# connection a no-op.)
request_finished.connect(release_leftovers, dispatch_uid="advisory_lock.leftovers")
connection_created.connect(connection_reopened, dispatch_uid="advisory_lock.reopened")
