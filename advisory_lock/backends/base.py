"""The interface every database backend implements, and the statement runner they share."""

from __future__ import annotations

import contextlib
import copy
import datetime
import time
import weakref
from collections.abc import Callable
from typing import Any
from typing import ClassVar

from django.conf import settings
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.conf import get_setting
from advisory_lock.keys import LockKey


class LockBackend:
    """Takes and releases advisory locks on one Django connection (one alias, one thread).

    ``timeout`` is ``None`` to wait for ever, ``0`` to try once, or a bound in seconds.
    Backends run their SQL on the driver's connection, not through Django's cursor wrapper
    (which costs as much as a round trip), and log it to ``connection.queries_log`` exactly
    as Django's debug cursor does, so ``CaptureQueriesContext`` and the debug toolbar see it.
    """

    vendor: ClassVar[str]
    #: The database has shared (reader) locks.
    supports_shared: ClassVar[bool] = True
    #: The database releases locks itself when the transaction ends (PostgreSQL's xact locks).
    native_transaction_scope: ClassVar[bool] = False
    #: Locks only coordinate processes on this host (SQLite's file locks).
    single_host: ClassVar[bool] = False

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        # The driver connection we last ran on, weakly: a connection that Django closed or
        # returned to a pool must not be kept open by us (_no_connection before the first).
        self._raw_ref: Callable[[], Any] = _no_connection
        #: Session locks taken through advisory_lock() and not yet released: db_key -> holds.
        self.session_holds: dict[Any, int] = {}

    # The interface.

    def db_key(self, key: LockKey) -> Any:
        """What the database sees for ``key``: an int, an int pair, a name or a path."""
        raise NotImplementedError

    def acquire(
        self, db_key: Any, *, shared: bool, transaction: bool, timeout: float | None
    ) -> bool:
        """Take the lock; return False if it is busy (try once) or the bounded wait ran out."""
        raise NotImplementedError

    def release(self, db_key: Any, *, shared: bool, after_rollback: bool = False) -> bool:
        """Release one hold of a session lock; return False if this holder did not hold it.

        ``after_rollback`` is set when the release runs while Django is rolling the
        transaction back (a release deferred because the transaction had failed).
        """
        raise NotImplementedError

    def display_key(self, db_key: Any) -> str:
        """``db_key`` as people read it (SQLite: the file name, not its folder)."""
        return str(db_key)

    def release_all(self) -> None:
        """Release every session lock this holder has (the end-of-request safety net)."""
        raise NotImplementedError

    def discard_connection(self) -> None:
        """Close the driver connection for good (never back to a pool), then Django's."""
        raw = self.connection.connection
        # Closing a broken connection may fail; it is gone either way.
        with contextlib.suppress(Exception):
            if raw is not None:
                raw.close()  # first, so that a pool discards it instead of lending it again
        with contextlib.suppress(DatabaseError):
            self.connection.close()
        self.session_holds.clear()

    def new_driver_connection(self) -> None:
        """Statements now run on another driver connection: what we knew of the last is void
        (its session locks died with it, or its pool's reset dropped them)."""
        self.session_holds.clear()

    def holder_token(self) -> object:
        """The object whose life bounds a session lock: the driver connection by default."""
        return self.connection.connection

    def transaction_is_aborted(self) -> bool:
        """True when the database refuses statements until the transaction is rolled back."""
        return False

    def is_held(self, db_key: Any) -> bool:
        """True if this holder still holds the lock: the watchdog's one-statement check."""
        raise NotImplementedError

    def holder(self, db_key: Any) -> dict[str, Any] | None:
        """Who holds the lock, as far as the database can tell (None if nobody or unknown)."""
        return None

    def database_now(self) -> datetime.datetime:
        """The database server's clock (aware, UTC), so that skewed app hosts agree."""
        raise NotImplementedError

    def list_locks(self, names: dict[Any, str]) -> tuple[str, str, list[dict[str, Any]]]:
        """Advisory locks held and awaited on this database: (source, note, rows).

        ``names`` maps db keys to lock names, for backends that can only look names up. Each
        row has ``db_key``, ``mode``, ``granted`` and what the database tells of the holder.
        """
        raise NotImplementedError

    def terminate(self, holder_id: int) -> None:
        """End the holder's connection (pg_terminate_backend / KILL), which frees its locks."""
        raise NotImplementedError

    def cluster_problem(self) -> str | None:
        """Why locks can't work on this server across a cluster's nodes (asks the server)."""
        return None

    def exact_collation(self) -> str | None:
        """A collation that compares text exactly, for columns whose default does not."""
        return None

    @classmethod
    def pool_problem(cls, settings_dict: dict[str, Any]) -> str | None:
        """Why a connection pool configured in ``settings_dict`` could leak locks, or None."""
        return None

    @classmethod
    def dedicated_settings(cls, settings_dict: dict[str, Any], label: str) -> dict[str, Any]:
        """Settings for a connection opened for one lock only (outside any pool)."""
        return copy.deepcopy(settings_dict)

    def session_lock_problem(self) -> str | None:
        """Why session locks can't work on this alias (a transaction pooler), or None."""
        pool_modes = get_setting("POOL_MODE")
        if pool_modes and pool_modes.get(alias := self.connection.alias) == "transaction":
            return (
                f"Session-scoped locks can't work on {self.describe()}: "
                f"ADVISORY_LOCK['POOL_MODE'] declares it behind a transaction-mode pooler. "
                f"{pooler_advice(alias)}"
            )
        return None

    def describe(self) -> str:
        """Name the database for messages: alias and vendor."""
        return f"database {self.connection.alias!r} ({self.vendor})"

    # Shared helpers.

    def run(
        self, sql: str, params: tuple[Any, ...], *, fetch: bool = True
    ) -> tuple[Any, ...] | None:
        """Execute one statement on the driver connection; return its first row if ``fetch``.

        ``fetch`` is told, not found out: psycopg's ``cursor.description`` costs as much as
        a third of a round trip.
        """
        connection = self.connection
        raw = self.driver_connection()
        try:
            # Cached on the driver connection, so that it lives exactly as long.
            cursor = raw._advisory_lock_cursor
        except AttributeError:
            cursor = raw._advisory_lock_cursor = raw.cursor()
        if not queries_logged(connection):
            cursor.execute(sql, params)
            return cursor.fetchone() if fetch else None
        start = time.monotonic()
        try:
            cursor.execute(sql, params)
            return cursor.fetchone() if fetch else None
        finally:
            self.log_query(connection.ops.last_executed_query(cursor, sql, params), start)

    def driver_connection(self) -> Any:
        """The driver connection, connected; noting when it is not the one we last used."""
        connection = self.connection
        if connection.connection is None:
            connection.ensure_connection()
        raw = connection.connection
        if self._raw_ref() is not raw:
            self._raw_ref = weakref.ref(raw)
            self.new_driver_connection()
        return raw

    def log_query(self, sql: str, start: float) -> None:
        """Log a statement as Django's debug cursor does (for CaptureQueriesContext)."""
        duration = time.monotonic() - start
        self.connection.queries_log.append({"sql": sql, "time": f"{duration:.3f}"})


