"""PostgreSQL advisory locks (``pg_advisory_lock`` and friends), through psycopg 3.

PostgreSQL keeps advisory locks per database and counts repeated holds by one session. It
releases transaction-level (xact) locks itself at the end of the top-level transaction, and
at ROLLBACK TO SAVEPOINT of a savepoint they were taken in; session locks when the session
ends. Keys are ints, written into the statements by us (nothing to escape).

Statements that can't wait (a try, an unlock) run through libpq itself, psycopg's documented
``Connection.pgconn`` (``psycopg.pq``): one round trip, no cursor, no adaptation. A statement
that may wait must let Python's signal handlers run while it waits (Ctrl-C, SIGTERM, a
watchdog's SIGINT), which a blocking libpq call would defer until the lock came: in autocommit
it is sent without blocking (``send_query_prepared``) and its result awaited with ``poll()``
on the socket, a wake-up at least every ``_WAIT_INTERVAL`` (``_result``); inside a
transaction, or when Django logs queries, it runs through a psycopg cursor, whose own wait
does the same.

Behind a transaction-mode pooler (PgBouncer) one client connection's statements run on any
server connection, and between them a server connection serves other clients; PgBouncer resets
nothing in between (its server_reset_query runs in session mode only). A session lock stays on
the server session that took it, and PostgreSQL grants it again, at once, to whatever runs
there next: a session's own holds never conflict, they are counted. Two things detect the
pooler, each in the round trip of the lock statement itself:

- the server pid: every session statement returns ``pg_backend_pid()``, and once it is known
  runs only there (``CASE WHEN pg_backend_pid() = <pid>``). A pid that changes under one client
  connection is a pooler. With one server connection in the pool it never changes.
- the client mark: our first lock statement on a server session writes our client connection's
  random id into a custom setting of that session, ``advisory_lock.client``, and it stays
  there. A lock statement runs only where the mark is ours (the first one on a session, a
  wait: ours or none). So a client lent a session that another client marked does not get
  that client's lock a second time: its statement does nothing, and a second one reads
  pg_locks. If the session holds any advisory lock, the lock is refused
  (``NotSupportedError``; ``LockLost`` at a release); if it holds none, the mark is stale
  (its client released everything) and the lock is taken there, marking the session ours.
  pg_locks copies the server's whole lock table, so only that rare path reads it. A
  transaction-scoped try checks the mark too, and on another client's reads pg_locks for its
  key.

What the mark can't see: session locks that other code (raw SQL) takes through the pooler, and
a mark that a rollback undid. A setting is transactional, the lock is not: a session lock
taken inside a transaction that then rolls back stays held without the mark, until the next
statement of ours on that session writes it again.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import math
import os
import re
import secrets
import select
import socket
import weakref
from collections.abc import Sequence
from time import monotonic
from typing import Any
from typing import NoReturn

from django.db import DatabaseError
from psycopg import errors
from psycopg import pq

from advisory_lock.backends.base import BACKEND_PID
from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import Listener
from advisory_lock.backends.base import Listing
from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.backends.base import ReleaseWait
from advisory_lock.backends.base import pooler_advice
from advisory_lock.backends.base import replica_error
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.exceptions import LockLost
from advisory_lock.exceptions import NotSupportedError
from advisory_lock.keys import LockKey

logger = logging.getLogger("advisory_lock")

#: Aliases found behind a transaction-mode pooler (the server pid changed under one client
#: connection, or a server connection held another client connection's session locks):
#: session locks are refused there for the rest of the process's life.
POOLED_ALIASES: set[str] = set()
# How each alias of POOLED_ALIASES was found out, for the message.
_FOUND_BY: dict[str, str] = {}
_PID_CHANGED = "the server pid changed under one client connection"
_FOREIGN_LOCKS = "a server connection it reached held another client connection's session locks"

# The client mark (see the module docstring). A custom setting ("placeholder" GUC: a dotted name
# no extension defines) is per server session, any role may set it, PgBouncer does not track it,
# and DISCARD ALL (a session pooler's server_reset_query) clears it along with the session's
# advisory locks. Never set, current_setting(..., true) is NULL; reset, ''. Reading it is most
# of what the guard costs the server (about a microsecond per statement on a small machine),
# so the prepared try and unlock read it once each, and only the first statement on a session
# writes it.
_MARK = "advisory_lock.client"
_MARK_VALUE = f"current_setting('{_MARK}', true)"
# Whether this server session holds any advisory lock (the rare path only: pg_locks copies the
# server's whole lock table).
_HOLDS_ANY = (
    "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid())"
)

#: SQLSTATEs (prefixes) that mean the server can't be used for now: connection exceptions,
#: the server shutting down or starting up, too many connections.
_OUTAGE = ("08", "57P", "53300")
_IDLE = pq.TransactionStatus.IDLE
_ACTIVE = pq.TransactionStatus.ACTIVE
_INERROR = pq.TransactionStatus.INERROR
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_COMMAND_OK = pq.ExecStatus.COMMAND_OK
_SQLSTATE = pq.DiagnosticField.SQLSTATE
_BOOL_OID = 16
_INT4_OID = 23
_INT8_OID = 20
_TEXT_OID = 25


# The id of each client connection, the mark it writes: random, a positive bigint. Keyed by the
# psycopg connection, not by the Django connection: Django's pool lends one psycopg connection
# (one server session, one client) to the connections of several threads.
_CLIENT_IDS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _client_id(raw: Any) -> int:
    client = _CLIENT_IDS.get(raw)
    if client is None:
        client = _CLIENT_IDS[raw] = secrets.randbits(62) + 1
    return client


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


# The session statements' functions, by ``shared`` (False: 0, True: 1).
_TRY = (_function(try_=True, shared=False), _function(try_=True, shared=True))
_LOCK = (_function(shared=False), _function(shared=True))
_UNLOCK = (_function(unlock=True, shared=False), _function(unlock=True, shared=True))


def _select(function: str, arguments: str) -> str:
    return f"SELECT {function}({arguments})"


def _session_select(
    function: str, arguments: str, *, pid: str, client: str, mode: str = "mark"
) -> str:
    """A session try, wait or unlock, *guarded*: it runs only on a server session whose client
    mark ``mode`` accepts (``client``: our id), and once the server ``pid`` is known (``""``
    before) only on that one. Columns: the function's result, NULL when the guard kept it from
    running (a wait's result is void, ''), and ``pg_backend_pid()``.

    ``mode`` says which marks let it run:

    - "ours" (the prepared try and unlock, once we marked the session): ours only. One
      current_setting() and one comparison: the server builds the expression anew at each
      execution, so the guard is kept that small.
    - "mark" (the first try on a session, a wait, a statement sent plain, an unlock again):
      ours or none (a rollback may have undone ours, DISCARD ALL reset it). A try or wait
      writes ours, then locks: CASE evaluates its branches in order and only those it needs.
      If the lock statement fails (lock_timeout, a cancel), the rollback of its (sub)
      transaction undoes set_config; a try that finds the lock busy leaves the mark, which
      only sends another client that lands on this session down the "takeover" path.
    - "takeover" (the rare path, after a try the guard kept from running): also another
      client's mark, if the session holds no advisory lock (the mark is stale). One
      statement, so that the pooler can't lend the session to anyone between the check and
      the lock.
    """
    call = f"{function}({arguments})"
    # ``client``: a text parameter (no cast then), or a literal.
    mine = f"{_MARK_VALUE} = {client}::text" if mode == "ours" else _unmarked_or_ours(client)
    if mode == "takeover":
        mine = f"CASE WHEN {mine} THEN true ELSE NOT {_HOLDS_ANY} END"
    guard = f"pg_backend_pid() = {pid} AND {mine}" if pid else mine
    if mode == "ours" or function.startswith("pg_advisory_unlock"):
        return f"SELECT CASE WHEN {guard} THEN {call} END, pg_backend_pid()"
    mark = f"set_config('{_MARK}', {client}::text, false) <> ''"
    return (
        f"SELECT CASE WHEN NOT ({guard}) THEN NULL WHEN {mark} THEN {call} END, pg_backend_pid()"
    )


def _unmarked_or_ours(client: str) -> str:
    """The session carries no mark (NULL: never set; '': reset) or ours."""
    return f"coalesce(nullif({_MARK_VALUE}, ''), {client}::text) = {client}::text"


@functools.cache
def _prepared(function: str, pair: bool, guarded: bool) -> tuple[bytes, bytes, list[int]]:
    """(name, statement with ``$n`` parameters, their type oids) of a session statement
    prepared on the server. The name is the text's hash: one name means one statement on any
    server session, so a name found already prepared there is this statement.

    Parameters, in order: the server pid (``guarded``: once it is known), our client id, and
    the key (a bigint, or a pair of integers). The first try on a session (the pid unknown)
    marks it ours; the statements after it run where it is ours (see ``_session_select``).
    """
    first = 3 if guarded else 2
    arguments = f"${first}, ${first + 1}" if pair else f"${first}"
    select = _session_select(
        function,
        arguments,
        pid="$1" if guarded else "",
        client="$2" if guarded else "$1",
        mode="ours" if guarded else "mark",
    )
    name = f"advisory_lock_{hashlib.sha256(select.encode()).hexdigest()[:16]}"
    # The pid and the halves of a pair are integers, a single key is a bigint; the client id
    # is text, as the mark is (the statement reads the same with it a bigint: ``$2::text``).
    types = [_INT4_OID] * guarded + [_TEXT_OID] + ([_INT4_OID, _INT4_OID] if pair else [_INT8_OID])
    return name.encode(), select.encode(), types


@functools.cache
def _prepared_wait(function: str, pair: bool, bounded: bool) -> tuple[bytes, bytes, list[int]]:
    """(name, statement, parameter types) of a session wait prepared on the server: guarded
    by the server pid and the client mark ("mark" mode, see ``_session_select``), with
    ``bounded`` a lock_timeout (text, milliseconds) as its last parameter.

    set_config(..., true) lasts for the statement's own transaction (autocommit). The
    sub-select holds a volatile function, so the planner runs it first, not pulled up.
    """
    arguments = "$3, $4" if pair else "$3"
    select = _session_select(function, arguments, pid="$1", client="$2", mode="mark")
    types = [_INT4_OID, _TEXT_OID] + ([_INT4_OID, _INT4_OID] if pair else [_INT8_OID])
    if bounded:
        select += f" FROM (SELECT set_config('lock_timeout', ${len(types) + 1}, true)) AS _t"
        types.append(_TEXT_OID)
    name = f"advisory_lock_{hashlib.sha256(select.encode()).hexdigest()[:16]}"
    return name.encode(), select.encode(), types


#: Seconds between two wake-ups of a wait on the socket (see ``_result``), and the longest
#: wait for a cancelled statement to end.
_WAIT_INTERVAL = 0.1
_CANCEL_TIMEOUT = 5.0


class _WaitTimeout(Exception):
    """A cancelled statement did not end in time."""


def _result(pgconn: Any, socket_fd: int, deadline: float | None) -> Any:
    """The result of the statement sent on ``pgconn`` (psycopg's ``Connection.pgconn``, in
    non-blocking mode), read as psycopg reads it (flush, then consume input while busy, then
    results until none), waiting on the socket with ``poll()`` for at most
    ``_WAIT_INTERVAL`` at a time: between two polls, and when a signal interrupts one, the
    main thread runs Python's signal handlers. ``_WaitTimeout`` after ``deadline``."""
    poller = select.poll()
    poller.register(socket_fd, select.POLLIN | select.POLLOUT)
    while pgconn.flush():  # what the send could not write yet (a full socket buffer)
        if poller.poll(_WAIT_INTERVAL * 1000):
            pgconn.consume_input()
        elif deadline is not None and monotonic() > deadline:
            raise _WaitTimeout
    poller.modify(socket_fd, select.POLLIN)
    first = None
    while True:
        while pgconn.is_busy():
            if poller.poll(_WAIT_INTERVAL * 1000):
                pgconn.consume_input()
            elif deadline is not None and monotonic() > deadline:
                raise _WaitTimeout
        result = pgconn.get_result()
        if result is None:
            return first
        if first is None:
            first = result


class PostgreSQLBackend(LockBackend):
    vendor = "postgresql"
    native_transaction_locks = True
    waits_in_server = True
    notifications = True
    max_timeout = (2**31 - 1) / 1000  # lock_timeout is a 32-bit number of milliseconds

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        # What we know of the driver connection we last ran on (forgotten when it changes).
        self._raw: Any = None
        self._pid: int | None = None  # its server pid, once a session statement told us
        self._prepared: set[bytes] = set()  # statements prepared on its server session
        # (function, keys) -> (name, parameters) of the prepared, guarded session statements.
        self._ready: dict[tuple[str, tuple[int, ...]], tuple[bytes, list[bytes]]] = {}
        self._client = 0  # the id of its client connection (its mark on server sessions)
        # The first parameters of its prepared statements, encoded: the pid once known, the
        # client id.
        self._leading: list[bytes] = []

    def db_key(self, key: LockKey) -> int | tuple[int, int]:
        return key._int64  # as_int64(), without the call

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        keys = db_key if type(db_key) is tuple else (db_key,)
        try:
            if transaction:  # the server releases it with the transaction (or savepoint)
                granted = self._transaction_try(db_key, keys, shared)
                if granted or timeout == 0:
                    return granted
                # The wait runs in the same transaction, so on the server session the try
                # ran on (a pooler moves a client only between transactions).
                function = _function(xact=True, shared=shared)
                return self._wait(_select(function, _args(keys)), timeout) is not None
            if timeout != 0 and self._contended and self.wait_at_once(db_key):
                # Busy at its last try: wait at once. NULL (the guard kept it from running):
                # the try below sorts out why.
                wait_row = self._session_wait(_LOCK[shared], keys, timeout, "mark")
                if wait_row is None:
                    return False
                if self._on_same_server(wait_row)[0] is not None:
                    return True
            function = _TRY[shared]
            row = self._session_statement(function, keys)
            if row[1] != self._pid:
                self._on_same_server(row)
            granted = row[0]
            mode = "mark"
            if granted is None:
                # NULL: the guard kept it from running. The session does not carry our mark:
                # a rollback undid it, DISCARD ALL reset it, or it carries another client's
                # (a pooler lent it to us).
                mode = "takeover"
                granted = self._take_over(function, keys)[0]
            if granted:
                if self._contended:
                    self._contended.pop(db_key, None)
                return True
            self.note_contention(db_key, True)
            if timeout == 0:
                return False
            wait_row = self._session_wait(_LOCK[shared], keys, timeout, mode)
            if wait_row is None:
                return False
            if self._on_same_server(wait_row)[0] is None:
                self._refuse()
        except errors.LockNotAvailable:
            return False  # lock_timeout (ours, or one set on the server) ran out: 55P03
        return True

    def release(self, db_key: Any, *, shared: bool) -> bool:
        keys = db_key if type(db_key) is tuple else (db_key,)
        function = _UNLOCK[shared]
        released, pid = self._session_statement(function, keys)
        expected = self._pid
        if released is not None and pid == expected:
            return bool(released)  # the common case: ran on our server session, for us
        if released is None and pid == expected:
            # The session does not carry our mark (see acquire): again, where it carries none.
            released, pid = self._run(self._plain(function, keys).encode())
        if not self._same_server(pid):
            raise LockLost(
                f"The lock was taken on server pid {expected} of {self.describe()}, and the "
                f"release reached pid {pid}: a transaction-mode pooler (PgBouncer) is in "
                f"between. The lock stays held by pid {expected} until that server "
                f"connection closes. {pooler_advice(self.connection.alias)}"
            )
        if released is None:
            # Same pid, but the session carries another client's mark: a pooler lent it to
            # another client, who locked there (a session that held our lock would have
            # refused it). Nothing was unlocked (the guard): what that client holds stays.
            self._pooler_found(_FOREIGN_LOCKS)
            raise LockLost(
                f"The lock was taken on server pid {expected} of {self.describe()}, and at "
                f"its release that server connection held another client connection's "
                f"session locks: a transaction-mode pooler (PgBouncer) is in between, and "
                f"the lock was lost or not ours alone. Nothing was released. "
                f"{pooler_advice(self.connection.alias)}"
            )
        return bool(released)

    def undo_interrupted_acquire(self, db_key: Any, *, shared: bool) -> None:
        # The interruption may have come while the wait statement ran: it is cancelled and
        # its result read first (psycopg's cancel_safe()), else the session answers nothing
        # else. A lock the server granted before the cancel reached it is this session's
        # now, and no hold of this connection holds the key (the caller checked): release
        # each of the session's holds of it (pg_advisory_unlock releases one). In a failed
        # transaction nothing can run, and a closed connection's locks went with it.
        raw = self.connection.connection
        if raw is None or raw.closed:
            return
        pgconn = raw.pgconn
        if pgconn.transaction_status == _ACTIVE:
            self._cancel(raw, pgconn, pgconn.socket)
        if raw.closed or pgconn.transaction_status in (_ACTIVE, _INERROR):
            return
        try:
            self.release_every_hold(db_key, shared=shared)
        except Exception:
            logger.warning(
                "Releasing lock %s, granted as its wait was interrupted, failed: closing its "
                "connection, which releases it.",
                self.display_key(db_key),
                exc_info=True,
            )
            raw.close()

    def server_session(self) -> tuple[int, int]:
        # The pid the lock statements ran on (each returns it), else the one of libpq's
        # connection (psycopg's documented ConnectionInfo.backend_pid). A pid names a
        # session on one server only: after a failover or a restart, another session of
        # the server then answering may have it. So the server is named too, by when its
        # postmaster started (pg_postmaster_start_time(); a promoted standby keeps its own,
        # a restart makes a new one), in microseconds since the epoch (whatever the
        # session's TimeZone).
        raw = self._driver_connection()
        pid = self._pid if self._pid is not None else int(raw.info.backend_pid)
        (started,) = self._run(f"SELECT {_POSTMASTER_STARTED}".encode())
        return pid, int(started)

    def session_id(self) -> int | None:
        # The pid the lock statements ran on, else libpq's (psycopg's documented
        # ConnectionInfo.backend_pid, from the connection's start-up: no statement).
        if self._pid is not None and self.connection.connection is self._raw:
            return self._pid
        raw = self.connection.connection
        return None if raw is None else int(raw.info.backend_pid)

    def session_socket(self) -> int | None:
        # psycopg's documented Connection.fileno(): libpq's socket (PQsocket).
        raw = self.connection.connection
        return None if raw is None or raw.closed else int(raw.fileno())

    def held_by(self, db_key: Any, session: tuple[int, int]) -> bool:
        # pg_locks shows every session's locks, with its server pid (its documented "pid").
        pid, started = int(session[0]), int(session[1])
        classid, objid, objsubid = lock_row_ids(db_key)
        self._driver_connection()
        sql = (
            f"SELECT {_POSTMASTER_STARTED} = {started} AND EXISTS "
            f"(SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} AND l.pid = {pid})"
        )
        return bool(self._run(sql.format(classid, objid, objsubid).encode())[0])

    def is_held(self, db_key: Any) -> bool:
        self._driver_connection()  # first: the pid and the client must be current
        classid, objid, objsubid = lock_row_ids(db_key)
        # Held by the server session we locked on (the pid), and for us (the mark), not a
        # session a pooler lends this connection now.
        mine = _unmarked_or_ours(str(self._client))
        guard = f"pg_backend_pid() = {self._pid} AND {mine}" if self._pid else mine
        return bool(
            self._run(
                f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} "
                f"AND l.pid = pg_backend_pid()) AND {guard}".format(
                    classid, objid, objsubid
                ).encode()
            )[0]
        )

    def try_many(self, db_keys: list[Any]) -> list[bool]:
        # One statement, whatever the number of keys: each function of a select list is
        # evaluated once, and a session lock taken stays held whatever follows. Only on a
        # connection of its own (a claims connection refuses pooled aliases, see
        # session_lock_problem): no client mark to guard.
        calls = ", ".join(f"{_TRY[False]}({_args(_key_ints(key))})" for key in db_keys)
        return [bool(taken) for taken in self._run(f"SELECT {calls}".encode())]

    def release_many(self, db_keys: list[Any]) -> None:
        calls = ", ".join(f"{_UNLOCK[False]}({_args(_key_ints(key))})" for key in db_keys)
        self._run(f"SELECT {calls}".encode())

    def transaction_aborted(self) -> bool:
        raw = self.connection.connection
        return raw is not None and raw.pgconn.transaction_status == _INERROR

    def session_lock_problem(self) -> str | None:
        alias = self._alias
        if alias in POOLED_ALIASES:
            return (
                f"Session-scoped locks can't work on {self.describe()}: a transaction-mode "
                f"pooler was detected in front of it ({_FOUND_BY.get(alias, _PID_CHANGED)}). "
                f"{pooler_advice(alias)}"
            )
        if get_setting("POOL_MODE").get(alias) == "transaction":  # the base's check, inlined
            return super().session_lock_problem()
        return None

    @classmethod
    def is_outage(cls, error: BaseException) -> bool:
        sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        return sqlstate is None or str(sqlstate).startswith(_OUTAGE)  # None: no reply

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
        # Shown in pg_stat_activity, so that "who holds it" answers with the holder's process
        # and host (the server knows only its own backend pid) and a name.
        options["application_name"] = application_name(label)
        return settings_dict

    @classmethod
    def notify(cls, connection: Any, channel: str, payload: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [channel, payload])

    @classmethod
    def listener(cls, connection: Any, channel: str) -> PostgreSQLListener:
        settings_dict = cls.dedicated_settings(
            connection.settings_dict, "listener (advisory_lock)"
        )
        return PostgreSQLListener(type(connection)(settings_dict, connection.alias), channel)

    @classmethod
    def release_wait(cls, connection: Any) -> PostgreSQLReleaseWait:
        settings_dict = cls.dedicated_settings(
            connection.settings_dict, "async lock waiter (advisory_lock)"
        )
        return PostgreSQLReleaseWait(type(connection)(settings_dict, connection.alias))

    # Statements.

    def _transaction_try(self, db_key: Any, keys: tuple[int, ...], shared: bool) -> bool:
        """A transaction-scoped try, where the session carries no client mark or ours.

        A session that carries another client's mark may hold that client's session locks (a
        pooler lent it to this transaction), and PostgreSQL would grant us any of them at
        once. Only then (rare) a second statement asks pg_locks whether it holds this key: if
        not, the lock can be taken there; if so, refused.

        The statement is parsed each time (see ``_run``): the guard is written with as few
        functions and operators as can be, since each costs the parser a lookup. A reset
        mark ('', after DISCARD ALL) takes the second statement too.
        """
        function = _function(try_=True, xact=True, shared=shared)
        call = f"{function}({_args(keys)})"
        self._driver_connection()  # first: the client must be current
        mine = f"coalesce({_MARK_VALUE}, '{self._client}') = '{self._client}'"
        row = self._run(f"SELECT CASE WHEN {mine} THEN {call} END".encode(), begin=True)
        if row[0] is not None:
            return bool(row[0])
        held = (
            f"EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} AND l.pid = pg_backend_pid())"
        ).format(*lock_row_ids(db_key))
        row = self._run(f"SELECT CASE WHEN NOT {held} THEN {call} END".encode())
        if row[0] is None:
            self._pooler_found(_FOREIGN_LOCKS)
            raise NotSupportedError(
                f"No lock was taken on {self.describe()}: a transaction-mode pooler (PgBouncer) "
                f"lent this transaction a server connection that holds this lock as a session "
                f"lock of another client connection, and PostgreSQL would grant it to both. "
                f"Another client takes session locks through the pooler: declare it there "
                f"(ADVISORY_LOCK['POOL_MODE'] = {{{self.connection.alias!r}: 'transaction'}}), "
                f"so that session locks are refused before any SQL. The lock stays on that "
                f"server connection until it closes."
            )
        return bool(row[0])

    def _plain(self, function: str, keys: tuple[int, ...], *, mode: str = "mark") -> str:
        """A session statement as plain SQL (see ``_session_select``)."""
        return _session_select(
            function,
            _args(keys),
            pid="" if self._pid is None else str(self._pid),
            client=str(self._client),
            mode=mode,
        )

    def _take_over(self, function: str, keys: tuple[int, ...]) -> tuple[Any, ...]:
        """A try the guard kept from running, again: where the session carries no mark or
        ours, or another client's on a session that holds no advisory lock; else refuse."""
        row = self._on_same_server(
            self._run(self._plain(function, keys, mode="takeover").encode())
        )
        if row[0] is None:
            self._refuse()
        return row

    def _session_statement(self, function: str, keys: tuple[int, ...]) -> tuple[Any, ...]:
        """A session try or unlock. With no transaction open it runs as a statement prepared
        on the server session (parsed and planned once per session); inside a transaction
        it runs plain, since a failed prepared statement would abort the caller's
        transaction. Its row: (the function's result, None when the guard kept it from
        running; the server pid)."""
        raw = self.connection.connection
        if raw is None or raw is not self._raw:
            raw = self._driver_connection()  # what we know of the session must be current
        pgconn = raw.pgconn
        connection = self.connection
        if pgconn.transaction_status != _IDLE or (
            (connection.execute_wrappers or connection.queries_logged)
            and (connection.in_atomic_block or raw.autocommit)
        ):  # in a transaction, or self._logged(), inlined
            return self._run(self._plain(function, keys).encode())
        # Once the pid is known and the statement is prepared, its name and parameters are
        # kept per key (a bounded memory, forgotten with the session's prepared statements).
        ready = self._ready.get((function, keys))
        if ready is None:
            ready = self._prepare_session(pgconn, function, keys)
        result = pgconn.exec_prepared(*ready)
        if result.status == _TUPLES_OK:
            value = result.get_value(0, 0)
            # Columns: a boolean (NULL when the guard kept it from running), the pid.
            return (None if value is None else value == b"t", int(result.get_value(0, 1)))
        if result.error_field(_SQLSTATE) == b"26000":
            # DEALLOCATE or DISCARD ran, or a pooler moved us to another server connection:
            # run it plain, so that the pid tells which.
            self._prepared.clear()
            self._ready.clear()
            return self._run(self._plain(function, keys).encode())
        self._raise(result)

    def _prepare_session(
        self, pgconn: Any, function: str, keys: tuple[int, ...]
    ) -> tuple[bytes, list[bytes]]:
        """Prepare the session statement for ``function`` on this server session if it is
        not yet; its name and parameters for ``keys``."""
        name, statement, types = _prepared(function, len(keys) == 2, self._pid is not None)
        if name not in self._prepared:
            result = pgconn.prepare(name, statement, types)
            # 42P05: prepared on this server session by an earlier client (a pooled server
            # connection); one name stands for one statement text, so it is this one.
            if result.status != _COMMAND_OK and result.error_field(_SQLSTATE) != b"42P05":
                self._raise(result)
            self._prepared.add(name)
        ready = (name, [*self._leading, *[str(key).encode() for key in keys]])
        if self._pid is not None:  # the parameters of the guarded statement: kept
            if len(self._ready) >= 256:
                self._ready.clear()
            self._ready[function, keys] = ready
        return ready

    def _session_wait(
        self, function: str, keys: tuple[int, ...], timeout: float | None, mode: str
    ) -> tuple[Any, ...] | None:
        """A session wait (see ``_wait``). In autocommit, once the server pid is known and
        with no transaction open, it runs as a statement prepared on the server session,
        sent without blocking (libpq's ``PQsendQueryPrepared``); the wait for its result
        is a poll of the connection's socket that wakes up every ``_WAIT_INTERVAL``, so
        that Python's signal handlers run during it (``_await_result``)."""
        raw = self.connection.connection
        if raw is None or raw is not self._raw:
            raw = self._driver_connection()
        pgconn = raw.pgconn
        if (
            mode != "mark"
            or self._pid is None
            or pgconn.transaction_status != _IDLE
            or not raw.autocommit
            or self._logged()
        ):
            return self._wait(self._plain(function, keys, mode=mode), timeout)
        pair = len(keys) == 2
        name, statement, types = _prepared_wait(function, pair, timeout is not None)
        if name not in self._prepared:
            result = pgconn.prepare(name, statement, types)
            if result.status != _COMMAND_OK and result.error_field(_SQLSTATE) != b"42P05":
                self._raise(result)
            self._prepared.add(name)
        values = [*self._leading, *[str(key).encode() for key in keys]]
        if timeout is not None:
            # lock_timeout is in milliseconds, and 0 would mean "no limit".
            values.append(str(max(1, math.ceil(timeout * 1000))).encode())
        result = self._await_result(raw, pgconn, name, values)
        status = result.status
        if status == _TUPLES_OK:
            # Columns: void ('' once it ran, NULL when the guard kept it from running), pid.
            value = result.get_value(0, 0)
            return (None if value is None else "", int(result.get_value(0, 1)))
        if result.error_field(_SQLSTATE) == b"26000":
            self._prepared.clear()
            self._ready.clear()
            return self._wait(self._plain(function, keys, mode=mode), timeout)
        try:
            self._raise(result)
        except errors.LockNotAvailable:
            return None  # our lock_timeout ran out, or one set on the server

    def _await_result(self, raw: Any, pgconn: Any, name: bytes, values: list[bytes]) -> Any:
        """Send a prepared statement and wait for its result without blocking in libpq: a
        poll of the socket with a timeout, so that the signal handlers of the main thread
        run while it waits (Ctrl-C, SIGTERM, the watchdog's SIGINT), even for a signal
        delivered to another thread. Whatever a handler raises is raised from here once
        the statement is cancelled (psycopg's ``cancel_safe()``) and its result consumed,
        so that the connection is left idle, as psycopg's own wait leaves it; a connection
        whose statement would not end is closed."""
        try:
            pgconn.send_query_prepared(name, values)
        except errors.Error as error:
            self._failed(error)
        socket_fd = pgconn.socket
        try:
            return _result(pgconn, socket_fd, None)
        except errors.Error as error:  # the connection failed
            self._failed(error)
        except BaseException:
            if pgconn.transaction_status == _ACTIVE:
                self._cancel(raw, pgconn, socket_fd)
            raise

    def _cancel(self, raw: Any, pgconn: Any, socket_fd: int) -> None:
        """Cancel the statement that an exception interrupted, and consume its result."""
        try:
            raw.cancel_safe(timeout=_CANCEL_TIMEOUT)
            _result(pgconn, socket_fd, monotonic() + _CANCEL_TIMEOUT)
        except _WaitTimeout:
            logger.warning("A lock wait was not ended by its cancel: closing its connection.")
            raw.close()
        except BaseException as error:
            # Interrupted again, or the cancel failed: the connection's state is unknown.
            logger.warning("Cancelling a lock wait failed (%r): closing its connection.", error)
            raw.close()
            if not isinstance(error, Exception):
                raise

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
            self._ready = {}
            self._client = _client_id(raw)
            self._leading = [str(self._client).encode()]
            result = raw.pgconn.exec_(b"SELECT pg_is_in_recovery()")
            if result.status != _TUPLES_OK:
                self._raw = None
                self._raise(result)
            if result.get_value(0, 0) == b"t":
                self._raw = None
                raise replica_error(self.describe(), "is a standby (pg_is_in_recovery())")
        return raw

    def _pooler_found(self, how: str) -> None:
        POOLED_ALIASES.add(self.connection.alias)
        _FOUND_BY[self.connection.alias] = how

    def _same_server(self, pid: int) -> bool:
        """Note the server pid a session statement ran on; False if it moved (a pooler)."""
        if pid == self._pid:
            return True
        if self._pid is None:
            self._pid = pid
            self._leading = [str(pid).encode(), *self._leading]
            return True
        self._pooler_found(_PID_CHANGED)
        return False

    def _on_same_server(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """``row`` of a session try or wait, if it ran on our server session (its pid noted
        if it is the first); ``NotSupportedError`` if a pooler moved us to another one: the
        guard kept it from locking anything there."""
        if not self._same_server(row[1]):
            raise NotSupportedError(self.session_lock_problem())
        return row

    def _refuse(self) -> NoReturn:
        """The server session holds advisory locks and another client's mark: a pooler lent
        it to us between that client's transactions. Nothing was locked (the guard)."""
        self._pooler_found(_FOREIGN_LOCKS)
        raise NotSupportedError(self.session_lock_problem())


class PostgreSQLListener(Listener):
    """LISTEN on a session of its own. PostgreSQL delivers a notification to every session
    that listens on its channel when the transaction that sent it commits (never one that
    rolled back), in the order they committed, and holds them for a session while it is
    busy; psycopg's documented libpq layer (``pgconn``) reads them as they arrive."""

    def __init__(self, connection: Any, channel: str) -> None:
        self.connection = connection
        self.channel = channel

    def open(self) -> None:
        self.connection.ensure_connection()
        raw = self.connection.connection
        raw.autocommit = True  # LISTEN takes effect when its transaction commits
        raw.execute(f'LISTEN "{self.channel}"')

    def receive(self, timeout: float, also: Sequence[int] = ()) -> list[str]:
        raw = self.connection.connection
        pgconn = raw.pgconn
        try:
            payloads = _notifications(pgconn)
            if (
                not payloads
                and raw.fileno() in select.select([raw.fileno(), *also], [], [], timeout)[0]
            ):
                pgconn.consume_input()  # an error if the server closed the connection
                payloads = _notifications(pgconn)
        except errors.Error as error:
            with self.connection.wrap_database_errors:
                raise error
        if pgconn.status != pq.ConnStatus.OK:
            raise DatabaseError("The listening connection is lost.")
        return payloads

    def close(self) -> None:
        raw = self.connection.connection
        if raw is not None:
            raw.close()


def _notifications(pgconn: Any) -> list[str]:
    payloads = []
    while (notification := pgconn.notifies()) is not None:
        payloads.append(notification.extra.decode())
    return payloads


class PostgreSQLReleaseWait(ReleaseWait):
    """An async waiter's wait inside the server (see ``ReleaseWait``), in a line.

    A waiter gets in line in a transaction of its own: ``pg_advisory_xact_lock(line)``, a key
    derived from the lock's (``line_key``), held until ``leave_line()`` commits. In line, each
    wait is ``pg_advisory_xact_lock(key)`` (shared for a shared lock) in a savepoint that is
    rolled back as soon as it is granted, which releases it (PostgreSQL releases the locks a
    rolled-back subtransaction took). PostgreSQL queues lock requests first come, first
    served, and refuses a request, even a try, that conflicts with one queued before it: so the
    async waiters of every process come to the lock one at a time, in the order they came, and
    while one waits for it no newcomer's try takes it ahead of them. A first wait is one round
    trip (BEGIN, the line, the savepoint, the wait, its rollback in one query string), as is
    each later one and the commit that leaves the line. A lock_timeout or a cancel aborts the
    transaction: it is rolled back, which leaves the line. The line is held by a transaction,
    never by the session, so a transaction-mode pooler keeps it on one server connection and
    finds nothing left on it afterwards.
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        # Its statements run in one thread at a time, not always the same one.
        connection.inc_thread_sharing()
        self.in_line = False
        self.interrupted = False

    def wait(self, db_key: Any, *, shared: bool, timeout: float | None) -> bool:
        keys = db_key if isinstance(db_key, tuple) else (db_key,)
        wait = f"SELECT {_function(xact=True, shared=shared)}({_args(keys)})"
        if timeout is None:
            limit = "'0'"  # 0: no limit
        else:
            # lock_timeout bounds each lock wait: the lock's wait gets what the line's left,
            # counted from the query string's arrival (statement_timestamp()), in milliseconds.
            milliseconds = max(1, math.ceil(timeout * 1000))
            limit = (
                f"greatest(1, {milliseconds} - (1000 * extract(epoch from clock_timestamp() "
                f"- statement_timestamp()))::bigint)::text"
            )
        # set_config(..., true) lasts for the transaction; a savepoint's rollback undoes it.
        query = (
            f"SAVEPOINT advisory_lock_wait; SELECT set_config('lock_timeout', {limit}, true); "
            f"{wait}; ROLLBACK TO SAVEPOINT advisory_lock_wait"
        )
        if not self.in_line:
            line = f"SELECT pg_advisory_xact_lock({line_key(db_key)})"
            query = f"BEGIN; SELECT set_config('lock_timeout', {limit}, true); {line}; {query}"
        raw = self._raw()
        if self.interrupted:  # before its statement could be cancelled
            raise errors.QueryCanceled("The wait was interrupted.")
        try:
            raw.execute(query)
        except errors.Error as error:
            self.in_line = False
            if raw.pgconn.transaction_status == _INERROR:
                raw.execute("ROLLBACK")  # out of the line
            if isinstance(error, errors.LockNotAvailable):
                return False
            raise
        self.in_line = True
        return True

    def leave_line(self) -> None:
        if self.in_line:
            self.in_line = False
            self._raw().execute("COMMIT")

    def interrupt(self) -> None:
        self.interrupted = True
        raw = self.connection.connection
        if raw is not None:
            raw.cancel()  # psycopg: may be called from another thread

    def close(self) -> None:
        # The driver's close, not Django's (which refuses to run in an event loop's thread):
        # this connection object is dropped with it.
        raw = self.connection.connection
        if raw is not None:
            raw.close()

    def _raw(self) -> Any:
        self.connection.ensure_connection()
        raw = self.connection.connection
        if not raw.autocommit:
            raw.autocommit = True  # AUTOCOMMIT=False in the settings: its BEGIN is ours
        return raw


def line_key(db_key: int | tuple[int, int]) -> int:
    """The key of the line in which async waiters wait for ``db_key``: a bigint derived from
    it, as unlikely to be another lock's key as two hashed names are to collide."""
    digest = hashlib.sha256(f"advisory_lock line {db_key!r}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _begin(raw: Any) -> bytes | None:
    """The BEGIN psycopg sends for ``raw``: plain, or None when it adds options (an isolation
    level, read only, deferrable) that we leave psycopg to write."""
    if raw.isolation_level is None and raw.read_only is None and raw.deferrable is None:
        return b"BEGIN"
    return None


def _key_ints(db_key: Any) -> tuple[int, ...]:
    return db_key if type(db_key) is tuple else (db_key,)


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
#: When the server's postmaster started, in microseconds since the epoch: a bigint.
_POSTMASTER_STARTED = "(extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint"
#: When a pg_stat_activity row's backend started, in microseconds since the epoch.
_BACKEND_STARTED = "(extract(epoch FROM backend_start) * 1000000)::bigint"
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

    def list_locks(self, known: dict[Any, str], names_table: str | None = None) -> Listing:
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
                        else Holder(pid, BACKEND_PID)
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

    def session_started(self, sessions: list[int] | None) -> dict[int, int]:
        # pg_stat_activity's backend_start, in microseconds since the epoch: a pid is reused
        # only by a backend started later.
        sql = f"SELECT pid, {_BACKEND_STARTED} FROM pg_stat_activity WHERE pid IS NOT NULL"
        with self.connection.cursor() as cursor:
            if sessions is None:
                cursor.execute(sql)
            else:
                cursor.execute(f"{sql} AND pid = ANY(%s)", [list(sessions)])
            return {int(pid): int(started) for pid, started in cursor.fetchall()}

    def terminate(self, holder_id: int) -> None:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [holder_id])

    def insert_returning_pk(
        self, cursor: Any, sql: str, params: Sequence[Any], pk_column: str
    ) -> int:
        # psycopg's lastrowid is the row's OID, which a table without OIDs does not have:
        # the key comes back in the statement's own answer.
        cursor.execute(f"{sql} RETURNING {pk_column}", params)
        return int(cursor.fetchone()[0])

    def database_now(self) -> datetime.datetime:
        now: datetime.datetime
        with self.connection.cursor() as cursor:
            # The UTC wall time, a timestamp without time zone, which the driver reads naive
            # whatever the session's time zone and Django's USE_TZ. (A timestamptz comes back
            # naive in the session's time zone, TIME_ZONE, with USE_TZ = False: astimezone()
            # would take it for this process's local time, which settings.configure() does
            # not set, and which repeats an hour when DST ends.)
            cursor.execute("SELECT statement_timestamp() AT TIME ZONE 'UTC'")
            (now,) = cursor.fetchone()
        return now.replace(tzinfo=datetime.timezone.utc)


def _holder(row: Any) -> Holder:
    pid, user, application, client, backend_start, xact_start, state, query = row
    process_id, process_host = holder_process(application or "")
    return Holder(
        id=pid,
        kind=BACKEND_PID,
        user=user,
        application_name=application,
        client_addr=client or "local socket",
        since=backend_start,
        transaction_start=xact_start,
        state=state,
        query=query,
        process_id=process_id,
        process_host=process_host,
    )


# The application_name of a dedicated lock connection: "pid=<pid> host=<host> <label>".
# PostgreSQL keeps 63 bytes of it (NAMEDATALEN - 1); the process comes first, so that a cut
# loses only the end of the label. A host is followed by a space: one cut short has none.
_APPLICATION_PROCESS = re.compile(r"pid=([0-9]{1,10}) (?:host=(\S+) )?")


def application_name(label: str) -> str:
    """The application_name of a connection that holds a lock for ``label``, in this
    process: ``pid=<OS pid> host=<host name> <label>``, cut to PostgreSQL's 63 bytes."""
    name = f"pid={os.getpid()} host={socket.gethostname()} {label}"
    return name.encode()[:63].decode(errors="ignore")


def holder_process(application: str) -> tuple[int | None, str | None]:
    """(OS pid, host name) of the process that ``application_name()`` wrote ``application``
    for; the host is None if the cut took part of it, both None for another program's."""
    match = _APPLICATION_PROCESS.match(application)
    if match is None:
        return None, None
    return int(match[1]), match[2]


def reset_pooled_connection(connection: Any) -> None:
    """``OPTIONS["pool"]["reset"]`` for Django's PostgreSQL pool: drop every advisory lock
    a borrower left on a connection before the next borrower gets it."""
    connection.execute("SELECT pg_advisory_unlock_all()")
    if connection.info.transaction_status != _IDLE:
        connection.rollback()
