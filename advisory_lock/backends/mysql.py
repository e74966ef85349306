"""MySQL and MariaDB named locks (``GET_LOCK`` / ``RELEASE_LOCK``), through mysqlclient.

Named locks are server-wide, not per database, and a name is at most 64 characters: names
are ``<database>/<namespace>:<key>``, shortened with a hash when too long or when they hold
characters whose comparison differs between servers (MySQL 8 compares names
case-insensitively, MariaDB 10.11 does not). Both servers count repeated holds by one
connection and release a connection's locks when it closes. There are no shared named locks
and no transaction-level ones.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import re
import time
from typing import TYPE_CHECKING
from typing import Any
from typing import NoReturn

from django.db import DatabaseError

from advisory_lock.backends.base import CONNECTION_ID
from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import Listing
from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.backends.base import replica_error
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.keys import LockKey
from advisory_lock.keys import shorten

if TYPE_CHECKING:
    # Imports the driver: for the type checker only.
    from django.db.backends.mysql.base import DatabaseWrapper

MAX_NAME_LENGTH = 64
# MariaDB refuses a negative GET_LOCK timeout (warning 1411, NULL) and one of 1e19 seconds
# or more; MySQL reads a negative one as "for ever". Waiting for ever is therefore a bound
# both take: 2**31 - 1 seconds, about 68 years.
_FOREVER = 2**31 - 1
_POLL_INTERVAL = 0.02

logger = logging.getLogger("advisory_lock")
#: Server errors that mean it can't be used for now (besides the client's own, 2000 to 2999:
#: can't connect, server gone away, lost connection): too many connections, shutdown in
#: progress, aborted connection, network read and write errors, connection killed, idle
#: timeout.
_OUTAGE = frozenset({1040, 1053, 1152, 1158, 1159, 1160, 1161, 1184, 1927, 4031})
# Characters that no server escapes in a string literal, whatever the connection's character
# set or sql_mode.
_UNESCAPED = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.:-/,#@+=~ABCDEFGHIJKLMNOPQRSTUVWXYZ")


@functools.lru_cache(maxsize=1024)
def _lock_name(database: str, identity: str) -> str:
    """The server-wide lock name of a key in ``database`` (recent ones kept: a hash)."""
    # shorten() keeps only characters that no server escapes in a string literal, whatever
    # the character set or sql_mode: the name is written between quotes as it is.
    return shorten(f"{database}/{identity}", MAX_NAME_LENGTH)


class MySQLBackend(LockBackend):
    vendor = "mysql"
    supports_shared = False
    max_timeout = _FOREVER

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        self._raw: Any = None  # the driver connection the field below belongs to
        self._mariadb = False
        # (name, timeout; None for RELEASE_LOCK) -> the statement and its bytes, for names
        # that need no escaping (a bounded memory: the same few names are locked again).
        self._statements: dict[tuple[str, int | None], tuple[str, bytes | None]] = {}

    @classmethod
    def is_outage(cls, error: BaseException) -> bool:
        code = error.args[0] if error.args and isinstance(error.args[0], int) else None
        return code is None or 2000 <= code < 3000 or code in _OUTAGE

    def db_key(self, key: LockKey) -> str:
        return _lock_name(self.connection.settings_dict["NAME"], key.identity)

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        # A try first, which never waits in the server: most locks are free (a key busy at
        # its last try waits at once, see LockBackend.wait_at_once).
        if timeout == 0 or not (self._contended and self.wait_at_once(db_key)):
            statement = self._statements.get((db_key, 0)) or self._statement("GET_LOCK", db_key, 0)
            (result,) = self._run(*statement)  # _get_lock(db_key, 0), inlined
            if result is None:
                self._null(db_key)
            acquired = bool(result == 1)
            if not acquired or self._contended:
                self.note_contention(db_key, not acquired)
            if acquired or timeout == 0:
                return acquired
        if timeout is None:
            return self._get_lock(db_key, _FOREVER)
        if timeout == int(timeout) or self._is_mariadb():
            # MariaDB honours fractions of a second; MySQL reads the timeout as an integer.
            return self._get_lock(db_key, timeout)
        # MySQL and a fractional bound: wait the whole seconds, then poll the rest.
        deadline = time.monotonic() + timeout
        if self._get_lock(db_key, math.floor(timeout)):
            return True
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_POLL_INTERVAL, left))
            if self._get_lock(db_key, 0):
                return True
        return False

    def _get_lock(self, name: str, timeout: float) -> bool:
        statement = self._statements.get((name, timeout)) if type(timeout) is int else None
        (result,) = self._run(*(statement or self._statement("GET_LOCK", name, timeout)))
        if result is None:
            self._null(name)
        return bool(result == 1)

    def _null(self, name: str) -> NoReturn:
        # NULL is an error, not "busy": the waiting connection was killed, or the server ran
        # out of memory.
        raise AdvisoryLockError(
            f"GET_LOCK({name!r}) failed on {self.describe()}: the server returned NULL "
            f"(the waiting connection was killed, or the server ran out of memory). "
            f"Check the server's error log, then retry."
        )

    def release(self, db_key: Any, *, shared: bool) -> bool:
        # 1: released; 0: held by another connection; NULL: nobody holds it.
        statement = self._statements.get((db_key, None))
        (result,) = self._run(*(statement or self._statement("RELEASE_LOCK", db_key, None)))
        return bool(result == 1)

    def undo_interrupted_acquire(self, db_key: Any, *, shared: bool) -> None:
        # mysqlclient waits in C, where no signal handler runs: the interruption surfaces
        # after GET_LOCK returned, maybe before its result was read, and the connection
        # answers nothing else until it is ("Commands out of sync"): read it first
        # (store_result() returns None when there is none). A lock granted then is this
        # connection's, and no hold of this connection holds the name (the caller checked):
        # release each of its holds (RELEASE_LOCK releases one).
        raw = self.connection.connection
        if raw is None:
            return
        try:
            raw.store_result()
            self.release_every_hold(db_key, shared=shared)
        except Exception:
            logger.warning(
                "Releasing lock %r, granted as its wait was interrupted, failed: closing its "
                "connection, which releases it.",
                db_key,
                exc_info=True,
            )
            self.connection.close()

    def try_many(self, db_keys: list[Any]) -> list[bool]:
        # One statement: a session may hold several named locks (MySQL 5.7, MariaDB 10.0.2),
        # and each GET_LOCK of the select list is evaluated once.
        calls = ", ".join(f"GET_LOCK({self._quoted(key)}, 0)" for key in db_keys)
        return [taken == 1 for taken in self._run(f"SELECT {calls}")]

    def release_many(self, db_keys: list[Any]) -> None:
        self._run("SELECT " + ", ".join(f"RELEASE_LOCK({self._quoted(key)})" for key in db_keys))

    def server_session(self) -> tuple[int, str, int]:
        # CONNECTION_ID(), which IS_USED_LOCK() returns for the holder, names a session on
        # one server only, and its counter starts again at each start: after a failover or
        # a restart, another session of the server then answering may have it. So the
        # server is named too: its host name and when it started (now less its Uptime
        # status, in whole seconds).
        (connection_id, host, started) = self._run(
            f"SELECT CONNECTION_ID(), @@hostname, {self._server_started()}"
        )
        return int(connection_id), str(host), int(started)

    def session_id(self) -> int | None:
        # The driver's (mysqlclient's documented thread_id(): the connection id of the
        # handshake, no statement), which CONNECTION_ID() and IS_USED_LOCK() return too.
        raw = self.connection.connection
        return None if raw is None else int(raw.thread_id())

    def session_socket(self) -> int | None:
        # mysqlclient's documented Connection.fileno(): the client library's socket. A
        # closed connection raises (ProgrammingError, InterfaceError): no socket then.
        raw = self.connection.connection
        if raw is None:
            return None
        try:
            return int(raw.fileno())
        except Exception:
            return None

    def held_by(self, db_key: Any, session: tuple[int, str, int]) -> bool:
        connection_id, host, started = int(session[0]), str(session[1]), int(session[2])
        # The start, computed from two clocks read a moment apart, may be one second off.
        (held,) = self._run(
            f"SELECT IS_USED_LOCK({self._quoted(db_key)}) = {connection_id} "
            f"AND @@hostname = {self._quoted(host)} "
            f"AND ABS({self._server_started()} - {started}) <= 1"
        )
        return bool(held == 1)

    def _server_started(self) -> str:
        """An expression: when this server started, in Unix seconds. Its Uptime status is in
        information_schema.GLOBAL_STATUS on MariaDB, performance_schema.global_status on
        MySQL 5.7+ (where the former was removed)."""
        table = (
            "information_schema.GLOBAL_STATUS"
            if self._is_mariadb()
            else "performance_schema.global_status"
        )
        return (
            f"(UNIX_TIMESTAMP() - (SELECT VARIABLE_VALUE FROM {table} "
            f"WHERE VARIABLE_NAME = 'Uptime'))"
        )

    def is_held(self, db_key: Any) -> bool:
        (held,) = self._run(f"SELECT IS_USED_LOCK({self._quoted(db_key)}) = CONNECTION_ID()")
        return bool(held == 1)

    def _statement(
        self, function: str, name: str, timeout: float | None
    ) -> tuple[str, bytes | None]:
        """``SELECT function(name[, timeout])``, and its bytes when it is kept: for a name
        that needs no escaping and an int timeout or none (``GET_LOCK``'s) or none
        (``RELEASE_LOCK``'s), the statement is the same on any connection. It is ASCII then,
        whose bytes are the same in every character set a MySQL client can use (the server
        refuses ucs2, utf16 and utf32 for the client)."""
        arguments = self._quoted(name) if timeout is None else f"{self._quoted(name)}, {timeout!r}"
        statement = f"SELECT {function}({arguments})"
        if (timeout is None or type(timeout) is int) and _UNESCAPED.issuperset(name):
            if len(self._statements) >= 256:
                self._statements.clear()
            kept = self._statements[name, timeout] = (statement, statement.encode("ascii"))
            return kept
        return statement, None

    def _quoted(self, name: str) -> str:
        """``name`` as a string literal. Names made by ``db_key()`` hold only characters no
        server escapes (see ``_lock_name``); any other goes through the driver's escaping."""
        if _UNESCAPED.issuperset(name):
            return f"'{name}'"
        raw = self._driver_connection()
        literal: bytes = raw.literal(name)
        return literal.decode(raw.encoding)

    def _run(self, sql: str, encoded: bytes | None = None) -> tuple[Any, ...]:
        """Run one statement and return its row: through Django's cursor when Django logs
        queries or wraps executions (so that they see it), else through the driver's
        documented low-level calls, ``query()`` and ``store_result()`` (no cursor), with
        ``encoded`` as its bytes if given."""
        connection = self.connection
        if connection.execute_wrappers or connection.queries_logged:
            self._driver_connection()  # first: a new connection is checked (a replica)
            with connection.cursor() as cursor:
                cursor.execute(sql)
                return tuple(cursor.fetchone())
        raw = connection.connection
        if raw is None or raw is not self._raw:
            raw = self._driver_connection()
        try:
            raw.query(encoded or sql.encode(raw.encoding))
            rows: tuple[tuple[Any, ...], ...] = raw.store_result().fetch_row()
        except Exception:
            with connection.wrap_database_errors:
                raise
        return rows[0]

    def _driver_connection(self) -> Any:
        """The driver connection, connecting if need be; a new one is checked once not to be
        a read-only server (a replica)."""
        connection = self.connection
        raw = connection.connection
        if raw is None:
            connection.ensure_connection()
            raw = connection.connection
        if raw is not self._raw:
            # From the handshake, not Django's mysql_is_mariadb (which may run a query).
            self._mariadb = "mariadb" in raw.get_server_info().lower()
            try:
                raw.query(b"SELECT @@global.read_only")
                ((read_only,),) = raw.store_result().fetch_row()
            except Exception:
                with connection.wrap_database_errors:
                    raise
            if int(read_only):
                raise replica_error(self.describe(), "is read-only (@@read_only), a replica")
            self._raw = raw
        return raw

    def _is_mariadb(self) -> bool:
        self._driver_connection()
        return self._mariadb


# A waiting GET_LOCK shows its statement in the processlist, with the name inlined.
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


class MySQLInspector(LockInspector):
    connection: DatabaseWrapper

    def holder(self, db_key: Any) -> Holder | None:
        # One statement: the holder's connection id, and what the processlist tells of it.
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT IS_USED_LOCK(%s), p.USER, p.HOST, p.STATE, p.INFO FROM (SELECT 1) AS _d "
                "LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = IS_USED_LOCK(%s)",
                [db_key, db_key],
            )
            connection_id, user, host, state, query = cursor.fetchone()
        if connection_id is None:
            return None
        # No process id: the processlist has none, and the client's own (the connection
        # attribute _pid that libmysqlclient and MariaDB Connector/C send) is readable only in
        # performance_schema.session_connect_attrs, empty while performance_schema is off.
        return Holder(
            id=connection_id, kind=CONNECTION_ID, user=user, host=host, state=state, query=query
        )

    def list_locks(self, known: dict[Any, str], names_table: str | None = None) -> Listing:
        """Granted locks from the best source the server has; waiters from the processlist."""
        with self.connection.cursor() as cursor:
            for source, sql in (
                ("performance_schema.metadata_locks", _PERFORMANCE_SCHEMA_SQL),
                ("information_schema.METADATA_LOCK_INFO", _METADATA_LOCK_INFO_SQL),
            ):
                if self._can_read(cursor, source):
                    cursor.execute(sql)
                    return Listing(source, [_row(row) for row in cursor.fetchall()])
            # Neither: ask about each name we know, and read waiters off the processlist.
            cursor.execute(_PROCESSLIST_SQL)
            processes = {row[0]: row for row in cursor.fetchall()}
            held = self._used_locks(cursor, [name for name in known if isinstance(name, str)])
            if names_table is not None:
                held.update(self._used_locks_of_table(cursor, names_table))
            rows = []
            for name, holder in held.items():
                process = processes.get(holder, (holder, None, None, None, None, None))
                rows.append(_row((name, True, *process)))
            for process in processes.values():
                match = _WAITING_NAME.search(process[5] or "")
                if match and process[4] == "User lock":
                    rows.append(_row((match.group(1), False, *process)))
        note = (
            "This server has neither performance_schema nor the METADATA_LOCK_INFO plugin, so "
            "only locks with a known name are shown (registered, or recorded by their "
            "holders in the lock directory), and waiters, from the processlist."
        )
        return Listing("IS_USED_LOCK over known names", rows, note)

    @staticmethod
    def _used_locks(cursor: Any, names: list[str]) -> dict[str, int]:
        """``{name: holder's connection id}`` of the names that are held: a statement per
        100 names (IS_USED_LOCK is a lookup in the server's table of user locks)."""
        held = {}
        for start in range(0, len(names), 100):
            chunk = names[start : start + 100]
            cursor.execute(
                "SELECT " + ", ".join(["IS_USED_LOCK(%s)"] * len(chunk)),
                chunk,
            )
            for name, holder in zip(chunk, cursor.fetchone(), strict=True):
                if holder is not None:
                    held[name] = int(holder)
        return held

    def _used_locks_of_table(self, cursor: Any, table: str) -> dict[str, int]:
        """The held names of ``table``'s ``key`` column, asked in one statement: the server
        evaluates IS_USED_LOCK for each row."""
        quoted = self.connection.ops.quote_name(table)
        try:
            cursor.execute(
                f"SELECT n.`key`, IS_USED_LOCK(n.`key`) FROM {quoted} n "
                f"WHERE IS_USED_LOCK(n.`key`) IS NOT NULL"
            )
        except DatabaseError:  # the lock directory is not migrated on this database
            return {}
        return {str(name): int(holder) for name, holder in cursor.fetchall()}

    def session_started(self, sessions: list[int] | None) -> dict[int, int]:
        # Connection ids are not reused while the server runs: when it started (now less its
        # Uptime, in whole seconds, so maybe a second off) tells two sessions of one id apart.
        # information_schema.PROCESSLIST shows every session to a user with the PROCESS
        # privilege, else that user's own.
        table = (
            "information_schema.GLOBAL_STATUS"
            if self.connection.mysql_is_mariadb
            else "performance_schema.global_status"
        )
        sql = (
            f"SELECT p.ID, UNIX_TIMESTAMP() - (SELECT VARIABLE_VALUE FROM {table} "
            f"WHERE VARIABLE_NAME = 'Uptime') FROM information_schema.PROCESSLIST p"
        )
        with self.connection.cursor() as cursor:
            if sessions is None:
                cursor.execute(sql)
            elif not sessions:
                return {}
            else:
                ids = [int(session) for session in sessions]
                cursor.execute(f"{sql} WHERE p.ID IN ({', '.join(['%s'] * len(ids))})", ids)
            return {int(session): int(started) for session, started in cursor.fetchall()}

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
        except DatabaseError:
            return False
        return source.startswith("performance_schema") or cursor.fetchone() is not None

    def terminate(self, holder_id: int) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute(f"KILL {int(holder_id)}")

    def database_now(self) -> datetime.datetime:
        now: datetime.datetime
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT UTC_TIMESTAMP(6)")
            (now,) = cursor.fetchone()
        return now.replace(tzinfo=datetime.timezone.utc)

    def exact_collation(self) -> str | None:
        # The default collations fold case and accents, and the PAD SPACE ones (utf8mb4_bin
        # too) ignore trailing spaces: "Job" = "job ". These compare byte for byte.
        return "utf8mb4_nopad_bin" if self.connection.mysql_is_mariadb else "utf8mb4_0900_bin"

    def cluster_problem(self) -> str | None:
        return self._galera_problem() or self._group_replication_problem()

    def _galera_problem(self) -> str | None:
        with self.connection.cursor() as cursor:
            try:
                cursor.execute("SELECT @@wsrep_on")
            except DatabaseError:
                return None  # no such variable: not a Galera-based server
            (wsrep_on,) = cursor.fetchone()
        if not wsrep_on:
            return None
        return (
            f"Database {self.connection.alias!r} is a Galera cluster node (wsrep_on = ON: "
            f"MariaDB Galera or Percona XtraDB Cluster). GET_LOCK locks are local to one node "
            f"and not replicated, so two instances on two nodes can both hold the same lock."
        )

    def _group_replication_problem(self) -> str | None:
        # MySQL's Group Replication certifies row changes only: "The certification process
        # does not take into account table locks ... or named locks (see GET_LOCK())" (MySQL
        # manual, Group Replication Limitations). In single-primary mode that is harmless:
        # the secondaries run with super_read_only, which the replica check refuses, so
        # locks are taken on the primary alone. In multi-primary mode every member takes
        # writes, and a lock on one excludes nobody on another. The variable exists only
        # while the plugin is loaded (MariaDB, and MySQL without it, answer an error); the
        # group is running when it has ONLINE members.
        with self.connection.cursor() as cursor:
            try:
                cursor.execute(
                    "SELECT @@group_replication_single_primary_mode, (SELECT COUNT(*) FROM "
                    "performance_schema.replication_group_members "
                    "WHERE MEMBER_STATE = 'ONLINE')"
                )
            except DatabaseError:
                return None
            single_primary, online = cursor.fetchone()
        if single_primary or not online:
            return None
        return (
            f"Database {self.connection.alias!r} is a member of a MySQL Group Replication "
            f"group in multi-primary mode (group_replication_single_primary_mode = OFF, "
            f"{online} members online). GET_LOCK locks are not certified across the group, "
            f"so two instances on two members can both hold the same lock."
        )


def _row(row: tuple[Any, ...]) -> LockRow:
    name, granted, connection_id, user, host, seconds, state, query = row
    # Seconds in the connection's current state: how long a waiter has waited; for an idle
    # holder, how long since its last statement (a lower bound of the hold).
    return LockRow(
        db_key=name,
        mode="exclusive",
        granted=bool(granted),
        holder=Holder(
            id=connection_id,
            kind=CONNECTION_ID,
            user=user,
            host=host,
            state=state,
            query=query,
        ),
        held_for=float(seconds) if granted and seconds is not None else None,
        waited_for=None if granted or seconds is None else float(seconds),
    )
