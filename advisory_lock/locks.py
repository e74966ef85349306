"""``advisory_lock``: a lock that is a context manager and a decorator, and knows ``atomic``.

One ``with advisory_lock(key, using=alias):`` goes like this:

1. ``__enter__`` takes this thread's connection for the alias (``connections[alias]``) and
   the locks held through it (``ConnectionLocks``, made on first use).
2. Inside ``transaction.atomic`` the lock is transaction-scoped: held until the outermost
   transaction ends, even if the block ends earlier, so that nobody takes it before the
   writes made under it are visible. Outside, it is session-scoped: held until the block
   ends. ``scope=`` asks for one or the other.
3. The database backend takes the lock (one statement when uncontended), and the hold is
   recorded (``SessionHold`` or ``TransactionHold``) before anything else can fail: only
   then are the signals sent, robustly.
4. ``__exit__`` ends the hold: a session hold is released at once on the session that took
   it; a transaction hold is left to its transaction.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from time import monotonic
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import TypeVar

from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from django.dispatch import Signal

from advisory_lock import signals
from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_seconds

logger = logging.getLogger("advisory_lock")

Scope = Literal["auto", "session", "transaction"]
SCOPES = ("auto", "session", "transaction")
F = TypeVar("F", bound=Callable[..., Any])


class LockHandle:
    """What ``with advisory_lock(...) as handle`` gives: falsy when a try found the lock busy.

    A lock that was taken is a ``SessionHold`` or a ``TransactionHold``, which know how it
    ends.
    """

    __slots__ = ("_lock", "_outer", "acquired_at", "connection", "db_key", "scope", "wait_time")

    #: Whether the lock was taken.
    acquired: ClassVar[bool] = False

    def __init__(
        self,
        lock: AdvisoryLock,
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

    def end_of_block(self, exc: BaseException | None) -> None:
        """The block ends: nothing to release, the lock was not taken."""


# The innermost handle of the blocks entered in this context (a thread, or an asyncio task):
# each links to the one it is nested in. One lock object may be entered by many threads at
# once (a decorated function), so it can't keep its handles itself.
_innermost: ContextVar[LockHandle | None] = ContextVar("advisory_lock_innermost", default=None)


class AdvisoryLock:
    """An advisory lock on ``key``: taken on entry, released on exit (or with the transaction).

    ``wait=True`` blocks until the lock is free, ``timeout`` bounds that wait (then
    ``LockNotAcquired``), ``wait=False`` tries once and yields a falsy handle when busy. The
    object is reusable; as a decorator each call takes the lock anew.
    """

    __slots__ = ("_timeout", "key", "lock_key", "scope", "shared", "timeout", "using", "wait")

    def __init__(
        self,
        key: Key | LockKey,
        *,
        using: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        scope: Scope = "auto",
    ) -> None:
        self.lock_key = make_key(key)
        #: The key as given (a LockKey, as read back from a ledger row, reads as its value).
        self.key: Key = key.value if isinstance(key, LockKey) else key
        self.using = check_alias(using)
        self.wait = check_flag("wait", wait)
        self.shared = check_flag("shared", shared)
        if scope not in SCOPES:
            raise ValueError(
                f"scope must be one of {', '.join(map(repr, SCOPES))}; got {scope!r}."
            )
        self.scope = scope
        self.timeout = timeout
        # What the backend is asked: None waits for ever, 0 tries once, else a bound.
        self._timeout: float | None
        if not wait:
            if timeout is not None:
                raise ValueError("timeout= can't be combined with wait=False (which tries once).")
            self._timeout = 0
        else:
            self._timeout = None if timeout is None else check_seconds("timeout", timeout)

    def __repr__(self) -> str:
        return f"<advisory_lock {self.lock_key.label} using={self.using!r} scope={self.scope!r}>"

    def __enter__(self) -> LockHandle:
        handle = self.acquire()
        handle._outer = _innermost.get()
        _innermost.set(handle)
        return handle

    def __exit__(self, exc_type: Any, exc_value: BaseException | None, traceback: Any) -> None:
        handle = _innermost.get()
        if handle is not None and handle._lock is self:
            _innermost.set(handle._outer)
        else:  # blocks exited out of order (by hand): unlink this lock's innermost handle
            handle = _unlink_innermost(self)
        self.release(handle, exc_value)

    def __call__(self, func: F) -> F:
        """Use as a decorator: take the lock around each call; a busy lock raises."""

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self as handle:
                if not handle:
                    raise LockNotAcquired(
                        f"Lock {self.lock_key.label} on database {self.using!r} is held by "
                        f"another session, so {func.__qualname__}() did not run. Retry later, "
                        f"or pass a timeout= to wait for it."
                    )
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def acquire(self) -> LockHandle:
        """Take the lock on this thread's connection; the handle says whether it was taken.

        ``__enter__`` without the bookkeeping of nested blocks: end the hold with
        ``release()``.
        """
        connection = connections[self.using]
        locks = connection_locks(connection)
        backend = locks.backend
        if self.shared and not backend.supports_shared:
            raise NotSupportedError(
                f"Shared locks are not supported on {backend.describe()}: MySQL and MariaDB "
                f"have no shared named locks. Lock {self.lock_key.label} exclusively."
            )
        if self._timeout and backend.max_timeout and self._timeout > backend.max_timeout:
            raise ValueError(
                f"timeout={self.timeout!r} is longer than {backend.describe()} can wait: at "
                f"most {backend.max_timeout} seconds. Pass a shorter timeout, or none to wait "
                f"for as long as it takes."
            )
        if connection.in_atomic_block:
            session = self.scope == "session"
        elif self.scope == "transaction":
            raise TransactionManagementError(
                f"advisory_lock({self.lock_key.label}, scope='transaction') must be used inside "
                f"transaction.atomic(using={self.using!r}). Wrap the block in atomic(), or use "
                f"scope='session'."
            )
        else:
            session = True
            if locks.pending:
                locks.end_pending()  # their transactions have ended (see ConnectionLocks)
        if session and (problem := backend.session_lock_problem()):
            raise NotSupportedError(problem)
        db_key = backend.db_key(self.lock_key)
        native = not session and backend.native_transaction_locks
        started = monotonic()
        acquired = backend.acquire(
            db_key, shared=self.shared, timeout=self._timeout, transaction=native
        )
        now = monotonic()
        handle: LockHandle
        if not acquired:
            handle = LockHandle(
                self,
                connection,
                "session" if session else "transaction",
                db_key,
                now - started,
                None,
            )
            if signals.lock_busy.receivers:
                send(signals.lock_busy, self, handle)
            if self.wait:
                waited = (
                    f"gave up after {self.timeout:g}s"
                    if self.timeout is not None
                    else "the server's lock_timeout ran out"
                )
                raise LockNotAcquired(
                    f"Lock {self.lock_key.label} on database {self.using!r} is held by another "
                    f"session; {waited}. Retry later, raise timeout=, or pass wait=False to skip "
                    f"the work when the lock is busy."
                )
            return handle
        # The hold records itself (and its release) before anything else can fail: from
        # here on the lock is always released.
        if session:
            handle = SessionHold(self, connection, db_key, now - started, now, locks)
        else:
            handle = TransactionHold(self, connection, db_key, now - started, now, locks, native)
        if signals.lock_acquired.receivers:
            send(signals.lock_acquired, self, handle)
        return handle

    def release(self, handle: LockHandle, exc: BaseException | None = None) -> None:
        """End ``handle``'s hold: release a session lock now (``LockLost`` if it was lost,
        unless ``exc`` is already propagating: then the loss is logged)."""
        handle.end_of_block(exc)


def advisory_lock(
    key: Key | LockKey,
    *,
    using: str | None = None,
    wait: bool = True,
    timeout: float | None = None,
    shared: bool = False,
    scope: Scope = "auto",
) -> AdvisoryLock:
    """Return an advisory lock on ``key``, for use as a context manager or a decorator.

    ``wait=True`` blocks until the lock is free, ``timeout`` bounds that wait (then
    ``LockNotAcquired``), ``wait=False`` tries once and yields a falsy handle when busy.
    """
    return AdvisoryLock(key, using=using, wait=wait, timeout=timeout, shared=shared, scope=scope)


def _unlink_innermost(lock: AdvisoryLock) -> LockHandle:
    """Remove ``lock``'s innermost handle from this context's chain, wherever it is."""
    chain = []
    handle = _innermost.get()
    while handle is not None and handle._lock is not lock:
        chain.append(handle)
        handle = handle._outer
    if handle is None:
        raise RuntimeError(f"{lock!r} was exited in a context where it was not entered.")
    chain[-1]._outer = handle._outer
    return handle


class SessionHold(LockHandle):
    """A session lock: released when its block exits, on the session that took it."""

    __slots__ = ("_ended", "_locks", "_session")
    acquired = True

    def __init__(
        self,
        lock: AdvisoryLock,
        connection: BaseDatabaseWrapper,
        db_key: Any,
        wait_time: float,
        acquired_at: float,
        locks: ConnectionLocks,
    ) -> None:
        super().__init__(lock, connection, "session", db_key, wait_time, acquired_at)
        self._locks = locks
        self._session = locks.backend.session()  # the lock lives as long as it
        self._ended = False
        locks.session_holds.append(self)

    def end_of_block(self, exc: BaseException | None) -> None:
        if self._ended:
            return  # the request-end safety net released it already
        self._ended = True
        locks = self._locks
        backend = locks.backend
        locks.forget(self)
        if backend.session() is not self._session:
            # The database dropped the lock when the session closed: the block did not run
            # under it to the end.
            return self._lost(
                exc, "was lost during the block: the connection holding it was closed."
            )
        if self.connection.in_atomic_block and backend.transaction_aborted():
            # PostgreSQL refuses every statement until the rollback: release after it.
            locks.defer(self)
            return None
        try:
            released = backend.release(self.db_key, shared=self._lock.shared)
        except LockLost as error:
            return self._lost(exc, str(error))
        except DatabaseError as error:
            # Close the connection, which releases the lock, so that nobody reuses a
            # connection whose locks are in an unknown state.
            locks.discard_session()
            return self._lost(
                exc,
                f"could not be released ({error}); the connection was closed, which releases it.",
                error,
            )
        if not released:
            return self._lost(
                exc,
                "was not held by this connection when released: it was lost during the block "
                "(connection reset, pg_advisory_unlock_all(), or a transaction-mode pooler).",
            )
        if signals.lock_released.receivers:
            send(signals.lock_released, self._lock, self)
        return None

    def _lost(
        self, exc: BaseException | None, what: str, cause: BaseException | None = None
    ) -> None:
        """Raise LockLost, unless an exception is already propagating (then log and keep it)."""
        message = f"Lock {self.lock_key.label} on database {self.using!r} {what}"
        send(signals.lock_lost, self._lock, self)
        if exc is not None:
            logger.error(message)
            return
        raise LockLost(message) from cause


class TransactionHold(LockHandle):
    """A lock held until the transaction it was taken in ends.

    PostgreSQL releases it itself (``native``). MySQL and SQLite have no such locks: the
    hold waits in its connection's ``pending`` list and is released right after the commit
    by an ``on_commit`` callback. Django has no rollback hook, so after a rollback it is
    released at the connection's next lock operation, at the end of the request, or when
    the connection is opened again (see ``ConnectionLocks.end_pending``): later, never
    earlier, than the transaction's end.
    """

    __slots__ = ()
    acquired = True

    def __init__(
        self,
        lock: AdvisoryLock,
        connection: BaseDatabaseWrapper,
        db_key: Any,
        wait_time: float,
        acquired_at: float,
        locks: ConnectionLocks,
        native: bool,
    ) -> None:
        super().__init__(lock, connection, "transaction", db_key, wait_time, acquired_at)
        if not native:
            locks.defer(self)
        elif signals.lock_released.receivers:
            transaction.on_commit(
                lambda: send(signals.lock_released, lock, self), using=lock.using, robust=True
            )


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
                send(signals.lock_released, handle._lock, handle)

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


def connection_reopened(*, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """``connection_created``: holds waiting for the end of a transaction of the old
    connection can go now."""
    locks = _connection_locks.get(connection)
    if locks is not None:
        locks.reopened()


def send(signal: Signal, sender: object, handle: LockHandle) -> None:
    """Send a lock signal to its receivers; one that raises is logged, never propagated."""
    if not signal.receivers:  # the common case, checked without building any arguments
        return
    held = monotonic() - handle.acquired_at if handle.acquired_at is not None else None
    responses = signal.send_robust(
        sender=sender,
        key=handle.key,
        name=handle.key if isinstance(handle.key, str) else None,
        using=handle.using,
        scope=handle.scope,
        wait_time=handle.wait_time,
        hold_time=held,
    )
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.error(
                "A receiver of an advisory_lock signal (%s) raised for lock %s on database "
                "%r: %r. The lock is unaffected.",
                getattr(receiver, "__qualname__", receiver),
                handle.lock_key.label,
                handle.using,
                response,
                exc_info=response,
            )
