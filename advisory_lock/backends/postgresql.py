"""PostgreSQL advisory locks (``pg_advisory_lock`` and friends), through psycopg 3.

PostgreSQL keeps advisory locks per database and counts repeated holds by one session. It
releases transaction-level (xact) locks itself at the end of the top-level transaction, and
at ROLLBACK TO SAVEPOINT of a savepoint they were taken in; session locks when the session
ends. Keys are ints, written into the statements by us (nothing to escape).

Statements that can't wait (a try, an unlock) run through libpq itself, psycopg's documented
``Connection.pgconn`` (``psycopg.pq``): one round trip, no cursor, no adaptation. Statements
that may wait run through a psycopg cursor, whose wait lets Python's signal handlers run
(Ctrl-C, SIGTERM, a watchdog), which a blocking libpq call would defer.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import math
from typing import Any
from typing import NoReturn

from psycopg import errors
from psycopg import pq

from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import Listing
from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.backends.base import pooler_advice
from advisory_lock.backends.base import replica_error
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import LockKey

#: Aliases found behind a transaction-mode pooler (the server pid changed under one client
#: connection): session locks are refused there for the rest of the process's life.
POOLED_ALIASES: set[str] = set()

_IDLE = pq.TransactionStatus.IDLE
_INERROR = pq.TransactionStatus.INERROR
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_BOOL_OID = 16
_INT4_OID = 23
_INT8_OID = 20


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
def _prepared(function: str, pair: bool, guarded: bool) -> tuple[bytes, bytes, list[int]]:
    """(name, statement with ``$n`` parameters, their type oids) of a session statement
    prepared on the server. The name is the text's hash: one name means one statement on any
    server session, so a name found already prepared there is this statement."""
    arguments = "$2, $3" if pair and guarded else "$1, $2" if pair else "$2" if guarded else "$1"
    select = _select(function, arguments, pid="$1" if guarded else "")
    name = f"advisory_lock_{hashlib.sha256(select.encode()).hexdigest()[:16]}"
    # The pid and the halves of a pair are integers; a single key is a bigint.
    types = [_INT4_OID] * guarded + ([_INT4_OID, _INT4_OID] if pair else [_INT8_OID])
    return name.encode(), select.encode(), types


class PostgreSQLBackend(LockBackend):
    vendor = "postgresql"
    native_transaction_locks = True
    max_timeout = (2**31 - 1) / 1000  # lock_timeout is a 32-bit number of milliseconds

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        # What we know of the driver connection we last ran on (forgotten when it changes).
        self._raw: Any = None
        self._pid: int | None = None  # its server pid, once a session statement told us
        self._prepared: set[bytes] = set()  # statements prepared on its server session

    def db_key(self, key: LockKey) -> int | tuple[int, int]:
        return key.as_int64()

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        keys = db_key if type(db_key) is tuple else (db_key,)
        try:
            if transaction:  # the server releases it with the transaction (or savepoint)
                function = _function(try_=True, xact=True, shared=shared)
                row = self._run(_select(function, _args(keys), pid=None).encode(), begin=True)
                if row[0] or timeout == 0:
                    return bool(row[0])
                function = _function(xact=True, shared=shared)
                wait_row = self._wait(_select(function, _args(keys), pid=None), timeout)
                return wait_row is not None
            row = self._session_statement(_function(try_=True, shared=shared), keys)
            if not self._held_on_same_server(row) and timeout != 0:
                function = _function(shared=shared)
                wait_row = self._wait(_select(function, _args(keys), pid=self._guard()), timeout)
                return wait_row is not None and self._held_on_same_server(wait_row)
        except errors.LockNotAvailable:
            return False  # lock_timeout (ours, or one set on the server) ran out: 55P03
        return row[0] is True

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
        return raw is not None and raw.pgconn.transaction_status == _INERROR

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
        """A session try or unlock. With no transaction open it runs as a statement prepared
        on the server session (parsed and planned once per session); inside a transaction
        it runs plain, since a failed prepared statement would abort the caller's
        transaction."""
        raw = self._driver_connection()  # first: what we know of the session must be current
        pid = self._pid
        if self._logged() or raw.pgconn.transaction_status != _IDLE:
            return self._run(_select(function, _args(keys), pid=self._guard()).encode())
        name, statement, types = _prepared(function, len(keys) == 2, pid is not None)
        values = [str(value).encode() for value in (keys if pid is None else (pid, *keys))]
        pgconn = raw.pgconn
        if name not in self._prepared:
            result = pgconn.prepare(name, statement, types)
            # 42P05: prepared on this server session by an earlier client (a pooled server
            # connection); one name stands for one statement text, so it is this one.
            if result.status != _COMMAND_OK and result.error_field(_SQLSTATE) != b"42P05":
                self._raise(result)
            self._prepared.add(name)
        result = pgconn.exec_prepared(name, values)
        if result.status == _TUPLES_OK:
            return _row(result)
        if result.error_field(_SQLSTATE) == b"26000":
            # DEALLOCATE or DISCARD ran, or a pooler moved us to another server connection:
            # run it plain, so that the pid tells which.
            self._prepared.clear()
            return self._run(_select(function, _args(keys), pid=self._guard()).encode())
        self._raise(result)

    def _wait(self, select: str, timeout: float | None) -> tuple[Any, ...] | None:
        """Run a lock statement that may wait, through a psycopg cursor (whose wait Python's
        signal handlers interrupt): for ever, or at most ``timeout`` seconds (then None)."""
        if timeout is None:
            return self._run(select.encode(), cursor=True)
        # lock_timeout is in milliseconds, and 0 would mean "no limit".
        milliseconds = max(1, math.ceil(timeout * 1000))
        call = select.removeprefix("SELECT ")
        if not self.connection.in_atomic_block:
            # set_config(..., true) lasts for this statement's own transaction. The sub-select
            # holds a volatile function, so the planner runs it first, not pulled up.
            return self._run(
                f"SELECT {call} FROM (SELECT set_config('lock_timeout', '{milliseconds}', "
                f"true)) AS _t".encode(),
                cursor=True,
            )
        # In a transaction a lock_timeout error would abort it: wait in a savepoint, and
        # restore the previous lock_timeout in the same statement (a released savepoint
        # keeps SET LOCAL values).
        self._run(b"SAVEPOINT advisory_lock_wait", cursor=True, fetch=False)
        try:
            row: tuple[Any, ...] | None = self._run(
                f"SELECT {call}, set_config('lock_timeout', _t.previous, true) FROM "
                f"(SELECT current_setting('lock_timeout') AS previous, "
                f"set_config('lock_timeout', '{milliseconds}', true)) AS _t".encode(),
                cursor=True,
            )
        except errors.LockNotAvailable:
            self._run(b"ROLLBACK TO SAVEPOINT advisory_lock_wait", cursor=True, fetch=False)
            row = None
        self._run(b"RELEASE SAVEPOINT advisory_lock_wait", cursor=True, fetch=False)
        return row

    def _run(
        self, sql: bytes, *, cursor: bool = False, fetch: bool = True, begin: bool = False
    ) -> tuple[Any, ...]:
        """Run one statement and return its first row.

        Through Django's cursor when Django logs queries or wraps executions (so that
        ``connection.queries``, ``CaptureQueriesContext`` and ``execute_wrapper()`` see it);
        else through a psycopg cursor when it may wait (``cursor``), or libpq. ``begin``: the
        statement belongs to the transaction of the ``atomic`` block, which psycopg opens
        lazily, at its first statement: if none was sent yet, open it the way psycopg would.
        Errors come out as ``_failed`` says.
        """
        connection = self.connection
        raw = self._driver_connection()
        try:
            if self._logged():
                with connection.cursor() as django_cursor:
                    return _fetch(django_cursor, sql.decode(), fetch)
            if cursor:
                return _fetch(raw.cursor(), sql, fetch)
            pgconn = raw.pgconn
            if begin and pgconn.transaction_status == _IDLE and connection.in_atomic_block:
                start = _begin(raw)
                if start is None:  # options psycopg adds to BEGIN: let psycopg open it
                    return _fetch(raw.cursor(), sql, fetch)
                sql = start + b"; " + sql
            result = pgconn.exec_(sql)
            if result.status == _TUPLES_OK:
                return _row(result)
            if result.status == _COMMAND_OK:
                return ()
            self._raise(result)
        except Exception as exc:
            self._failed(exc)

    def _raise(self, result: Any) -> NoReturn:
        """Raise psycopg's exception for a failed libpq result (as ``_failed`` words it)."""
        message = (result.error_message or b"").decode(errors="replace").strip()
        sqlstate = result.error_field(_SQLSTATE)
        error_class: type[errors.Error] = errors.OperationalError  # none: the link failed
        if sqlstate is not None:
            try:
                error_class = errors.lookup(sqlstate.decode())
            except KeyError:
                error_class = errors.DatabaseError
        self._failed(error_class(message))

    def _failed(self, error: BaseException) -> NoReturn:
        """Raise ``error`` as the lock's caller should see it: Django's exception with the
        driver's as its cause, as from Django's cursor, except the errors the lock expects
        (a timeout, a missing or duplicate prepared statement), which stay the driver's."""
        driver_error = error.__cause__ if isinstance(error.__cause__, errors.Error) else error
        if isinstance(driver_error, _EXPECTED):
            raise driver_error from None
        if isinstance(driver_error, errors.OutOfMemory):
            raise AdvisoryLockError(
                f"PostgreSQL's lock table is full on {self.describe()} ({driver_error}). Each "
                f"advisory lock takes a slot; the table has max_locks_per_transaction x "
                f"(max_connections + max_prepared_transactions) slots. Release locks "
                f"you no longer need, or raise max_locks_per_transaction."
            ) from driver_error
        if driver_error is error and isinstance(error, errors.Error):
            with self.connection.wrap_database_errors:
                raise error
        raise error

    def _logged(self) -> bool:
        """Django logs queries or wraps executions, and a statement through its cursor can't
        open a transaction that Django does not expect: outside ``atomic`` with the driver's
        autocommit off, Django is between a rollback and restoring autocommit (a release at
        a rollback), and psycopg's cursor would open a transaction there."""
        connection = self.connection
        if not (connection.queries_logged or connection.execute_wrappers):
            return False
        return connection.in_atomic_block or bool(connection.connection.autocommit)

    def _driver_connection(self) -> Any:
        """The psycopg connection, connecting if need be; what we knew of an earlier one is
        forgotten, and a new one is checked once not to be a standby."""
        connection = self.connection
        raw = connection.connection
        if raw is None:
            connection.ensure_connection()
            raw = connection.connection
        if raw is not self._raw:
            self._raw, self._pid, self._prepared = raw, None, set()
            result = raw.pgconn.exec_(b"SELECT pg_is_in_recovery()")
            if result.status != _TUPLES_OK:
                self._raw = None
                self._raise(result)
            if result.get_value(0, 0) == b"t":
                self._raw = None
                raise replica_error(self.describe(), "is a standby (pg_is_in_recovery())")
        return raw

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
        return row[0] is not False  # a wait returns void (None), a try a boolean


def _begin(raw: Any) -> bytes | None:
    """The BEGIN psycopg sends for ``raw``: plain, or None when it adds options (an isolation
    level, read only, deferrable) that we leave psycopg to write."""
    if raw.isolation_level is None and raw.read_only is None and raw.deferrable is None:
        return b"BEGIN"
    return None


def _args(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values))


def _row(result: Any) -> tuple[Any, ...]:
    """The first row of a libpq result of our statements, whose columns are booleans or
    integers (a NULL is None)."""
    if not result.ntuples:
        return ()
    row: list[Any] = []
    for column in range(result.nfields):
        value = result.get_value(0, column)
        if value is None:
            row.append(None)
        elif result.ftype(column) == _BOOL_OID:
            row.append(value == b"t")
        else:
            row.append(int(value))
    return tuple(row)


def _fetch(cursor: Any, sql: bytes | str, fetch: bool) -> tuple[Any, ...]:
    cursor.execute(sql)
    return tuple(cursor.fetchone()) if fetch else ()


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
    if connection.info.transaction_status != _IDLE:
        connection.rollback()
