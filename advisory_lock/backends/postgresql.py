"""PostgreSQL advisory locks (``pg_advisory_lock`` and friends), through psycopg 3.

PostgreSQL keeps advisory locks per database and counts repeated holds by one session. It
releases transaction-level (xact) locks itself at the end of the top-level transaction, and
at ROLLBACK TO SAVEPOINT of a savepoint they were taken in; session locks when the session
ends. Keys are ints, written into the statements by us (nothing to escape).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import math
from typing import Any

from psycopg import errors
from psycopg.pq import TransactionStatus

from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import Listing
from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.backends.base import pooler_advice
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import LockKey

#: Aliases found behind a transaction-mode pooler (the server pid changed under one client
#: connection): session locks are refused there for the rest of the process's life.
POOLED_ALIASES: set[str] = set()


@functools.cache
def _function(
    *, try_: bool = False, xact: bool = False, shared: bool, unlock: bool = False
) -> str:
    if unlock:
        return "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock"
    return (
        f"pg_{'try_' if try_ else ''}advisory_{'xact_' if xact else ''}lock"
        f"{'_shared' if shared else ''}"
    )


def _select(function: str, arguments: str, *, pid: str | None) -> str:
    """``SELECT function(arguments)``. Session statements (``pid`` given, or ``""`` before
    the pid is known) also return ``pg_backend_pid()`` in the same round trip: a pid that
    changes under one client connection means a transaction-mode pooler (PgBouncer) moved us
    to another server connection. Once the pid is known they are *guarded*: they lock only
    on that server connection, so a pooler can't make us take a lock that nobody will
    release, or release someone else's."""
    call = f"{function}({arguments})"
    if pid is None:
        return f"SELECT {call}"
    if pid:
        call = f"CASE WHEN pg_backend_pid() = {pid} THEN {call} END"
    return f"SELECT {call}, pg_backend_pid()"


@functools.cache
def _prepared(function: str, pair: bool, guarded: bool) -> tuple[bytes, bytes, bytes]:
    """(name, PREPARE statement, EXECUTE template with a ``%d`` per value) of a session
    statement. The name is the text's hash: one name means one statement on any server."""
    arguments = "$2, $3" if pair and guarded else "$1, $2" if pair else "$2" if guarded else "$1"
    select = _select(function, arguments, pid="$1" if guarded else "")
    types = ["integer"] * guarded + (["integer", "integer"] if pair else ["bigint"])
    name = f"advisory_lock_{hashlib.sha256(select.encode()).hexdigest()[:16]}"
    execute = f"EXECUTE {name}({','.join(['%d'] * len(types))})"
    return (
        name.encode(),
        f"PREPARE {name} ({', '.join(types)}) AS {select}".encode(),
        execute.encode(),
    )


