"""``advisory_lock``: a context manager and decorator that knows about ``transaction.atomic``."""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from threading import get_ident
from time import monotonic
from typing import Any
from typing import Literal
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS
from django.db import DatabaseError
from django.db import connections
from django.db import transaction
from django.db.transaction import TransactionManagementError
from django.db.utils import load_backend

from advisory_lock import signals
from advisory_lock.backends import backend_for
from advisory_lock.backends import get_backend
from advisory_lock.backends.base import LockBackend
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key

logger = logging.getLogger("advisory_lock")
_new_object = object.__new__

Scope = Literal["auto", "session", "transaction"]
SCOPES = ("auto", "session", "transaction")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(slots=True, repr=False)
class LockHandle:
    """What ``with advisory_lock(...) as handle`` gives: falsy when a try found the lock busy.

    ``key``, ``using``, ``shared`` and ``lock_key`` are the lock's: one is built per ``with``,
    under contention mostly for a busy try, so it holds what only this entry knows.
    """

    db_key: Any
    scope: Literal["session", "transaction"]
    acquired: bool
    _lock: AdvisoryLock
    wait_time: float = 0.0
    acquired_at: float | None = None
    _token: object = None
    _backend: LockBackend | None = None
    _outer: LockHandle | None = None  # the enclosing block's

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


class AdvisoryLock:
    """An advisory lock on ``key``, taken on entry and released on exit (or at transaction end).

    With ``scope="auto"``, a lock taken inside ``transaction.atomic`` is transaction-scoped:
    it is held until the outermost transaction commits or rolls back, even if the ``with``
    block ends earlier, so nobody takes it before the writes made under it are visible.
    Outside ``atomic`` the lock is session-scoped and released when the block ends. The
    object is reusable; as a decorator each call takes the lock anew.
    """

    # One is made per ``with advisory_lock(...)``: no instance dict to allocate.
    __slots__ = (
        "_innermost",
        "_timeout",
        "key",
        "lock_key",
        "scope",
        "shared",
        "timeout",
        "using",
        "wait",
    )

    def __init__(
        self,
        key: Key,
        *,
        using: str | None = None,
        wait: bool = True,
        timeout: float | None = None,
        shared: bool = False,
        scope: Scope = "auto",
    ) -> None:
        self._setup(key, using, wait, timeout, shared, scope)

    def _setup(
        self,
        key: Key,
        using: str | None,
        wait: bool,
        timeout: float | None,
        shared: bool,
        scope: Scope,
    ) -> None:
        """Validate the arguments and set the lock up (``__init__``, with positional arguments)."""
        self.key = key
        self.lock_key: LockKey = make_key(key)
        if using is not None and not isinstance(using, str):
            raise TypeError(f"using must be a database alias (str) or None, not {using!r}.")
        self.using = using or DEFAULT_DB_ALIAS
        # Identity tests, not isinstance(): one lock is made per ``with``, and they are as exact.
        if wait is not True and wait is not False:
            raise TypeError(f"wait must be True or False, not {wait!r}.")
        if shared is not True and shared is not False:
            raise TypeError(f"shared must be True or False, not {shared!r}.")
        if scope not in SCOPES:
            raise ValueError(
                f"scope must be one of {', '.join(map(repr, SCOPES))}; got {scope!r}."
            )
        self.wait = wait
        self.timeout = timeout
        self.shared = shared
        self.scope = scope
        if timeout is None:
            self._timeout = None if wait else 0
        else:
            self._timeout = _checked_timeout(wait, timeout)
        # The innermost handle of the blocks this object is in, per thread id (each links to
        # the one it is nested in): one decorated function (one object) runs in many threads
        # at once. (A threading.local per object would cost more than the rest of __init__.)
        self._innermost: dict[int, LockHandle] = {}

    def __repr__(self) -> str:
        return f"<advisory_lock {self.lock_key.label} using={self.using!r} scope={self.scope!r}>"

    def __enter__(self) -> LockHandle:
        backend = backend_for(self.using)
        connection = backend.connection
        if self.shared and not backend.supports_shared:
            raise NotSupportedError(
                f"Shared locks are not supported on {backend.describe()}: MySQL and MariaDB "
                f"have no shared named locks. Lock {self.lock_key.label} exclusively."
            )
        if self.scope == "auto" and not connection.in_atomic_block:
            scope: Literal["session", "transaction"] = "session"
        else:
            scope = self._resolve_scope(connection)
        if scope == "session" and (problem := backend.session_lock_problem()):
            raise NotSupportedError(problem)
        db_key = backend.db_key(self.lock_key)
        native = scope == "transaction" and backend.native_transaction_scope
        started = monotonic()
        acquired = backend.acquire(
            db_key, shared=self.shared, transaction=native, timeout=self._timeout
        )
        now = monotonic()
        thread, innermost = get_ident(), self._innermost
        # Positional: a third of the cost of passing these by keyword.
        handle = LockHandle(
            db_key,
            scope,
            acquired,
            self,
            now - started,
            now if acquired else None,
            backend.holder_token() if acquired else None,
            backend,
            innermost.get(thread),
        )
        if not acquired:
            # A busy try is an expected outcome, and under contention most tries are busy: it
            # is not logged (lock_busy tells whoever listens), and nothing is built for it.
            if signals.lock_busy.receivers:
                _send(signals.lock_busy, self, handle)
            if self.wait:
                waited = (
                    f"gave up after {self.timeout:g}s"
                    if self.timeout is not None
                    else "the server's lock_timeout ran out"
                )
                raise LockNotAcquired(
                    f"Lock {self.lock_key.label} on database {self.using!r} is held by another "
                    f"session; {waited}. Retry later, raise timeout=, or pass wait=False to "
                    f"skip the work when the lock is busy."
                )
        else:
            if signals.lock_acquired.receivers:
                _send(signals.lock_acquired, self, handle)
            if scope == "session":
                backend.session_holds[db_key] = backend.session_holds.get(db_key, 0) + 1
            elif not native:
                _release_at_transaction_end(backend, handle, after_rollback=False)
            elif signals.lock_released.receivers:
                _at_transaction_end(handle, lambda: _send(signals.lock_released, self, handle))
        innermost[thread] = handle
        return handle

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        thread = get_ident()
        handle = self._innermost.pop(thread)
        if handle._outer is not None:
            self._innermost[thread] = handle._outer
        if handle.acquired and handle.scope == "session":
            backend = handle._backend
            holds = backend.session_holds
            count = holds.get(handle.db_key, 0)
            if count > 1:
                holds[handle.db_key] = count - 1
            else:
                holds.pop(handle.db_key, None)
            _release_session_lock(backend, handle, exc_value, self)

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

    def _resolve_scope(self, connection: Any) -> Literal["session", "transaction"]:
        if self.scope == "session":
            return "session"
        if connection.in_atomic_block:
            return "transaction"
        if self.scope == "transaction":
            raise TransactionManagementError(
                f"advisory_lock({self.lock_key.label}, scope='transaction') must be used inside "
                f"transaction.atomic(using={self.using!r}). Wrap the block in atomic(), or use "
                f"scope='session'."
            )
        return "session"