# The settings that django.conf.settings has read: it keeps each in its instance dict (where
# attribute lookup finds it first) and drops it there when the setting is assigned, deleted
# or overridden. Read directly, not through LazyObject.__getattribute__, a Python-level call.
_settings_read = object.__getattribute__(settings, "__dict__")


def _no_connection() -> None:
    """What ``LockBackend._raw_ref`` returns before any driver connection was used."""
    return None


def queries_logged(connection: BaseDatabaseWrapper) -> bool:
    """``connection.queries_logged`` (force_debug_cursor or DEBUG), read at a fifth of the cost:
    it is asked before every lock statement, and DEBUG through LazySettings was a tenth of a
    lock's whole Python work (more with the cold caches of many processes on one CPU)."""
    if connection.force_debug_cursor:
        return True
    try:
        return _settings_read["DEBUG"]
    except KeyError:  # not read since it last changed: the slow path reads and keeps it
        return settings.DEBUG


def pooler_advice(alias: str) -> str:
    """The two ways out for session locks behind a transaction-mode pooler."""
    return (
        f"A transaction pooler runs each transaction on any server connection, so a session "
        f"lock is taken on one and released on another. Either take the lock inside "
        f"transaction.atomic(using={alias!r}) (transaction scope works behind the pooler), or "
        f"lock through an alias that connects to the database directly: "
        f"ADVISORY_LOCK['DIRECT_ALIAS'] = {{{alias!r}: '<direct alias>'}} "
        f"(@single_instance and the ledger use it), or using='<direct alias>'."
    )
