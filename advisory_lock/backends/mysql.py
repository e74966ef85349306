"""MySQL and MariaDB named locks (``GET_LOCK`` / ``RELEASE_LOCK``), through mysqlclient.

Named locks are server-wide, not per database, and a name is at most 64 characters. Names
are therefore ``<database>/<namespace>:<key>``, shortened with a hash when too long or when
they hold characters whose comparison differs between servers (MySQL 8 compares names
case-insensitively, MariaDB 10.11 does not). Both servers count repeated holds by one
connection. There are no shared named locks and no transaction-level ones.
"""

from __future__ import annotations

import datetime
import functools
import math
import re
import string
import time
from typing import Any

from MySQLdb import _mysql

from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import queries_logged
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import shorten

MAX_NAME_LENGTH = 64
# MariaDB rejects a negative GET_LOCK timeout (warning 1411, result NULL); MySQL reads it as
# "for ever". MariaDB's "for ever" is therefore a long bound: about 68 years.
_MARIADB_FOREVER = 2**31 - 1
_POLL_INTERVAL = 0.02
# mysql_real_query itself, without MySQLdb's Python wrapper (which only copies bytearrays).
_query = _mysql.connection.query
# A waiting GET_LOCK shows its statement in the processlist; mysqlclient inlines the name.
_WAITING_NAME = re.compile(r"GET_LOCK\('((?:[^'\\]|\\.)*)'", re.IGNORECASE)
_PERFORMANCE_SCHEMA_SQL = (
    "SELECT m.OBJECT_NAME, m.LOCK_STATUS = 'GRANTED', t.PROCESSLIST_ID, t.PROCESSLIST_USER, "
    "t.PROCESSLIST_HOST, t.PROCESSLIST_TIME, t.PROCESSLIST_STATE, t.PROCESSLIST_INFO "
    "FROM performance_schema.metadata_locks m "
    "JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID "
    "WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK'"
)
_METADATA_LOCK_INFO_SQL = (
    "SELECT m.TABLE_SCHEMA, 1, m.THREAD_ID, p.USER, p.HOST, p.TIME, p.STATE, p.INFO "
    "FROM information_schema.METADATA_LOCK_INFO m "
    "LEFT JOIN information_schema.PROCESSLIST p ON p.ID = m.THREAD_ID "
    "WHERE m.LOCK_TYPE = 'User lock'"
)
_PROCESSLIST_SQL = "SELECT ID, USER, HOST, TIME, STATE, INFO FROM information_schema.PROCESSLIST"


@functools.lru_cache(maxsize=1024)
def _lock_name(database: str, value: Key, namespace: str | None) -> str:
    """The server-wide lock name of a key in ``database`` (recent ones cached: a hash)."""
    return shorten(f"{database}/{LockKey(value, namespace).identity}", MAX_NAME_LENGTH)


# Characters that no server escapes in a string literal, whatever the connection's character
# set or sql_mode: every lock name is made of them (shorten() keeps or hashes to them).
_UNESCAPED = frozenset(string.ascii_letters + string.digits + "_.:-/,#@+=~")


@functools.lru_cache(maxsize=1024)
def _quoted(name: str) -> bytes | None:
    """``name`` as an SQL string literal, or None if only the connection can escape it (the
    driver's escaping costs as much as the rest of the statement's Python)."""
    return b"'%s'" % name.encode() if _UNESCAPED.issuperset(name) else None