def direct_alias(alias: str) -> str:
    """The alias that reaches ``alias``'s database without a pooler (DIRECT_ALIAS)."""
    return get_setting("DIRECT_ALIAS").get(alias, alias)


def release_leftover_session_locks(**kwargs: Any) -> None:
    """At the end of a request, release session locks still held on this thread's connections.

    A view that leaves a session lock behind (it never reached the block's exit) must not hand
    it to the next request served on a persistent (CONN_MAX_AGE > 0) connection.
    """
    for connection in connections.all(initialized_only=True):
        backend = getattr(connection, "_advisory_lock_backend", None)
        if backend is None or not backend.session_holds:
            continue
        leftovers = list(backend.session_holds)
        logger.error(
            "A request ended holding %d session lock(s) on database %r (%s); releasing them.",
            len(leftovers),
            connection.alias,
            ", ".join(map(repr, leftovers[:5])),
        )
        if connection.connection is None:
            backend.session_holds.clear()
            continue
        try:
            backend.release_all()
        except DatabaseError:
            backend.discard_connection()


def advisory_lock(
    key: Key,
    *,
    using: str | None = None,
    wait: bool = True,
    timeout: float | None = None,
    shared: bool = False,
    scope: Scope = "auto",
) -> AdvisoryLock:
    """Return an advisory lock on ``key`` for use as a context manager or a decorator.

    ``wait=True`` blocks until the lock is free, ``timeout`` bounds that wait (then
    ``LockNotAcquired``), ``wait=False`` tries once and yields a falsy handle when busy.
    """
    # Not AdvisoryLock(key, using=using, ...): calling a class with keyword arguments makes
    # CPython build a dict of them for __init__, which costs as much as the rest of this.
    lock = _new_object(AdvisoryLock)
    lock._setup(key, using, wait, timeout, shared, scope)
    return lock