class PostgreSQLBackend(LockBackend):
    vendor = "postgresql"
    native_transaction_locks = True
    max_timeout = (2**31 - 1) / 1000  # lock_timeout is a 32-bit number of milliseconds

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        # What we know of the driver connection we last ran on (forgotten when it changes).
        self._raw: Any = None
        self._cursor: Any = None
        self._pid: int | None = None  # its server pid, once a session statement told us
        self._prepared: set[bytes] = set()  # statements PREPARE'd on its server session

    def db_key(self, key: LockKey) -> int | tuple[int, int]:
        return key.as_int64()

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        keys = db_key if type(db_key) is tuple else (db_key,)
        try:
            if transaction:  # one statement: the server releases it with the transaction
                function = _function(try_=timeout == 0, xact=True, shared=shared)
                row = self._wait(_select(function, _args(keys), pid=None), timeout)
                return row is not None and row[0] is not False
            if timeout == 0 or timeout is None:
                # One statement, busy or not: a try, or a wait in the server until it is free.
                row = self._session_statement(_function(try_=timeout == 0, shared=shared), keys)
            else:
                self._driver_cursor()  # first: the guard's pid must be the current session's
                function = _function(shared=shared)
                row = self._wait(_select(function, _args(keys), pid=self._guard()), timeout)
        except errors.LockNotAvailable:
            return False  # lock_timeout (ours, or one set on the server) ran out: 55P03
        return row is not None and self._held_on_same_server(row)

    def release(self, db_key: Any, *, shared: bool) -> bool:
        keys = db_key if type(db_key) is tuple else (db_key,)
        released, pid = self._session_statement(_function(unlock=True, shared=shared), keys)
        expected = self._pid
        if not self._same_server(pid):
            raise LockLost(
                f"The lock was taken on server pid {expected} of {self.describe()}, and the "
                f"release reached pid {pid}: a transaction-mode pooler (PgBouncer) is in "
                f"between. The lock stays held by pid {expected} until that server "
                f"connection closes. {pooler_advice(self.connection.alias)}"
            )
        return bool(released)

    def is_held(self, db_key: Any) -> bool:
        classid, objid, objsubid = lock_row_ids(db_key)
        return bool(
            self._run(
                f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} "
                f"AND l.pid = pg_backend_pid())".format(classid, objid, objsubid).encode()
            )[0]
        )

    def transaction_aborted(self) -> bool:
        raw = self.connection.connection
        return raw is not None and raw.info.transaction_status == TransactionStatus.INERROR

    def session_lock_problem(self) -> str | None:
        if self.connection.alias in POOLED_ALIASES:
            return (
                f"Session-scoped locks can't work on {self.describe()}: a transaction-mode "
                f"pooler was detected in front of it (the server pid changed under one "
                f"client connection). {pooler_advice(self.connection.alias)}"
            )
        return super().session_lock_problem()

    @classmethod
    def pool_problem(cls, settings_dict: dict[str, Any]) -> str | None:
        pool = settings_dict.get("OPTIONS", {}).get("pool")
        if not pool or (isinstance(pool, dict) and pool.get("reset") is reset_pooled_connection):
            return None
        return (
            "Django's PostgreSQL connection pool hands a connection to the next borrower with "
            "whatever advisory session locks the last one left on it."
        )

    @classmethod
    def dedicated_settings(cls, settings_dict: dict[str, Any], label: str) -> dict[str, Any]:
        settings_dict = super().dedicated_settings(settings_dict, label)
        options = settings_dict.setdefault("OPTIONS", {})
        options.pop("pool", None)  # a lock's own connection never goes back to a pool
        # Shown in pg_stat_activity, so that "who holds it" answers with a name.
        options["application_name"] = label[:63]
        return settings_dict

    # Statements.

    def _session_statement(self, function: str, keys: tuple[int, ...]) -> tuple[Any, ...]:
        """A session try or unlock: prepared outside transactions (parsed and planned once
        per server session, which makes it cheaper than a plain statement); plain inside
        one, where a failed EXECUTE would abort the caller's transaction."""
        self._driver_cursor()  # first: what we know of the server session must be current
        if not self._outside_transaction():
            return self._run(_select(function, _args(keys), pid=self._guard()).encode())
        pid = self._pid
        name, prepare, template = _prepared(function, len(keys) == 2, pid is not None)
        execute = template % (keys if pid is None else (pid, *keys))
        if name in self._prepared:
            try:
                return self._run(execute)
            except errors.InvalidSqlStatementName:
                # DEALLOCATE or DISCARD ran, or a pooler moved us to another server
                # connection: run it plain, so that the pid tells which.
                self._prepared.clear()
                return self._run(_select(function, _args(keys), pid=self._guard()).encode())
        try:
            row = self._run(prepare + b"; " + execute, after_first=True)
        except errors.DuplicatePreparedStatement:
            # Prepared on this server session by an earlier client (a pooled connection):
            # one name stands for one statement text, so it is this one.
            row = self._run(execute)
        self._prepared.add(name)
        return row

    def _wait(self, select: str, timeout: float | None) -> tuple[Any, ...] | None:
        """Run a lock statement that may wait: for ever, or at most ``timeout`` seconds
        (then None)."""
        if timeout is None or timeout == 0:
            return self._run(select.encode())
        # lock_timeout is in milliseconds, and 0 would mean "no limit".
        milliseconds = max(1, math.ceil(timeout * 1000))
        call = select.removeprefix("SELECT ")
        if self._outside_transaction():
            # set_config(..., true) lasts for this statement's own transaction. The sub-select
            # holds a volatile function, so the planner runs it first, not pulled up.
            return self._run(
                f"SELECT {call} FROM (SELECT set_config('lock_timeout', '{milliseconds}', "
                f"true)) AS _t".encode()
            )
        # In a transaction a lock_timeout error would abort it: wait in a savepoint, and
        # restore the previous lock_timeout in the same statement (a released savepoint
        # keeps SET LOCAL values).
        self._run(b"SAVEPOINT advisory_lock_wait", fetch=False)
        try:
            row: tuple[Any, ...] | None = self._run(
                f"SELECT {call}, set_config('lock_timeout', _t.previous, true) FROM "
                f"(SELECT current_setting('lock_timeout') AS previous, "
                f"set_config('lock_timeout', '{milliseconds}', true)) AS _t".encode()
            )
        except errors.LockNotAvailable:
            self._run(b"ROLLBACK TO SAVEPOINT advisory_lock_wait", fetch=False)
            row = None
        self._run(b"RELEASE SAVEPOINT advisory_lock_wait", fetch=False)
        return row

    def _run(
        self, sql: bytes, *, fetch: bool = True, after_first: bool = False
    ) -> tuple[Any, ...]:
        """Run one statement (``after_first``: two, and read the second's result); return
        the first row. Driver errors come out as Django's, as from Django's cursor, except
        the ones the lock expects (a timeout, a missing or duplicate prepared statement)."""
        connection = self.connection
        try:
            if connection.queries_logged or connection.execute_wrappers:
                with connection.cursor() as cursor:
                    return _fetch(cursor, sql.decode(), fetch, after_first)
            return _fetch(self._driver_cursor(), sql, fetch, after_first)
        except Exception as exc:
            # Django's cursor raises Django's exception with the driver's as its cause.
            error = exc.__cause__ if isinstance(exc.__cause__, errors.Error) else exc
            if isinstance(error, _EXPECTED):
                raise error from None
            if isinstance(error, errors.OutOfMemory):
                raise AdvisoryLockError(
                    f"PostgreSQL's lock table is full on {self.describe()} ({error}). Each "
                    f"advisory lock takes a slot; the table has max_locks_per_transaction x "
                    f"(max_connections + max_prepared_transactions) slots. Release locks "
                    f"you no longer need, or raise max_locks_per_transaction."
                ) from error
            if error is exc and isinstance(exc, errors.Error):
                with connection.wrap_database_errors:
                    raise
            raise

    def _driver_cursor(self) -> Any:
        """A cursor of the driver connection, connecting if need be; kept while it is the
        same connection, and what we knew of an earlier one forgotten."""
        connection = self.connection
        raw = connection.connection
        if raw is None:
            connection.ensure_connection()
            raw = connection.connection
        if raw is not self._raw:
            self._raw, self._cursor, self._pid, self._prepared = raw, raw.cursor(), None, set()
        return self._cursor

    def _outside_transaction(self) -> bool:
        """No transaction is open. Django manages the transactions: outside ``atomic``, on a
        driver connection in autocommit, there is none (cheaper to read than the driver's
        transaction status)."""
        return not self.connection.in_atomic_block and self._driver_cursor().connection.autocommit

    def _guard(self) -> str:
        return "" if self._pid is None else str(self._pid)

    def _same_server(self, pid: int) -> bool:
        """Note the server pid a session statement ran on; False if it moved (a pooler)."""
        if self._pid is None or pid == self._pid:
            self._pid = pid
            return True
        POOLED_ALIASES.add(self.connection.alias)
        return False

    def _held_on_same_server(self, row: tuple[Any, ...]) -> bool:
        if not self._same_server(row[1]):
            # The guard kept the statement from locking anything on that other connection.
            raise NotSupportedError(self.session_lock_problem())
        return row[0] is not False