class MySQLBackend(LockBackend):
    vendor = "mysql"
    supports_shared = False

    def db_key(self, key: LockKey) -> str:
        return _lock_name(self.connection.settings_dict["NAME"], key.value, key.namespace)

    def acquire(
        self, db_key: Any, *, shared: bool, transaction: bool, timeout: float | None
    ) -> bool:
        if timeout == 0:
            return self._get_lock(db_key, b"0")
        if timeout is None:
            return self._get_lock(db_key, b"%d" % (_MARIADB_FOREVER if self._is_mariadb() else -1))
        if timeout == int(timeout) or self._is_mariadb():
            # MariaDB honours fractions of a second; MySQL reads the timeout as an integer.
            return self._get_lock(db_key, b"%r" % timeout)
        # MySQL and a fractional bound: wait the whole seconds, then poll the rest.
        deadline = time.monotonic() + timeout
        if self._get_lock(db_key, b"%d" % math.floor(timeout)):
            return True
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_POLL_INTERVAL, left))
            if self._get_lock(db_key, b"0"):
                return True
        return False

    def _get_lock(self, name: str, timeout: bytes) -> bool:
        """GET_LOCK with ``timeout`` already written as SQL (seconds)."""
        result = self._select(b"SELECT GET_LOCK(%s, %s)", name, timeout)
        if result is None:
            # NULL is an error, not "busy": the waiting connection was killed, or the server
            # ran out of memory.
            raise AdvisoryLockError(
                f"GET_LOCK({name!r}) failed on {self.describe()}: the server returned NULL "
                f"(the waiting connection was killed, or the server ran out of memory). "
                f"Check the server's error log, then retry."
            )
        return result == 1

    def release(self, db_key: Any, *, shared: bool, after_rollback: bool = False) -> bool:
        result = self._select(b"SELECT RELEASE_LOCK(%s)", db_key)
        # 1: released; 0: held by another connection; NULL: nobody holds it.
        return result == 1

    def _select(self, template: bytes, name: str, *more: bytes) -> Any:
        """Run a one-value lock statement straight through the client library (query and
        store_result): a cursor's Python work would cost a third of the round trip. Driver
        errors come out as Django's, as from a cursor."""
        connection = self.connection
        raw = connection.connection
        if raw is None or self._raw_ref() is not raw:  # driver_connection()'s test, inline
            raw = self.driver_connection()
        sql = template % (_quoted(name) or raw.string_literal(name.encode()), *more)
        start = time.monotonic() if queries_logged(connection) else None
        try:
            _query(raw, sql)
            return raw.store_result().fetch_row()[0][0]
        except Exception:
            with connection.wrap_database_errors:
                raise
        finally:
            if start is not None:
                self.log_query(sql.decode(), start)

    def release_all(self) -> None:
        with self.connection.wrap_database_errors:
            self.run("SELECT RELEASE_ALL_LOCKS()", ())
        self.session_holds.clear()

    def is_held(self, db_key: Any) -> bool:
        with self.connection.wrap_database_errors:
            (held,) = self.run("SELECT IS_USED_LOCK(%s) = CONNECTION_ID()", (db_key,))
        return held == 1

    def list_locks(self, names: dict[Any, str]) -> tuple[str, str, list[dict[str, Any]]]:
        """Granted locks from the best source the server has; waiters from the processlist."""
        with self.connection.wrap_database_errors, self.connection.cursor() as cursor:
            for source, sql in (
                ("performance_schema.metadata_locks", _PERFORMANCE_SCHEMA_SQL),
                ("information_schema.METADATA_LOCK_INFO", _METADATA_LOCK_INFO_SQL),
            ):
                if self._can_read(cursor, source):
                    cursor.execute(sql)
                    return source, "", [self._row(row) for row in cursor.fetchall()]
            # Neither: ask for each name we know, and read waiters off the processlist.
            cursor.execute(_PROCESSLIST_SQL)
            processes = {row[0]: row for row in cursor.fetchall()}
            locks = []
            for name in names:
                cursor.execute("SELECT IS_USED_LOCK(%s)", [name])
                (holder,) = cursor.fetchone()
                if holder is not None:
                    process = processes.get(holder, (holder, None, None, None, None, None))
                    locks.append(self._row((name, True, *process)))
            for process in processes.values():
                match = _WAITING_NAME.search(process[5] or "")
                if match and process[4] == "User lock":
                    locks.append(self._row((match.group(1), False, *process)))
        note = (
            "This server has neither performance_schema nor the METADATA_LOCK_INFO plugin, so "
            "only locks with a known name are shown (and waiters, from the processlist)."
        )
        return "IS_USED_LOCK over known names", note, locks

    def _can_read(self, cursor: Any, source: str) -> bool:
        if source.startswith("performance_schema"):
            cursor.execute("SELECT @@performance_schema")
            if not cursor.fetchone()[0]:
                return False
            sql = "SELECT 1 FROM performance_schema.metadata_locks LIMIT 0"
        else:
            sql = (
                "SELECT 1 FROM information_schema.PLUGINS "
                "WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE'"
            )
        try:
            cursor.execute(sql)
        except self.connection.Database.Error:
            return False
        return source.startswith("performance_schema") or cursor.fetchone() is not None

    @staticmethod
    def _row(row: tuple[Any, ...]) -> dict[str, Any]:
        name, granted, connection_id, user, host, seconds, state, query = row
        return {
            "db_key": name,
            "mode": "exclusive",
            "granted": bool(granted),
            "connection_id": connection_id,
            "user": user,
            "client_addr": host,
            "state": state,
            "query": query,
            # Seconds in the connection's current state: how long a waiter has waited; for
            # an idle holder, how long since its last statement (a lower bound of the hold).
            "held_for": float(seconds) if granted and seconds is not None else None,
            "waited_for": None if granted or seconds is None else float(seconds),
        }

    def terminate(self, holder_id: int) -> None:
        with self.connection.wrap_database_errors, self.connection.cursor() as cursor:
            cursor.execute("KILL %s", [int(holder_id)])

    def database_now(self) -> datetime.datetime:
        with self.connection.wrap_database_errors:
            (now,) = self.run("SELECT UTC_TIMESTAMP(6)", ())
        return now.replace(tzinfo=datetime.timezone.utc)

    def holder(self, db_key: Any) -> dict[str, Any] | None:
        # One statement: the holder's connection id, and what the processlist tells of it.
        with self.connection.wrap_database_errors:
            row = self.run(
                "SELECT IS_USED_LOCK(%s), p.USER, p.HOST, p.TIME, p.STATE FROM (SELECT 1) AS _d "
                "LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = IS_USED_LOCK(%s)",
                (db_key, db_key),
            )
        connection_id, user, host, seconds, state = row
        if connection_id is None:
            return None
        holder: dict[str, Any] = {"connection_id": connection_id}
        if user is not None:
            holder.update(user=user, client_addr=host, state=state, in_state_for=float(seconds))
        return holder

    def exact_collation(self) -> str | None:
        # The default collations fold case and accents, and the PAD SPACE ones (utf8mb4_bin
        # too) ignore trailing spaces: "Job" = "job ". These compare byte for byte.
        return "utf8mb4_nopad_bin" if self._is_mariadb() else "utf8mb4_0900_bin"

    def cluster_problem(self) -> str | None:
        with self.connection.cursor() as cursor:
            try:
                cursor.execute("SELECT @@wsrep_on")
            except self.connection.Database.Error:
                return None  # no such variable: not a Galera-based server
            (wsrep_on,) = cursor.fetchone()
        if not wsrep_on:
            return None
        return (
            f"{self.describe()} is a Galera cluster node (wsrep_on = ON: MariaDB Galera or "
            f"Percona XtraDB Cluster). GET_LOCK locks are local to one node and not replicated, "
            f"so two instances on two nodes can both hold the same lock."
        )

    def _is_mariadb(self) -> bool:
        # From the handshake, not Django's mysql_is_mariadb (which may run a query); noted on
        # the driver connection, so that it lives exactly as long.
        try:
            return self.connection.connection._advisory_lock_is_mariadb
        except AttributeError:  # not noted yet, or not connected yet (None)
            raw = self.driver_connection()
            raw._advisory_lock_is_mariadb = "mariadb" in raw.get_server_info().lower()
            return raw._advisory_lock_is_mariadb
