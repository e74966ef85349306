"""The two interfaces each database implements: locking (``LockBackend``) and inspection
(``LockInspector``), and the typed rows inspection returns."""

from __future__ import annotations

import contextlib
import copy
import datetime
import weakref
from collections.abc import Hashable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import ClassVar

from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.conf import get_setting
from advisory_lock.exceptions import ReplicaError
from advisory_lock.keys import LockKey

#: Waits without a try first, for a key busy at its last try, before trying again.
CONTENDED_WAITS = 16


#: At most this many holds of one key to release after an interrupted wait (one is expected).
MAX_UNDONE_HOLDS = 64


class LockBackend:
    """Takes and releases advisory locks on one Django connection (one alias, one thread).

    One instance per Django connection object, which it refers to weakly: it is kept in a
    registry keyed by that object, and goes when Django drops the object. ``timeout`` is
    ``None`` to wait for ever, ``0`` to try once, or a bound in seconds. Statements run on
    the driver connection through the driver's own cursor (Django's wrapper costs as much as
    a round trip) unless Django logs queries or the connection has execute wrappers: then
    they go through Django's cursor, so ``connection.queries``, ``CaptureQueriesContext`` and
    ``execute_wrapper()`` see them as they see Django's own.
    """

    vendor: ClassVar[str]
    #: The database has shared (reader) locks.
    supports_shared: ClassVar[bool] = True
    #: The database releases locks taken in a transaction itself when it ends.
    native_transaction_locks: ClassVar[bool] = False
    #: Locks coordinate processes of this host only (SQLite's file locks).
    single_host: ClassVar[bool] = False
    #: The locks are this process's own (files): ``is_held`` answers from any thread,
    #: without a statement, and there is no server session to ask about.
    local_locks: ClassVar[bool] = False
    #: The database delivers notifications between sessions (``notify``, ``listener``).
    notifications: ClassVar[bool] = False
    #: An async waiter can wait for a release inside the server (``release_wait``).
    waits_in_server: ClassVar[bool] = False
    #: The longest bounded wait the database accepts, in seconds (None: any finite one).
    max_timeout: ClassVar[float | None] = None

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection: BaseDatabaseWrapper = weakref.proxy(connection)
        self._alias: str = connection.alias  # a connection object's alias never changes
        # Keys whose last try here found them busy, with how many waits remain before the
        # next try. A wait tries first (a try never blocks, and most locks are free); for a
        # contended key it goes straight to the waiting statement, one round trip per
        # acquisition instead of two, and tries again every CONTENDED_WAITS acquisitions.
        self._contended: dict[Hashable, int] = {}
        #: The session (``session()``) whose client process the lock directory was told of
        #: (``advisory_lock.directory``).
        self.noted: object = None

    def wait_at_once(self, db_key: Hashable) -> bool:
        """True if ``db_key`` was busy at its last try: wait for it without trying first."""
        left = self._contended.get(db_key)
        if left is None:
            return False
        if left <= 1:
            del self._contended[db_key]
        else:
            self._contended[db_key] = left - 1
        return True

    def note_contention(self, db_key: Hashable, busy: bool) -> None:
        """Remember whether a try of ``db_key`` found it busy (a bounded memory)."""
        if not busy:
            self._contended.pop(db_key, None)
        elif len(self._contended) < 1024:
            self._contended[db_key] = CONTENDED_WAITS

    # The locking interface.

    def db_key(self, key: LockKey) -> Hashable:
        """What the database locks for ``key``: an int, an int pair, a name or a file name."""
        raise NotImplementedError

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        """Take the lock; False when a try finds it busy or a bounded wait runs out.

        ``transaction`` asks for a lock the database releases at the end of the current
        transaction (only when ``native_transaction_locks``).
        """
        raise NotImplementedError

    def release(self, db_key: Any, *, shared: bool) -> bool:
        """Release one hold of a session lock; False if this session did not hold it."""
        raise NotImplementedError

    def undo_interrupted_acquire(self, db_key: Any, *, shared: bool) -> None:
        """An exception raised by a signal handler (Ctrl-C, SIGTERM, a watchdog, a task
        queue's time limit) interrupted ``acquire()`` of a session lock that no hold of this
        connection has: the database may have granted it just before, unseen. Leave the
        session as if it had not been taken. The default does nothing: a backend whose
        grant is a local step with nothing in between has nothing to undo."""

    def release_every_hold(self, db_key: Any, *, shared: bool) -> None:
        """Release each of this session's holds of ``db_key`` (one release undoes one
        take), at most ``MAX_UNDONE_HOLDS``: for ``undo_interrupted_acquire()``."""
        for _ in range(MAX_UNDONE_HOLDS):
            if not self.is_held(db_key):
                return
            self.release(db_key, shared=shared)

    def is_held(self, db_key: Any) -> bool:
        """True if this session holds the lock now (asked by a dedicated lock's watchdog)."""
        raise NotImplementedError

    def server_session(self) -> Any:
        """What names this connection's session for a heartbeat to ask about from another
        connection (``held_by``): the id the server's lock table knows it by (PostgreSQL's
        backend pid, MySQL's connection id) and the server itself, whose ids another server
        (a failover's new primary) or a restarted one may give to another session. May run
        one statement."""
        raise NotImplementedError

    def held_by(self, db_key: Any, session: Any) -> bool:
        """Does the server session ``session`` (another connection's ``server_session()``)
        hold ``db_key`` now? One statement on this connection."""
        raise NotImplementedError

    def try_many(self, db_keys: list[Any]) -> list[bool]:
        """Try each of ``db_keys`` (distinct) as an exclusive session lock, without waiting:
        whether each was taken. The default tries them one by one; a backend whose database
        can try them all in one statement does (a scheduler's claims, see
        ``scheduling.claims``)."""
        return [self.acquire(key, shared=False, timeout=0, transaction=False) for key in db_keys]

    def release_many(self, db_keys: list[Any]) -> None:
        """Release one hold of each of ``db_keys``, session locks this session holds."""
        for key in db_keys:
            self.release(key, shared=False)

    def session_id(self) -> int | None:
        """The server's id of this connection's session (PostgreSQL's backend pid, MySQL's
        connection id) as the driver knows it, without a statement; None where there is no
        server session (SQLite) or no connection."""
        return None

    def session_socket(self) -> int | None:
        """The file descriptor of the socket this connection's statements travel on, as the
        driver gives it (no statement); None where statements cross no network (SQLite) or
        there is no open connection. Shutting the socket down (shutdown(2)) from another
        thread ends a statement waiting on it: its read returns at once (end of file), and
        the driver raises an error."""
        return None

    def session(self) -> object:
        """What a session lock lives as long as: the driver connection by default (the
        server drops its locks when it closes). A lock whose session changed is lost."""
        return self.connection.connection

    def end_session(self) -> None:
        """The connection is closed for good: let go of what only this object holds (the
        database itself drops a closed session's locks)."""

    def transaction_aborted(self) -> bool:
        """True when the database refuses statements until the transaction is rolled back."""
        return False

    def describe(self) -> str:
        """The database, for messages: alias and vendor."""
        return f"database {self.connection.alias!r} ({self.vendor})"

    def display_key(self, db_key: Any) -> str:
        """``db_key`` as people read it."""
        return str(db_key)

    @classmethod
    def is_outage(cls, error: BaseException) -> bool:
        """Does this driver's OperationalError mean the database is out of reach for now (a
        retry may succeed), not that the statement failed? PEP 249: by default, yes."""
        return True

    # Configuration, asked before any connection is made.

    def session_lock_problem(self) -> str | None:
        """Why session locks can't work on this alias (a transaction pooler), or None."""
        alias = self._alias
        if get_setting("POOL_MODE").get(alias) == "transaction":
            return (
                f"Session-scoped locks can't work on {self.describe()}: "
                f"ADVISORY_LOCK['POOL_MODE'] declares it behind a transaction-mode pooler. "
                f"{pooler_advice(alias)}"
            )
        return None

    @classmethod
    def pool_problem(cls, settings_dict: dict[str, Any]) -> str | None:
        """Why a connection pool configured in ``settings_dict`` could leak locks, or None."""
        return None

    @classmethod
    def dedicated_settings(cls, settings_dict: dict[str, Any], label: str) -> dict[str, Any]:
        """Settings for a connection opened for one lock only (never from a pool)."""
        return copy.deepcopy(settings_dict)

    @classmethod
    def notify(cls, connection: BaseDatabaseWrapper, channel: str, payload: str) -> None:
        """Send ``payload`` to the listeners of ``channel`` when the connection's current
        transaction commits (at once in autocommit); nothing where the database has no
        notifications."""

    @classmethod
    def listener(cls, connection: BaseDatabaseWrapper, channel: str) -> Listener | None:
        """A listener for ``channel`` on ``connection`` (a Django connection object of its
        own, not yet connected); None where the database has no notifications."""
        return None

    @classmethod
    def release_wait(cls, connection: BaseDatabaseWrapper) -> ReleaseWait | None:
        """A connection of its own (a Django connection object, not yet connected) on which
        an async waiter can wait inside the server for a lock's release; None if this
        database has no such wait (the waiter polls)."""
        return None


