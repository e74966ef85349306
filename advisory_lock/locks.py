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

import asyncio
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from time import monotonic
from typing import Any
from typing import Literal
from typing import TypeVar

from django.db import DatabaseError
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError

from advisory_lock import directory
from advisory_lock import metrics
from advisory_lock import signals
from advisory_lock.async_locks import acquire_in_turn
from advisory_lock.async_locks import release_in_thread
from advisory_lock.backends import backend_for
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.heartbeat import Heartbeat
from advisory_lock.holds import ConnectionLocks
from advisory_lock.holds import LockHandle
from advisory_lock.holds import SessionHold
from advisory_lock.holds import TransactionHold
from advisory_lock.holds import connection_locks
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_seconds

logger = logging.getLogger("advisory_lock")

Scope = Literal["auto", "session", "transaction"]
#: What a heartbeat does on a loss, besides setting the handle's ``lost``: call this, or
#: cancel the asyncio task that holds the lock.
OnLost = Callable[[LockHandle], None] | Literal["cancel"] | None
#: The message of the cancellation that a heartbeat sends ("cancel").
LOST_CANCEL = "advisory_lock: the lock was lost"
SCOPES = ("auto", "session", "transaction")
F = TypeVar("F", bound=Callable[..., Any])


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

    __slots__ = (
        "_timeout",
        "fencing",
        "heartbeat",
        "key",
        "lock_key",
        "on_lost",
        "scope",
        "shared",
        "timeout",
        "using",
        "wait",
    )

    def __init__(
        self,
        key: Key | LockKey,
        *,
        using: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        scope: Scope = "auto",
        heartbeat: float | None = None,
        on_lost: OnLost = None,
        fencing: bool = False,
    ) -> None:
        self.lock_key = make_key(key)
        #: The key as given (a LockKey, as read back from a ledger row, reads as its value).
        self.key: Key = key.value if isinstance(key, LockKey) else key
        # The checks are called only for what is not plainly valid: a lock is built on a
        # hot path.
        self.using = using if type(using) is str and using else check_alias(using)
        self.wait = wait if wait is True or wait is False else check_flag("wait", wait)
        self.shared = shared if shared is False or shared is True else check_flag("shared", shared)
        if scope != "auto" and scope not in SCOPES:
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
        #: Seconds between the checks of a held lock's heartbeat (``heartbeat``), or None.
        self.heartbeat = (
            None if heartbeat is None else check_seconds("heartbeat", heartbeat, allow_zero=False)
        )
        if on_lost is not None and not (on_lost == "cancel" or callable(on_lost)):
            raise TypeError(f"on_lost must be a callable or 'cancel'; got {on_lost!r}.")
        if on_lost is not None and heartbeat is None:
            raise ValueError(
                "on_lost= is called when the lock's heartbeat finds it lost: pass heartbeat= "
                "(seconds between its checks) too."
            )
        self.on_lost = on_lost
        #: Each hold gets the key's next fencing token (``handle.token``).
        self.fencing = (
            fencing if fencing is False or fencing is True else check_flag("fencing", fencing)
        )

    def __repr__(self) -> str:
        return f"<advisory_lock {self.lock_key.label} using={self.using!r} scope={self.scope!r}>"

    def __enter__(self) -> LockHandle:
        # acquire(), inlined: this is the hot path.
        if self.on_lost == "cancel":
            self._refuse_cancel()
        connection = connections[self.using]
        handle = self._take(connection, connection_locks(connection), self._timeout)
        if metrics.recorder is not None:
            self._record(handle, handle.wait_time)
        if not handle.acquired:
            self._busy(handle)
        elif self.fencing or self.heartbeat is not None:
            self._watch(handle, None)
        handle._outer = _innermost.get()
        _innermost.set(handle)
        return handle

    def __exit__(self, exc_type: Any, exc_value: BaseException | None, traceback: Any) -> None:
        handle = _innermost.get()
        if handle is not None and handle._lock is self:
            _innermost.set(handle._outer)
        else:  # blocks exited out of order (by hand): unlink this lock's innermost handle
            handle = _unlink_innermost(self)
        handle.end_of_block(exc_value)  # release(), inlined

    def __call__(self, func: F) -> F:
        """Use as a decorator: take the lock around each call (each await, for an ``async
        def``); a busy lock raises ``LockNotAcquired``."""

        def not_run() -> LockNotAcquired:
            return LockNotAcquired(
                f"Lock {self.lock_key.label} on database {self.using!r} is held by another "
                f"session, so {func.__qualname__}() did not run. Retry later, or pass a "
                f"timeout= to wait for it."
            )

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                async with self as handle:
                    if not handle:
                        raise not_run()
                    return await func(*args, **kwargs)

            return async_inner  # type: ignore[return-value]

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self as handle:
                if not handle:
                    raise not_run()
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def acquire(self) -> LockHandle:
        """Take the lock on this thread's connection; the handle says whether it was taken.

        ``__enter__`` without the bookkeeping of nested blocks: end the hold with
        ``release()``.
        """
        if self.on_lost == "cancel":
            self._refuse_cancel()
        connection = connections[self.using]
        handle = self._take(connection, connection_locks(connection), self._timeout)
        if metrics.recorder is not None:
            self._record(handle, handle.wait_time)
        if not handle.acquired:
            self._busy(handle)
        elif self.fencing or self.heartbeat is not None:
            self._watch(handle, None)
        return handle

    def release(self, handle: LockHandle, exc: BaseException | None = None) -> None:
        """End ``handle``'s hold: release a session lock now (``LockLost`` if it was lost,
        unless ``exc`` is already propagating: then the loss is logged)."""
        handle.end_of_block(exc)

    def _take(
        self,
        connection: BaseDatabaseWrapper,
        locks: ConnectionLocks,
        timeout: float | None,
        task: object = None,
    ) -> LockHandle:
        """One attempt: the backend waits at most ``timeout`` (None: for ever, 0: tries).

        ``task`` (async code): the asyncio task taking it. Tasks of one event loop may share
        a connection, whose session would grant each of them a lock another holds: a lock
        that another task holds through this connection is busy for this one.
        """
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
        # The lock directory hears of the name and the session before the attempt, so that a
        # waiter shows by name too; of a session opened by the attempt, after it. No
        # statement: see advisory_lock.directory.
        recorder = directory.recorder
        holds = locks.holds_now if session else locks.in_transaction
        noted = recorder is None or recorder.note(
            backend, self.using, db_key, self.lock_key, holds
        )
        started = monotonic()
        handle: LockHandle | None = None
        try:
            if task is not None and locks.held_by_another_task(db_key, task, self.shared):
                acquired = False
            else:
                acquired = backend.acquire(
                    db_key, shared=self.shared, timeout=timeout, transaction=native
                )
            if not noted and recorder is not None:
                recorder.note(backend, self.using, db_key, self.lock_key, holds)
            now = monotonic()
            if not acquired:
                scope: Literal["session", "transaction"] = "session" if session else "transaction"
                return LockHandle(self, connection, scope, db_key, now - started, None)
            # The hold records itself (and its release) before anything else can fail: from
            # here on the lock is always released.
            if session:
                handle = SessionHold(self, connection, db_key, now - started, now, locks, task)
            else:
                handle = TransactionHold(
                    self, connection, db_key, now - started, now, locks, native
                )
        except BaseException as error:
            # A signal handler's exception (Ctrl-C, SIGTERM, a task queue's time limit)
            # surfaces at the interpreter's next check, which can come after the database
            # granted the lock and before the hold recorded it. An error of the statement
            # itself (DatabaseError, AdvisoryLockError) granted nothing.
            if (
                handle is None
                and session
                and not isinstance(error, (DatabaseError, AdvisoryLockError))
                and not locks.holds(db_key)
            ):
                backend.undo_interrupted_acquire(db_key, shared=self.shared)
            raise
        if signals.lock_acquired.receivers:
            signals.send(signals.lock_acquired, self, handle)
        return handle

    def _refuse_cancel(self) -> None:
        raise ValueError(
            "on_lost='cancel' cancels the asyncio task that holds the lock: use it with "
            "async with (or on an async def), or pass a callable."
        )

    def _watch(
        self, handle: LockHandle, task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None
    ) -> None:
        """What a taken lock gets besides the hold, in the thread that took it: its fencing
        token, then its heartbeat. If either fails, the lock is let go of."""
        try:
            if self.fencing:
                # Imported here: the fencing tokens are a model of the app, which a plain
                # lock does without (see conf.require_app).
                from advisory_lock.fencing import issue_token

                handle.token = issue_token(self.using, self.lock_key)
            if self.heartbeat is not None:
                self._start_heartbeat(handle, task)
        except BaseException as error:
            handle.end_of_block(error)
            raise

    def _start_heartbeat(
        self, handle: LockHandle, task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None
    ) -> None:
        """Watch ``handle``'s lock (see ``heartbeat``), in the thread that took it. On a
        loss: ``lost`` is set, a warning is logged, then ``on_lost(handle)`` is called, or
        the holding ``task`` (its loop, itself) is cancelled with ``on_lost="cancel"``."""
        assert self.heartbeat is not None
        on_lost = self.on_lost

        def lost() -> None:
            handle.lost = True
            logger.warning(
                "Lock %s on database %r was lost: its heartbeat found it no longer held by "
                "the session that took it. Another process may take it now.",
                self.lock_key.label,
                self.using,
            )
            if task is not None and on_lost == "cancel":
                loop, holder = task
                loop.call_soon_threadsafe(holder.cancel, LOST_CANCEL)
            elif callable(on_lost):
                on_lost(handle)

        handle._heartbeat = Heartbeat(
            backend_for(handle.connection),
            self.using,
            handle.db_key,
            self.heartbeat,
            lost,
            self.lock_key.label,
        )

    def _record(self, handle: LockHandle, wait_time: float) -> None:
        """Record the outcome of taking the lock in the metrics (when they are on)."""
        if metrics.recorder is not None:
            outcome = "acquired" if handle.acquired else "timeout" if self.wait else "busy"
            vendor = handle.connection.vendor
            metrics.recorder.acquisition(outcome, vendor, self.using, wait_time)

    def _busy(self, handle: LockHandle) -> None:
        """The lock was not taken: tell ``lock_busy``'s receivers, and raise if it had to be."""
        if signals.lock_busy.receivers:
            signals.send(signals.lock_busy, self, handle)
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

    # Async code: ``async with advisory_lock(...)`` and ``@advisory_lock(...)`` on ``async def``.

    async def __aenter__(self) -> LockHandle:
        task = asyncio.current_task()
        holder = None if task is None else (asyncio.get_running_loop(), task)

        def attempt() -> LockHandle:  # in the thread of the async ORM calls
            connection = connections[self.using]
            handle = self._take(connection, connection_locks(connection), 0, task)
            if handle.acquired and (self.fencing or self.heartbeat is not None):
                self._watch(handle, holder)
            return handle

        handle, waited = await acquire_in_turn(
            attempt,
            self.release,
            self,
            wait=self.wait,
            timeout=self._timeout,
            reentrant=self._held_here(),
        )
        self._record(handle, waited)
        if not handle.acquired:
            self._busy(handle)  # raises LockNotAcquired when it had to wait
        handle._outer = _innermost.get()
        _innermost.set(handle)
        return handle

    async def __aexit__(
        self, exc_type: Any, exc_value: BaseException | None, traceback: Any
    ) -> None:
        handle = _innermost.get()
        if handle is not None and handle._lock is self:
            _innermost.set(handle._outer)
        else:
            handle = _unlink_innermost(self)
        await release_in_thread(self.release, handle, exc_value, self)
        if (
            handle.lost
            and self.on_lost == "cancel"
            and isinstance(exc_value, asyncio.CancelledError)
            and exc_value.args == (LOST_CANCEL,)
        ):
            # Cancelled by the heartbeat: the block ends with LockLost, which says why,
            # unless another cancellation is pending too (Python 3.11's count of them).
            task = asyncio.current_task()
            if sys.version_info >= (3, 11) and task is not None and task.uncancel():
                return
            handle.check()

    def _held_here(self) -> bool:
        """Does a block entered in this context (an asyncio task) hold this lock already?
        An async block is always the task's own: a sync block can't stay open across an
        ``await``."""
        handle = _innermost.get()
        identity = self.lock_key.identity
        while handle is not None:
            if (
                handle.acquired
                and handle.using == self.using
                and handle.lock_key.identity == identity
            ):
                return True
            handle = handle._outer
        return False


