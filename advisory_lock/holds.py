"""What each Django connection holds: its session holds, and the holds waiting for the end of
a transaction; the request-end safety net."""

from __future__ import annotations

import logging
import weakref
from time import monotonic
from typing import TYPE_CHECKING
from typing import Any

from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock import metrics
from advisory_lock import signals
from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.exceptions import LockLost

if TYPE_CHECKING:
    from advisory_lock.locks import LockHandle
    from advisory_lock.locks import SessionHold

logger = logging.getLogger("advisory_lock")


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

    def forget(self, hold: SessionHold) -> None:
        """``hold``'s block ended (nearly always the last one that began)."""
        holds = self.session_holds
        if holds and holds[-1] is hold:
            holds.pop()
        else:
            holds.remove(hold)

    def defer(self, handle: LockHandle) -> None:
        """Release ``handle``'s lock when the transaction ends (see ``TransactionHold``)."""
        self.pending.append(handle)
        # One callback per hold: any one that survives (a hold's savepoint may be rolled back,
        # taking its callback with it) releases them all after the commit.
        transaction.on_commit(self.committed, using=self.connection.alias, robust=True)

    def committed(self) -> None:
        """The on_commit callback: the transaction that took the pending holds committed."""
        self.end_pending(late=False)

    def end_pending(self, *, late: bool = True) -> None:
        """Release the pending holds: their transaction has ended.

        ``late``: the on_commit callback did not run (the transaction rolled back, or an
        earlier on_commit callback raised and Django ran no later one): say so.
        """
        pending, self.pending = self.pending, []
        for handle in pending:
            if late:
                logger.warning(
                    "Lock %s on database %r was released after its transaction ended, not at "
                    "its commit: the transaction rolled back, or an earlier on_commit callback "
                    "raised and Django ran no later one.",
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
            if released and signals.lock_released.receivers:
                signals.send(signals.lock_released, handle._lock, handle)
            if released and metrics.recorder is not None and handle.acquired_at is not None:
                held = monotonic() - handle.acquired_at
                metrics.recorder.held(held, self.backend.vendor, handle.using)

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
                self.defer(hold)
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

    Meant for test teardown: a test case rolls its transaction (a savepoint of the class's,
    with Django's ``TestCase``) back, Django runs no hook on a rollback, and on MySQL and
    SQLite the pending holds would otherwise wait for the next lock taken outside any
    transaction. PostgreSQL drops them itself at the savepoint's rollback.
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