def _args(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values))


def _fetch(cursor: Any, sql: bytes | str, fetch: bool, after_first: bool) -> tuple[Any, ...]:
    cursor.execute(sql)
    if after_first:
        cursor.nextset()
    return cursor.fetchone() if fetch else ()


# Errors that are outcomes the backend handles, not failures.
_EXPECTED = (
    errors.LockNotAvailable,  # lock_timeout ran out
    errors.InvalidSqlStatementName,  # our prepared statement is not on this server session
    errors.DuplicatePreparedStatement,  # it is already there
)


# pg_locks shows a bigint key as classid (high 32 bits) and objid (low), objsubid 1; an int
# pair as classid, objid, objsubid 2.
_LOCK_ROW = (
    "l.locktype = 'advisory' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid = {0}::bigint::oid AND l.objid = {1}::bigint::oid AND l.objsubid = {2}"
)


def _signed32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def key_from_lock_row(classid: int, objid: int, objsubid: int) -> int | tuple[int, int]:
    """The advisory key of a pg_locks row (the inverse of ``lock_row_ids``)."""
    if objsubid == 2:
        return _signed32(classid), _signed32(objid)
    value = (classid << 32) | objid
    return value - 2**64 if value >= 2**63 else value


def lock_row_ids(db_key: int | tuple[int, int]) -> tuple[int, int, int]:
    """(classid, objid, objsubid) of ``db_key`` in pg_locks."""
    if isinstance(db_key, tuple):
        return db_key[0] & 0xFFFFFFFF, db_key[1] & 0xFFFFFFFF, 2
    return (db_key >> 32) & 0xFFFFFFFF, db_key & 0xFFFFFFFF, 1


