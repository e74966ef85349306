"""PostgreSQL advisory locks (``pg_advisory_lock`` and friends), through psycopg 3.

PostgreSQL keeps advisory locks per database, counts repeated holds by one session, and
releases transaction-level (xact) locks itself at the end of the top-level transaction, or at
ROLLBACK TO SAVEPOINT of the savepoint they were taken in.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from typing import Any

from psycopg import errors
from psycopg.pq import ExecStatus
from psycopg.pq import TransactionStatus

from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import pooler_advice
from advisory_lock.backends.base import queries_logged
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import LockKey


def _function(*, try_: bool, xact: bool, shared: bool) -> str:
    return (
        f"pg_{'try_' if try_ else ''}advisory_{'xact_' if xact else ''}lock"
        f"{'_shared' if shared else ''}"
    )


def _call(function: str, *, pair: bool, guarded: bool) -> str:
    call = f"{function}({'%s::integer, %s::integer' if pair else '%s::bigint'})"
    # Guarded: run only on the server connection we expect (its pid is the first parameter).
    return f"CASE WHEN pg_backend_pid() = %s THEN {call} END" if guarded else call


# (try, xact, shared, pair, guarded) → the statement. Built once from fixed names; keys are
# parameters. Session-lock statements also return pg_backend_pid(), in the same round trip:
# a server pid that changes under one client connection means a transaction-mode pooler
# (PgBouncer). Once the pid is known, they run only on that server connection, so a pooler
# that moved us can't make us take a lock nobody will release, or release someone else's.
_LOCK_SQL = {
    (try_, xact, shared, pair, guarded): (
        "SELECT "
        + _call(_function(try_=try_, xact=xact, shared=shared), pair=pair, guarded=guarded)
        + ("" if xact else ", pg_backend_pid()")
    )
    for try_ in (False, True)
    for xact in (False, True)
    for shared in (False, True)
    for pair in (False, True)
    for guarded in (False, True)
    if not (xact and guarded)
}
_UNLOCK_SQL = {
    (shared, pair, guarded): (
        "SELECT "
        + _call(
            "pg_advisory_unlock_shared" if shared else "pg_advisory_unlock",
            pair=pair,
            guarded=guarded,
        )
        + ", pg_backend_pid()"
    )
    for shared in (False, True)
    for pair in (False, True)
    for guarded in (False, True)
}


# The same try and unlock statements for libpq itself (PQexecParams): the fast path outside
# transactions, one round trip without psycopg's cursor machinery (see _exec_fast).
def _fast_sql(statement: str) -> bytes:
    numbered = statement
    for number in range(1, statement.count("%s") + 1):
        numbered = numbered.replace("%s", f"${number}", 1)
    return numbered.replace("::bigint", "").replace("::integer", "").encode()


_FAST_TRY_SQL = {
    (shared, pair, guarded): _fast_sql(_LOCK_SQL[True, False, shared, pair, guarded])
    for shared in (False, True)
    for pair in (False, True)
    for guarded in (False, True)
}
_FAST_UNLOCK_SQL = {variant: _fast_sql(sql) for variant, sql in _UNLOCK_SQL.items()}
# Prepared statement names: from the statement's text, so that a name means one statement on
# any server connection (a pooler may run ours on a connection another client prepared).
_STATEMENT_NAMES = {
    sql: b"advisory_lock_" + hashlib.sha256(sql).hexdigest()[:16].encode()
    for sql in (*_FAST_TRY_SQL.values(), *_FAST_UNLOCK_SQL.values())
}
# Prepared from their third run on a connection: a lock taken once per connection (a request
# on a new connection) does not pay the extra round trip that preparing costs.
_PREPARE_AFTER = 2
_SQLSTATE = 0x43  # PG_DIAG_SQLSTATE
_UNKNOWN_STATEMENT = b"26000"  # invalid_sql_statement_name: no such prepared statement
_DUPLICATE_STATEMENT = b"42P05"  # duplicate_prepared_statement
_INT8, _INT4 = 20, 23  # type oids of the parameters: a bigint key, or an int pair
# (pair, number of parameters) → their types: the key's, after the guard's pid if guarded.
_TYPES = {
    (False, 1): [_INT8],
    (False, 2): [_INT4, _INT8],
    (True, 2): [_INT4, _INT4],
    (True, 3): [_INT4, _INT4, _INT4],
}


def _outside_transaction(raw: Any) -> bool:
    """No transaction is open or pending: the fast path (libpq itself) may run a statement."""
    return raw.autocommit and raw.pgconn.transaction_status == TransactionStatus.IDLE


# A bounded wait in autocommit mode: set_config(..., true) lasts for this statement's own
# transaction only. The sub-select runs first: it holds a volatile function, so the planner
# can't pull it up into the outer query.
_BOUNDED_SQL = "SELECT {lock} FROM (SELECT set_config('lock_timeout', %s::text, true)) AS _t"
# Inside a transaction: restore the previous lock_timeout in the same statement, so the
# setting does not outlive the lock call (a released savepoint keeps SET LOCAL values).
_BOUNDED_IN_TRANSACTION_SQL = (
    "SELECT {lock}, set_config('lock_timeout', _t.previous, true) FROM "
    "(SELECT current_setting('lock_timeout') AS previous, "
    "set_config('lock_timeout', %s::text, true)) AS _t"
)
_BOUNDED = {k: _BOUNDED_SQL.format(lock=v.removeprefix("SELECT ")) for k, v in _LOCK_SQL.items()}
# Aliases on which a transaction-mode pooler was seen (the server pid changed), per process.
POOLED_ALIASES: set[str] = set()
_BOUNDED_IN_TRANSACTION = {
    k: _BOUNDED_IN_TRANSACTION_SQL.format(lock=v.removeprefix("SELECT "))
    for k, v in _LOCK_SQL.items()
}


# pg_locks shows a bigint key as classid (high 32 bits) and objid (low), objsubid 1; an int
# pair as classid, objid, objsubid 2.
_LOCK_ROW = (
    "l.locktype = 'advisory' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND l.classid = %s::bigint::oid AND l.objid = %s::bigint::oid AND l.objsubid = %s"
)
_IS_HELD_SQL = (
    f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} AND l.pid = pg_backend_pid())"
)
_HOLDER_SQL = (
    "SELECT a.pid, a.usename, a.application_name, host(a.client_addr), a.backend_start, "
    "a.xact_start, a.state, EXTRACT(EPOCH FROM now() - a.backend_start) "
    f"FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid WHERE {_LOCK_ROW} LIMIT 1"
)


_LIST_SQL = (
    "SELECT l.classid, l.objid, l.objsubid, l.mode, l.granted, l.pid, a.usename, "
    "a.application_name, host(a.client_addr), a.backend_start, a.xact_start, a.state, a.query, "
    "EXTRACT(EPOCH FROM now() - COALESCE(a.xact_start, a.backend_start)), "
    "EXTRACT(EPOCH FROM now() - (to_jsonb(l) ->> 'waitstart')::timestamptz) "
    "FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "ORDER BY l.granted DESC, l.pid"
)


def _signed32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def key_from_lock_row(classid: int, objid: int, objsubid: int) -> int | tuple[int, int]:
    """The advisory key of a pg_locks row (the inverse of lock_row_ids)."""
    if objsubid == 2:
        return _signed32(classid), _signed32(objid)
    value = (classid << 32) | objid
    return value - 2**64 if value >= 2**63 else value


def lock_row_ids(db_key: int | tuple[int, int]) -> tuple[int, int, int]:
    """(classid, objid, objsubid) of ``db_key`` in pg_locks."""
    if isinstance(db_key, tuple):
        return db_key[0] & 0xFFFFFFFF, db_key[1] & 0xFFFFFFFF, 2
    return (db_key >> 32) & 0xFFFFFFFF, db_key & 0xFFFFFFFF, 1


class PostgreSQLBackend(LockBackend):
    vendor = "postgresql"
    native_transaction_scope = True

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        # The server pid behind the current driver connection, once a statement told us.
        self._server_pid: int | None = None

    def new_driver_connection(self) -> None:
        super().new_driver_connection()
        self._server_pid = None

    def db_key(self, key: LockKey) -> int | tuple[int, int]:
        return key.as_int64()

    def acquire(
        self, db_key: Any, *, shared: bool, transaction: bool, timeout: float | None
    ) -> bool:
        raw = self.driver_connection()
        pair = type(db_key) is tuple
        params = db_key if pair else (db_key,)
        guarded = not transaction and self._server_pid is not None
        if guarded:
            params = (self._server_pid, *params)
        # Driver errors come out as Django's, as from a cursor; translated only when one is
        # raised (a `with wrap_database_errors` around the call costs two Python calls).
        try:
            if not transaction and _outside_transaction(raw):
                # Try first, through libpq: an uncontended lock costs one round trip
                # whatever the wait; only a busy one goes on to wait in the server.
                row = self._exec_fast(raw, _FAST_TRY_SQL[shared, pair, guarded], params, pair)
                if row[0] is False and timeout != 0:
                    row = self._wait((False, False, shared, pair, guarded), params, timeout)
            elif timeout == 0:
                row = self.run(_LOCK_SQL[True, transaction, shared, pair, guarded], params)
            else:
                row = self._wait((False, transaction, shared, pair, guarded), params, timeout)
        except errors.LockNotAvailable:
            # lock_timeout (ours, or one set on the server) ran out: SQLSTATE 55P03.
            return False
        except errors.OutOfMemory as exc:
            raise AdvisoryLockError(
                f"PostgreSQL's lock table is full on {self.describe()} ({exc}). Each "
                f"advisory lock takes a slot; the table has max_locks_per_transaction x "
                f"(max_connections + max_prepared_transactions) slots. Release locks you "
                f"no longer need, or raise max_locks_per_transaction."
            ) from exc
        except Exception:
            with self.connection.wrap_database_errors:
                raise
        if row is None:
            return False  # the bounded wait ran out
        if not transaction and not self._same_server(row[1]):
            # The guard kept the statement from locking anything on this other connection.
            raise NotSupportedError(self.session_lock_problem())
        return row[0] is not False

    def _wait(
        self, variant: tuple[bool, ...], params: tuple[Any, ...], timeout: float | None
    ) -> tuple[Any, ...] | None:
        """Wait in the server: for ever, or at most ``timeout`` (None if it ran out)."""
        if timeout is None:
            return self.run(_LOCK_SQL[variant], params)
        return self._bounded_wait(variant, params, timeout)

    def _bounded_wait(
        self, variant: tuple[bool, ...], params: tuple[Any, ...], timeout: float
    ) -> tuple[Any, ...] | None:
        """Wait at most ``timeout``; return the lock statement's row, or None if it ran out."""
        # lock_timeout is in milliseconds, and 0 would mean "no limit".
        lock_timeout = str(max(1, math.ceil(timeout * 1000)))
        if self.connection.connection.autocommit:
            return self.run(_BOUNDED[variant], (*params, lock_timeout))
        # In a transaction a lock_timeout error would abort it: wait inside a savepoint.
        self.run("SAVEPOINT advisory_lock_wait", (), fetch=False)
        try:
            row = self.run(_BOUNDED_IN_TRANSACTION[variant], (*params, lock_timeout))
        except errors.LockNotAvailable:
            self.run("ROLLBACK TO SAVEPOINT advisory_lock_wait", (), fetch=False)
            self.run("RELEASE SAVEPOINT advisory_lock_wait", (), fetch=False)
            return None
        self.run("RELEASE SAVEPOINT advisory_lock_wait", (), fetch=False)
        return row

    def release(self, db_key: Any, *, shared: bool, after_rollback: bool = False) -> bool:
        raw = self.driver_connection()
        pair = type(db_key) is tuple
        params = db_key if pair else (db_key,)
        guard = self._server_pid
        if guard is not None:
            params = (guard, *params)
        try:
            if _outside_transaction(raw):
                row = self._exec_fast(
                    raw, _FAST_UNLOCK_SQL[shared, pair, guard is not None], params, pair
                )
            else:
                row = self.run(_UNLOCK_SQL[shared, pair, guard is not None], params)
                if after_rollback and raw.info.transaction_status == TransactionStatus.INTRANS:
                    # Django has rolled back but not yet switched autocommit back on; psycopg
                    # opened a transaction for the unlock, which must not be left open.
                    raw.commit()
        except Exception:
            with self.connection.wrap_database_errors:  # as in acquire()
                raise
        if not self._same_server(row[1]):
            raise LockLost(
                f"The lock was taken on server pid {guard} of {self.describe()}, and the "
                f"release reached pid {row[1]}: a transaction-mode pooler (PgBouncer) is in "
                f"between. The lock stays held by pid {guard} until that server connection "
                f"closes. {pooler_advice(self.connection.alias)}"
            )
        return bool(row[0])

    def _exec_fast(
        self, raw: Any, sql: bytes, params: tuple[int, ...], pair: bool
    ) -> tuple[bool | None, int]:
        """Run a try or unlock statement through libpq itself: one round trip without the
        per-statement Python work of a psycopg cursor. Only for statements that never wait,
        outside transactions: libpq blocks until the server answers.

        A statement that runs again on a connection is prepared (PQprepare, once), which
        saves the server parsing and planning it each time: about a third of the pair.
        """
        values = [b"%d" % value for value in params]
        logged = queries_logged(self.connection)
        start = time.monotonic() if logged else 0.0
        try:
            uses = raw._advisory_lock_uses
        except AttributeError:
            uses = raw._advisory_lock_uses = {}
        count = uses.get(sql, 0)
        with raw.lock:
            pgconn = raw.pgconn
            if count < 0:  # prepared
                result = pgconn.exec_prepared(_STATEMENT_NAMES[sql], values)
                if result.error_field(_SQLSTATE) == _UNKNOWN_STATEMENT:
                    # DEALLOCATE or DISCARD ran, or a transaction-mode pooler moved us to
                    # another server connection: run it unprepared, so the guard can tell.
                    uses.clear()
                    result = pgconn.exec_params(sql, values, _TYPES[pair, len(params)])
            elif count < _PREPARE_AFTER:
                uses[sql] = count + 1
                result = pgconn.exec_params(sql, values, _TYPES[pair, len(params)])
            else:
                prepared = pgconn.prepare(_STATEMENT_NAMES[sql], sql, _TYPES[pair, len(params)])
                # Already there (the server connection outlived an earlier client of ours): a
                # name stands for one statement text, so it is this one.
                if prepared.status == ExecStatus.COMMAND_OK or (
                    prepared.error_field(_SQLSTATE) == _DUPLICATE_STATEMENT
                ):
                    uses[sql] = -1
                    result = pgconn.exec_prepared(_STATEMENT_NAMES[sql], values)
                else:  # preparing is only a saving: never let it fail the lock
                    uses[sql] = 0
                    result = pgconn.exec_params(sql, values, _TYPES[pair, len(params)])
        if logged:
            readable = sql.decode()
            for number in range(len(params), 0, -1):
                readable = readable.replace(f"${number}", str(params[number - 1]))
            self.log_query(readable, start)
        if result.status != ExecStatus.TUPLES_OK:
            raise errors.error_from_result(result, encoding=raw.info.encoding)
        locked = result.get_value(0, 0)
        return (None if locked is None else locked == b"t"), int(result.get_value(0, 1))

    def _same_server(self, pid: int) -> bool:
        """Note the server pid a statement ran on; False if it moved (a pooler)."""
        if self._server_pid is None or pid == self._server_pid:
            self._server_pid = pid
            return True
        POOLED_ALIASES.add(self.connection.alias)
        return False

    def session_lock_problem(self) -> str | None:
        if self.connection.alias in POOLED_ALIASES:
            return (
                f"Session-scoped locks can't work on {self.describe()}: a transaction-mode "
                f"pooler was detected in front of it (the server pid changed under one "
                f"client connection). {pooler_advice(self.connection.alias)}"
            )
        return super().session_lock_problem()

    def release_all(self) -> None:
        with self.connection.wrap_database_errors:
            self.run("SELECT pg_advisory_unlock_all()", ())
        self.session_holds.clear()

    def is_held(self, db_key: Any) -> bool:
        with self.connection.wrap_database_errors:
            return self.run(_IS_HELD_SQL, lock_row_ids(db_key))[0]

    def list_locks(self, names: dict[Any, str]) -> tuple[str, str, list[dict[str, Any]]]:
        with self.connection.wrap_database_errors, self.connection.cursor() as cursor:
            cursor.execute(_LIST_SQL)
            rows = cursor.fetchall()
        locks = []
        for row in rows:
            classid, objid, objsubid, mode, granted, pid, user, application, client = row[:9]
            backend_start, xact_start, state, query, held_for, waited_for = row[9:]
            locks.append(
                {
                    "db_key": key_from_lock_row(classid, objid, objsubid),
                    "mode": "shared" if mode == "ShareLock" else "exclusive",
                    "granted": granted,
                    "pid": pid,
                    "user": user,
                    "application_name": application,
                    "client_addr": client,
                    "backend_start": backend_start,
                    "transaction_start": xact_start,
                    "state": state,
                    "query": query,
                    # PostgreSQL does not record when a lock was granted: this is the time
                    # since the holder's transaction (else connection) started, an upper bound.
                    "held_for": float(held_for) if granted and held_for is not None else None,
                    "waited_for": float(waited_for) if waited_for is not None else None,
                }
            )
        return "pg_locks", "", locks

    def terminate(self, holder_id: int) -> None:
        with self.connection.wrap_database_errors:
            self.run("SELECT pg_terminate_backend(%s)", (holder_id,))

    def database_now(self) -> datetime.datetime:
        with self.connection.wrap_database_errors:
            return self.run("SELECT statement_timestamp()", ())[0].astimezone(
                datetime.timezone.utc
            )

    def holder(self, db_key: Any) -> dict[str, Any] | None:
        with self.connection.wrap_database_errors:
            row = self.run(_HOLDER_SQL, lock_row_ids(db_key))
        if row is None:
            return None
        pid, user, application, client, backend_start, xact_start, state, age = row
        return {
            "pid": pid,
            "user": user,
            "application_name": application,
            "client_addr": client or "local socket",
            "since": backend_start,
            "transaction_start": xact_start,
            "state": state,
            "held_for": float(age),
        }

    @classmethod
    def pool_problem(cls, settings_dict: dict[str, Any]) -> str | None:
        pool = settings_dict.get("OPTIONS", {}).get("pool")
        if not pool:
            return None
        if isinstance(pool, dict) and pool.get("reset") is reset_pooled_connection:
            return None
        return (
            "Django's PostgreSQL connection pool hands a connection to the next borrower with "
            "whatever advisory session locks the last one left on it."
        )

    @classmethod
    def dedicated_settings(cls, settings_dict: dict[str, Any], label: str) -> dict[str, Any]:
        settings_dict = super().dedicated_settings(settings_dict, label)
        options = settings_dict.setdefault("OPTIONS", {})
        options.pop(
            "pool", None
        )  # a lock's connection is never borrowed from, or returned to, a pool
        # Shown in pg_stat_activity, so that "who holds it" answers with a name.
        options["application_name"] = label[:63]
        return settings_dict

    def transaction_is_aborted(self) -> bool:
        raw = self.connection.connection
        return raw is not None and raw.info.transaction_status == TransactionStatus.INERROR


def reset_pooled_connection(connection: Any) -> None:
    """``OPTIONS["pool"]["reset"]`` for Django's PostgreSQL pool: drop every advisory lock
    a borrower left on a connection before the next borrower gets it."""
    connection.execute("SELECT pg_advisory_unlock_all()")
    if connection.info.transaction_status != TransactionStatus.IDLE:
        connection.rollback()