def advisory_lock(
    key: Key | LockKey,
    *,
    using: str | None = None,
    wait: bool = True,
    timeout: float | None = None,
    shared: bool = False,
    scope: Scope = "auto",
    heartbeat: float | None = None,
    on_lost: OnLost = None,
    fencing: bool = False,
) -> AdvisoryLock:
    """Return an advisory lock on ``key``, for use as a context manager or a decorator.

    ``wait=True`` blocks until the lock is free, ``timeout`` bounds that wait (then
    ``LockNotAcquired``), ``wait=False`` tries once and yields a falsy handle when busy.
    ``heartbeat=N``: while held, check every N seconds from a connection of its own that the
    lock is still held; on a loss the handle's ``lost`` is set (``check()`` raises
    ``LockLost``) and ``on_lost(handle)`` is called, or with ``on_lost="cancel"`` the asyncio
    task that holds it is cancelled (the block then raises ``LockLost``).
    ``fencing=True``: each hold gets the key's next fencing token (``handle.token``), larger
    than every one issued before, for the holder's own fenced writes.
    """
    return AdvisoryLock(
        key,
        using=using,
        wait=wait,
        timeout=timeout,
        shared=shared,
        scope=scope,
        heartbeat=heartbeat,
        on_lost=on_lost,
        fencing=fencing,
    )


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