def _checked_timeout(wait: bool, timeout: object) -> float | None:
    """The backend's timeout: None waits for ever, 0 tries once, else a bound in seconds."""
    if not wait:
        if timeout is not None:
            raise ValueError("timeout= can't be combined with wait=False (which tries once).")
        return 0
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise ValueError(f"timeout must be a number of seconds or None, not {timeout!r}.")
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"timeout must be a finite number of seconds >= 0, not {timeout!r}.")
    return float(timeout)


def _release_session_lock(
    backend: LockBackend, handle: LockHandle, exc: BaseException | None, sender: object
) -> None:
    """Release on the connection that took the lock; never leave it in an unknown state."""
    if backend.holder_token() is not handle._token:
        # The connection that held the lock was closed during the block: the database
        # dropped the lock then, so the block did not run under it to the end.
        label = handle.lock_key.label
        message = (
            f"Lock {label} on database {handle.using!r} was lost during the block: the "
            f"connection holding it was closed."
        )
        _lost(sender, handle, exc, message)
        return
    if backend.connection.in_atomic_block and backend.transaction_is_aborted():
        # PostgreSQL refuses every statement (25P02) until the rollback: release right after.
        _release_at_transaction_end(backend, handle, after_rollback=True)
        return
    try:
        released = backend.release(handle.db_key, shared=handle.shared)
    except LockLost as error:
        _lost(sender, handle, exc, str(error))
        return
    except DatabaseError as error:
        # The release could not run: close the connection so that the database drops the lock
        # and nobody reuses a connection whose locks are in an unknown state.
        backend.discard_connection()
        label = handle.lock_key.label
        message = (
            f"Releasing lock {label} on database {handle.using!r} failed ({error}); the "
            f"connection was closed, which releases it."
        )
        _lost(sender, handle, exc, message, error)
        return
    if not released:
        label = handle.lock_key.label
        message = (
            f"Lock {label} on database {handle.using!r} was not held by this connection when "
            f"released: it was lost during the block (connection reset, "
            f"pg_advisory_unlock_all(), or a transaction-mode pooler)."
        )
        _lost(sender, handle, exc, message)
        return
    if signals.lock_released.receivers:
        _send(signals.lock_released, sender, handle)


def _lost(
    sender: object,
    handle: LockHandle,
    exc: BaseException | None,
    message: str,
    cause: BaseException | None = None,
) -> None:
    """Raise LockLost, unless an exception is already propagating (then log and keep it)."""
    _send(signals.lock_lost, sender, handle)
    if exc is not None:
        logger.error(message)
        return
    raise LockLost(message) from cause


def _send(signal: Any, sender: object, handle: LockHandle) -> None:
    if not signal.receivers:  # the common case, checked without building the receivers list
        return
    held = monotonic() - handle.acquired_at if handle.acquired_at is not None else None
    signal.send(
        sender=sender,
        key=handle.key,
        name=handle.key if isinstance(handle.key, str) else None,
        using=handle.using,
        scope=handle.scope,
        wait_time=handle.wait_time,
        hold_time=held,
    )


class _ReleaseAtTransactionEnd:
    """Releases one hold when the transaction that took it ends, by commit or by rollback.

    Django runs ``on_commit`` callbacks after a commit and drops them on a rollback
    (of the transaction, or of the savepoint they were registered in); dropping the last
    reference runs ``__del__``, so either way the release runs exactly once, right then.
    """

    __slots__ = ("_release",)

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def __call__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __del__(self) -> None:
        try:
            self()
        except Exception:
            logger.exception("Releasing an advisory lock at the end of a transaction failed.")


def _at_transaction_end(handle: LockHandle, callback: Callable[[], None]) -> None:
    transaction.on_commit(_ReleaseAtTransactionEnd(callback), using=handle.using, robust=True)


def _release_at_transaction_end(
    backend: LockBackend, handle: LockHandle, *, after_rollback: bool
) -> None:
    def release() -> None:
        connection = backend.connection
        rolled_back = after_rollback and not connection.in_atomic_block
        if backend.holder_token() is not handle._token:
            return  # the connection closed: the database dropped the lock with it
        try:
            backend.release(handle.db_key, shared=handle.shared, after_rollback=rolled_back)
        except (DatabaseError, LockLost):
            logger.exception("Releasing lock %r failed; closing the connection.", handle.key)
            backend.discard_connection()
            return
        _send(signals.lock_released, backend, handle)

    _at_transaction_end(handle, release)