_ACTIVITY = (
    "a.pid, a.usename, a.application_name, host(a.client_addr), a.backend_start, "
    "a.xact_start, a.state, a.query"
)
_LIST_SQL = (
    f"SELECT l.classid, l.objid, l.objsubid, l.mode, l.granted, l.pid, {_ACTIVITY}, "
    "EXTRACT(EPOCH FROM now() - COALESCE(a.xact_start, a.backend_start)), "
    "EXTRACT(EPOCH FROM now() - (to_jsonb(l) ->> 'waitstart')::timestamptz) "
    "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "ORDER BY l.granted DESC, l.pid"
)


class PostgreSQLInspector(LockInspector):
    def holder(self, db_key: Any) -> Holder | None:
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"SELECT {_ACTIVITY} FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                f"WHERE {_LOCK_ROW.format('%s', '%s', '%s')} LIMIT 1",
                lock_row_ids(db_key),
            )
            row = cursor.fetchone()
        return None if row is None else _holder(row)

    def list_locks(self, known: dict[Any, str]) -> Listing:
        with self.connection.cursor() as cursor:
            cursor.execute(_LIST_SQL)
            rows = cursor.fetchall()
        locks = []
        for classid, objid, objsubid, mode, granted, pid, *activity in rows:
            held_for, waited_for = activity[8:]
            locks.append(
                LockRow(
                    db_key=key_from_lock_row(classid, objid, objsubid),
                    mode="shared" if mode == "ShareLock" else "exclusive",
                    granted=granted,
                    holder=(
                        _holder(activity[:8])
                        if activity[0] is not None
                        else Holder(pid, "pid")
                        if pid is not None
                        else None
                    ),
                    # PostgreSQL does not record when a lock was granted: this is the time
                    # since the holder's transaction (else session) started, an upper bound.
                    held_for=float(held_for) if granted and held_for is not None else None,
                    waited_for=float(waited_for) if waited_for is not None else None,
                )
            )
        return Listing("pg_locks", locks)

    def terminate(self, holder_id: int) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [holder_id])

    def database_now(self) -> datetime.datetime:
        now: datetime.datetime
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT statement_timestamp()")
            (now,) = cursor.fetchone()
        return now.astimezone(datetime.timezone.utc)


def _holder(row: Any) -> Holder:
    pid, user, application, client, backend_start, xact_start, state, query = row
    return Holder(
        id=pid,
        kind="pid",
        user=user,
        application_name=application,
        client_addr=client or "local socket",
        since=backend_start,
        transaction_start=xact_start,
        state=state,
        query=query,
    )


def reset_pooled_connection(connection: Any) -> None:
    """``OPTIONS["pool"]["reset"]`` for Django's PostgreSQL pool: drop every advisory lock
    a borrower left on a connection before the next borrower gets it."""
    connection.execute("SELECT pg_advisory_unlock_all()")
    if connection.info.transaction_status != TransactionStatus.IDLE:
        connection.rollback()