class Listener:
    """Receives the notifications of one channel on a connection of its own."""

    def open(self) -> None:
        """Connect and start listening: notifications sent from now on are received."""
        raise NotImplementedError

    def receive(self, timeout: float, also: Sequence[int] = ()) -> list[str]:
        """The payloads received within ``timeout`` seconds (none: an empty list, after the
        whole wait, or sooner once a file descriptor of ``also`` is readable); a
        ``DatabaseError`` if the connection is lost."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ReleaseWait:
    """Waits inside the database server, on a connection of its own, until a lock could be
    granted: the release itself ends the wait, whoever releases and however (a block's exit,
    a commit, a rollback, a closed session). The lock is not held when ``wait()`` returns.

    The waiters of several processes that wait this way may be served in the order they
    came (a line of the database's own); ``leave_line()`` lets the next one be served. Each
    method blocks its thread, one at a time, except ``interrupt()``, called from another
    thread while ``wait()`` runs, which makes it return early with an error; ``close()``
    closes the connection, whose server session then ends (and leaves any line).
    """

    def wait(self, db_key: Any, *, shared: bool, timeout: float | None) -> bool:
        """Wait at most ``timeout`` seconds (None: for as long as it takes); True once the
        lock could be granted in the mode asked for, False when the time ran out."""
        raise NotImplementedError

    def leave_line(self) -> None:
        """The waiter took the lock or stops waiting: the next in line may be served."""

    def interrupt(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


#: What a ``Holder``'s ``id`` is: an OS process of this host (SQLite's flock holder), the
#: PostgreSQL server process that serves the holder's session, or the MySQL/MariaDB server's
#: number for the holder's connection. Only the first is the holding program's process.
PROCESS_ID = "pid"
BACKEND_PID = "backend pid"
CONNECTION_ID = "connection id"
_SERVER_IDS = {BACKEND_PID: "PostgreSQL backend pid", CONNECTION_ID: "MySQL connection id"}


@dataclass(frozen=True, slots=True)
class Holder:
    """A session that holds or waits for a lock, as far as the database can tell."""

    #: PostgreSQL's backend pid, MySQL's connection id, or (SQLite) the process id.
    id: int
    #: What ``id`` is: ``PROCESS_ID``, ``BACKEND_PID`` or ``CONNECTION_ID``.
    kind: str
    user: str | None = None
    application_name: str | None = None
    client_addr: str | None = None
    host: str | None = None
    #: When the session (SQLite: the hold) started.
    since: datetime.datetime | None = None
    transaction_start: datetime.datetime | None = None
    state: str | None = None
    query: str | None = None
    #: The holding program's OS process id and host name, where the database can tell: the
    #: flock's process (SQLite), or what our dedicated connections write into their
    #: application_name (PostgreSQL). None for a holder that did not say (MySQL, psql).
    process_id: int | None = None
    process_host: str | None = None

    def describe(self) -> str:
        """One line for messages that tells the holder's OS process from the server's ids:
        "process 1234 on host web-3 (PostgreSQL backend pid 4821, from 10.0.3.7), since ...",
        "MySQL connection id 17 (the server's, not a process id), from 10.0.3.7:50114",
        "process 1234 on this host (web-3), since ..." (SQLite)."""
        if self.kind == PROCESS_ID:
            host = self.process_host or self.host
            parts = [f"process {self.id} on this host" + (f" ({host})" if host else "")]
        else:
            session = [f"{_SERVER_IDS.get(self.kind, self.kind)} {self.id}"]
            if self.process_id is None:
                session[0] += " (the server's, not a process id)"
                if self.application_name:
                    # Ours carry the process, said in full below; another program's name is
                    # all there is to tell who it is.
                    session.append(f"application {self.application_name!r}")
            if self.client_addr or self.host:
                session.append(f"from {self.client_addr or self.host}")
            if self.process_id is None:
                parts = session
            else:
                where = f"on host {self.process_host}" if self.process_host else "(host unknown)"
                parts = [f"process {self.process_id} {where} ({', '.join(session)})"]
        if self.since is not None:
            parts.append(f"since {self.since:%Y-%m-%d %H:%M:%S%z}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class LockRow:
    """One advisory lock held or awaited, as a database's lock table shows it."""

    db_key: Any
    mode: str  # "exclusive" or "shared"
    granted: bool
    holder: Holder | None
    #: Seconds held (an estimate where the database does not record it) or waited.
    held_for: float | None = None
    waited_for: float | None = None
    #: The key's name, where the database itself keeps it (SQLite's lock file).
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Listing:
    """The rows of a database's lock table, where they came from, and a caveat if any."""

    source: str
    rows: list[LockRow]
    note: str = ""


class LockInspector:
    """Reads what the server knows: who holds what, its clock, its cluster mode.

    Runs its queries through Django's cursor: inspection is not on the hot path.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection

    def holder(self, db_key: Any) -> Holder | None:
        """Who holds ``db_key`` now (None if nobody, or the database can't tell)."""
        return None

    def list_locks(self, known: dict[Any, str], names_table: str | None = None) -> Listing:
        """Every advisory lock held or awaited on this database. ``known`` maps db keys to
        names, and ``names_table`` (if given) is a table whose ``key`` column lists more of
        them (the lock directory's ``lock_names``), for databases that can only be asked
        about a name."""
        raise NotImplementedError

    def session_started(self, sessions: list[int] | None) -> dict[int, int]:
        """``{session id: when it began}`` for those of ``sessions`` (None: every session) that
        are connected now, in a unit of the database's: with its id, it tells a session from
        any other that had or will have the same id (see ``advisory_lock.lock_names``)."""
        return {}

    def may_terminate(self, holder_id: int) -> bool:
        """False for an id that must never be terminated, whatever it holds."""
        return holder_id > 0

    def terminate(self, holder_id: int) -> None:
        """End the session ``holder_id``, which frees its locks."""
        raise NotImplementedError

    def database_now(self) -> datetime.datetime:
        """The database server's clock (aware, UTC), so that skewed app hosts agree."""
        raise NotImplementedError

    def cluster_problem(self) -> str | None:
        """Why locks can't exclude across the nodes of this server's cluster, or None."""
        return None

    def writer_from_the_start(self, table: str) -> contextlib.AbstractContextManager[None]:
        """A block whose transaction writes before it reads, where a transaction that read
        first can't wait for the right to write (SQLite); ``table`` is a table it may name
        to do so (it changes no row). Elsewhere the block as it is: on PostgreSQL and MySQL
        a write waits for the rows it needs, whatever the transaction did before."""
        return contextlib.nullcontext()

    def exact_collation(self) -> str | None:
        """A collation that compares text exactly, for columns whose default does not."""
        return None

    def insert_returning_pk(
        self, cursor: Any, sql: str, params: Sequence[Any], pk_column: str
    ) -> int:
        """Run the single-row ``INSERT`` ``sql`` on ``cursor`` and return the new row's
        auto-increment primary key: PEP 249's ``lastrowid``, which MySQLdb and sqlite3 set
        to it (MySQL's ``LAST_INSERT_ID()``, SQLite's rowid, the alias of an ``INTEGER
        PRIMARY KEY``). ``pk_column``: the key's column, quoted."""
        cursor.execute(sql, params)
        return int(cursor.lastrowid)


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


def replica_error(database: str, what: str) -> ReplicaError:
    """The error for a lock asked of a replica: its locks would exclude nobody."""
    return ReplicaError(
        f"No lock is taken on {database}: it {what}. A replica grants advisory locks, but "
        f"they exclude nobody on the primary, so every instance would get the lock. Point "
        f"the alias the locks use at the primary (pass using=, or route it there)."
    )