class DedicatedLock:
    """A session lock on a connection opened for it alone, with a watchdog for its loss.

    Used by single-instance commands and the ledger: nothing the caller does to Django's
    connections (closing them, pooling them) can drop or leak it.
    """

    def __init__(self, key: Key, *, using: str | None, label: str) -> None:
        self.key = make_key(key)
        self.using = direct_alias(using or DEFAULT_DB_ALIAS)
        self.label = label
        settings_dict = connections.settings[self.using]
        backend_class = type(backend_for(self.using))
        dedicated = backend_class.dedicated_settings(settings_dict, f"{label} (advisory_lock)")
        self.connection = load_backend(dedicated["ENGINE"]).DatabaseWrapper(dedicated, self.using)
        self.backend = get_backend(self.connection)
        if problem := self.backend.session_lock_problem():
            raise NotSupportedError(problem)
        self.db_key = self.backend.db_key(self.key)
        self.lost = False
        self.acquired_at: float | None = None
        self._mutex = threading.Lock()  # the watchdog and the main thread share the connection
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._checker: threading.Thread | None = None

    def acquire(self, wait: float) -> bool:
        started = monotonic()
        with self._mutex:
            acquired = self.backend.acquire(
                self.db_key, shared=False, transaction=False, timeout=wait
            )
        waited = monotonic() - started
        if acquired:
            self.acquired_at = monotonic()
            logger.info("%s: acquired lock %s after %.3fs.", self.label, self.key.label, waited)
        else:
            logger.info(
                "%s: lock %s busy after %.3fs; skipped.", self.label, self.key.label, waited
            )
        return acquired

    def busy_message(self) -> str:
        try:
            with self._mutex:
                holder = self.backend.holder(self.db_key)
        except DatabaseError:
            holder = None
        finally:
            self.connection.close()
        held_by = f" by {_describe_holder(holder)}" if holder else ""
        return (
            f"{self.label}: skipped, another instance holds lock {self.key.label} on database "
            f"{self.using!r}{held_by}."
        )

    def close(self) -> None:
        """Close the lock's connection (after a failed acquire)."""
        self.connection.close()

    def lost_message(self) -> str:
        return (
            f"{self.label}: lock {self.key.label} on database {self.using!r} was lost (its "
            f"connection was closed or killed): another instance may now run. Stopping."
        )

    def watch(self, heartbeat: float, on_lost: Callable[[], None]) -> None:
        """Check every ``heartbeat`` seconds (one statement) that the lock is still held.

        A check that gets no answer within ``heartbeat`` counts as a loss too: on a silent
        network (a partition, a black-holed route) the statement would wait for ever, and a
        lock we can't prove we hold must be treated as lost.
        """

        def run() -> None:
            while not self._stop.wait(heartbeat):
                held = self._check_within(heartbeat)
                if not held and not self._stop.is_set():
                    self.lost = True
                    on_lost()
                    return

        self._watchdog = threading.Thread(
            target=run, name=f"advisory_lock:{self.label}", daemon=True
        )
        self._watchdog.start()

    def _check_within(self, seconds: float) -> bool:
        """Is the lock still held? False on an error, or on no answer within ``seconds``."""
        answer: list[bool] = []

        def check() -> None:
            try:
                with self._mutex:
                    answer.append(self.backend.is_held(self.db_key))
            except Exception:
                answer.append(False)

        checker = threading.Thread(
            target=check, name=f"advisory_lock:{self.label}:check", daemon=True
        )
        self._checker = checker
        checker.start()
        checker.join(seconds)
        return bool(answer and answer[0])

    def release(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join()
        held_for = monotonic() - (self.acquired_at or monotonic())
        try:
            if not self.lost:
                with self._mutex:
                    self.backend.release(self.db_key, shared=False)
                logger.info(
                    "%s: released lock %s after %.3fs.", self.label, self.key.label, held_for
                )
        except DatabaseError:
            logger.exception("%s: releasing lock %s failed.", self.label, self.key.label)
        finally:
            # Closing drops whatever the connection still holds; but a check still waiting
            # on a silent network owns the connection: it goes with the process.
            if self._checker is None or not self._checker.is_alive():
                self.connection.close()


def _describe_holder(holder: dict[str, Any]) -> str:
    parts = []
    for label, name in (("pid", "pid"), ("connection id", "connection_id")):
        if holder.get(name) is not None:
            parts.append(f"{label} {holder[name]}")
    if holder.get("application_name"):
        parts.append(f"application {holder['application_name']!r}")
    for name in ("client_addr", "host"):
        if holder.get(name):
            parts.append(f"from {holder[name]}")
    if holder.get("since") is not None:
        parts.append(f"since {holder['since']:%Y-%m-%d %H:%M:%S%z}")
    if holder.get("held_for") is not None:
        parts.append(f"{holder['held_for']:.0f}s ago")
    return ", ".join(parts)
