"""Who holds what, as the holders tell it: the name behind each database key, and the client
process (host name, OS pid) behind each server session.

The database knows only its own side of a lock: PostgreSQL's ``pg_locks`` a 64-bit number and
a backend pid, MySQL a lock name (hashed when long) and a connection id, and a MariaDB without
``performance_schema`` can only be asked about names it is given. The program that takes the
lock knows the rest. So the process tells it, once: the first time it uses a name on a
database, and the first time it locks through a server session, ``note()`` queues a line for
the directory's tables (``lock_names``, ``lock_clients``: ``advisory_lock.lock_names``), and a
thread of the process writes the queue there on a connection of its own, committed at once,
then closes that connection. The inspector (``advisory_lock.inspection``) reads them back.

Why this shape, with a budget of a few percent on an uncontended acquire + release:

- No statement on the lock's connection, ever: a write there would be a round trip per first
  use, and inside the caller's transaction it would be rolled back with it, or abort it when
  the table is missing. The lock's own statements are unchanged.
- What the hot path adds is a few attribute reads and one set lookup (``note()``): a name
  already noted, on a session already noted, costs nothing more. The set is bounded
  (``MAX_NOTED_NAMES``) so per-tenant keys can't grow it without limit; a name forgotten is
  noted again, which its row ignores.
- The session's id is read from the driver, without a statement (``LockBackend.session_id``).
  The writer asks the server when that session began (``LockInspector.session_started``), so
  that the inspector can tell it from a later session given the same id.
- SQLite needs none of it: its lock file records the holder's pid, host and the name
  (``backends.sqlite``).

A write that fails (the tables not migrated on that database, the database out of reach or
refusing another connection) is logged once, saying which, and dropped; the alias is left
alone for a while (``RETRY_AFTER``). Who holds the lock stays answerable from the database's
own tables then, as before. ``ADVISORY_LOCK["RECORD_HOLDERS"] = False`` turns the writes off.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from django.db import DatabaseError

from advisory_lock.backends.base import LockBackend
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.keys import LockKey

logger = logging.getLogger("advisory_lock")

#: Names remembered as noted, per process (then the oldest are forgotten).
MAX_NOTED_NAMES = 10_000
#: Seconds an alias whose directory tables are missing is left alone before another try.
RETRY_AFTER = 300.0
#: Seconds between a first note and its write, each note counted from its own moment: a
#: burst goes in one write, and a lock let go of sooner (a try, a short job, a process that
#: ended) is never written: it was over before anyone could look at it.
WRITE_AFTER = 1.0


@dataclass(frozen=True, slots=True)
class NameNote:
    """``key`` (``str(db_key)``) stands for the string key ``name`` in ``namespace``."""

    key: str
    name: str
    namespace: str


@dataclass(frozen=True, slots=True)
class SessionNote:
    """The server session ``session`` is this process's: ``pid`` on ``host``."""

    session: int
    host: str
    pid: int


#: Writes the notes of one alias: ``write(alias, names, sessions)``, on the calling thread's
#: connection; raises ``LedgerNotMigrated`` if the directory's tables are missing there, else
#: what the database raised.
Write = Callable[[str, list[NameNote], list[SessionNote]], None]


@dataclass(frozen=True, slots=True)
class Tables:
    """The directory's tables (``advisory_lock.lock_names``): how to write notes, and read
    them back (``names(alias, keys)``, ``clients(alias, {session: when it began})``);
    ``names_table`` is the table of names, whose ``key`` column a MySQL server without a
    lock table of its own is asked about."""

    write: Write
    names_table: str
    names: Callable[[str, list[str]], dict[str, str]]
    clients: Callable[[str, dict[int, int]], dict[int, tuple[str, int]]]


class Recorder:
    """Queues what this process tells of its locks, and writes it from a thread of its own."""

    def __init__(self, write: Write) -> None:
        self._write = write
        self._noted: dict[tuple[Any, str], None] = {}
        self._queue: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._names_lock = threading.Lock()  # guards _noted's changes
        self._thread_lock = threading.Lock()  # guards _thread: at most one writing
        # Notes queued and not yet written (or dropped), for flush().
        self._unwritten = 0
        self._written = threading.Condition()
        self._now = threading.Event()  # flush(): write without waiting for WRITE_AFTER
        self._off: dict[str, float] = {}  # alias -> when to try its tables again
        self._host = socket.gethostname()
        os.register_at_fork(after_in_child=self._forked)

    def note(
        self,
        backend: LockBackend,
        using: str,
        db_key: Any,
        key: LockKey,
        holds: Callable[[Any], bool],
    ) -> bool:
        """Note the lock about to be taken (or just taken) through ``backend``'s session; False
        when the connection is not open yet (nothing to note about the session then).

        ``holds(db_key)`` says, from the writer's thread, whether the lock is held through
        that session still (``holds(None)``: any lock): a name is written only if a lock of
        it is held ``WRITE_AFTER`` seconds after its note, a session only if it holds one
        then; otherwise the note is forgotten, to be noted again at the next use.
        """
        if backend.local_locks:
            return True  # SQLite: the lock file says it all
        session = backend.session()
        if session is None:
            return False
        if backend.noted is not session:
            self._note_session(backend, using, session, holds)
        if key.namespace is not None and (db_key, using) not in self._noted:
            self._note_name(db_key, using, key, holds)
        return True

    def _note_session(
        self, backend: LockBackend, using: str, session: object, holds: Callable[[Any], bool]
    ) -> None:
        backend.noted = session
        if backend.session_lock_problem() is not None:
            # Behind a transaction-mode pooler a server session serves every client in turn:
            # it belongs to no one process.
            return
        session_id = backend.session_id()
        if session_id is not None:
            ref = weakref.ref(backend)
            self._put(
                _Queued(
                    using,
                    SessionNote(session_id, self._host, os.getpid()),
                    functools.partial(_session_holds, ref, session, holds),
                    functools.partial(_forget_session, ref, session),
                    monotonic(),
                )
            )

    def _note_name(
        self, db_key: Any, using: str, key: LockKey, holds: Callable[[Any], bool]
    ) -> None:
        with self._names_lock:  # threads may note at once; the hot path only reads
            noted = self._noted
            if len(noted) >= MAX_NOTED_NAMES:
                noted.pop(next(iter(noted)), None)
            noted[db_key, using] = None
        assert isinstance(key.value, str) and key.namespace is not None
        self._put(
            _Queued(
                using,
                NameNote(str(db_key), key.value, key.namespace),
                functools.partial(holds, db_key),
                functools.partial(self._forget_name, db_key, using),
                monotonic(),
            )
        )

    def _forget_name(self, db_key: Any, using: str) -> None:
        with self._names_lock:
            self._noted.pop((db_key, using), None)

    def _put(self, queued: _Queued) -> None:
        with self._written:
            self._unwritten += 1
        self._queue.put(queued)
        with self._thread_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="advisory_lock directory", daemon=True
                )
                self._thread.start()

    def flush(self, timeout: float | None = None) -> bool:
        """Write every note queued so far now, and wait until it is written (or dropped);
        False on timeout."""
        with self._written:
            if self._unwritten == 0:
                # Nothing to hurry: the writer thread, which clears the event as it ends, may
                # have ended already, and the next burst's notes must wait their moment.
                return True
            self._now.set()
            return self._written.wait_for(lambda: self._unwritten == 0, timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """``flush()``, then wait for the writer thread to end (it ends by itself once the
        queue is empty); False on timeout."""
        if not self.flush(timeout):
            return False
        with self._thread_lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        """Write what is queued, then end: a thread lives only while there is work (new
        names and sessions are rare), and leaves nothing behind in the process."""
        try:
            self._drain()
        except BaseException:
            with self._thread_lock:  # the next note starts another
                if self._thread is threading.current_thread():
                    self._thread = None
            raise

    def _drain(self) -> None:
        # Notes younger than WRITE_AFTER: written once they are that old, if their lock is
        # held then (a waiter's note comes before its lock).
        waiting: list[_Queued] = []
        while True:
            # A moment first: what a burst notes goes in one write, and the notes of a lock
            # (a session, a process) let go of within it are dropped unwritten.
            if waiting:
                # Until the oldest is ripe, but a tenth of WRITE_AFTER at least: notes that
                # ripen within it go in one wake-up, not one each (a worker notes a name per
                # short run, many a second).
                ripe_in = min(q.at for q in waiting) + WRITE_AFTER - monotonic()
                self._now.wait(max(WRITE_AFTER / 10, ripe_in))
            else:
                self._now.wait(WRITE_AFTER)
            with self._thread_lock:
                # Under the lock that _put() takes after its put: either this sees the note,
                # or _put() sees no thread and starts one.
                while True:
                    try:
                        waiting.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if not waiting:
                    self._thread = None
                    self._now.clear()
                    return
            # Each note is judged at its own age, not at the moment the thread wakes (which
            # the first note of a burst set): a lock taken a moment before that, and held for
            # a moment, is as brief as one let go of already. flush() makes every note ripe.
            now, forced = monotonic(), self._now.is_set()
            ripe: list[_Queued] = []
            younger: list[_Queued] = []
            for queued in waiting:
                (ripe if forced or now - queued.at >= WRITE_AFTER else younger).append(queued)
            waiting = younger
            done = ripe
            try:
                self._write_batch(ripe)
            except BaseException:
                # The thread ends (the next note starts another): the notes still waiting go
                # with it, forgotten (noted again at their next use) and not waited for.
                for queued in waiting:
                    queued.forget()
                done, waiting = ripe + waiting, []
                raise
            finally:
                with self._written:
                    self._unwritten -= len(done)
                    self._written.notify_all()

    def _write_batch(self, batch: list[_Queued]) -> None:
        if not batch:
            return
        by_alias: dict[str, tuple[list[NameNote], list[SessionNote]]] = {}
        for queued in batch:
            if not _held(queued):
                queued.forget()  # a lock let go of already: noted again at its next use
                continue
            names, sessions = by_alias.setdefault(queued.using, ([], []))
            if isinstance(queued.note, NameNote):
                names.append(queued.note)
            else:
                sessions.append(queued.note)
        by_alias = {using: notes for using, notes in by_alias.items() if notes[0] or notes[1]}
        if not get_setting("RECORD_HOLDERS"):
            return
        for using, (names, sessions) in by_alias.items():
            if self._off.get(using, 0.0) > monotonic():
                continue
            try:
                self._write(using, names, sessions)
            except (LedgerNotMigrated, DatabaseError) as error:
                # The tables are missing (the error says to migrate), or the database is out
                # of reach or refused the writer's connection (it says why): logged once per
                # pause. The locks themselves are not affected.
                self._off[using] = monotonic() + RETRY_AFTER
                logger.warning(
                    "The lock directory could not be written on database %r: locks taken "
                    "there show without their name and client process for the next %.0f "
                    "seconds. %s",
                    using,
                    RETRY_AFTER,
                    error
                    if isinstance(error, LedgerNotMigrated)
                    else f"The database said: {error}",
                )
            except Exception:
                # Anything else (a database access refused by a test runner's guard between
                # tests): these notes are dropped, the next ones tried.
                logger.debug(
                    "The lock directory could not be written on database %r.", using, exc_info=True
                )

    def _forked(self) -> None:
        """In a child process: its own queue and thread; its sessions and names are new."""
        self._noted = {}
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._names_lock = threading.Lock()
        self._thread_lock = threading.Lock()
        self._unwritten = 0
        self._written = threading.Condition()
        self._now = threading.Event()


@dataclass(frozen=True, slots=True)
class _Queued:
    """A note as queued: its alias, itself, whether its lock is still held (asked at the
    write), how to forget it if not, and when it was noted (``monotonic()``)."""

    using: str
    note: NameNote | SessionNote
    held: Callable[[], bool]
    forget: Callable[[], None]
    at: float


def _held(queued: _Queued) -> bool:
    try:
        return queued.held()
    except Exception:  # the holder's objects are gone: so is the lock
        return False


def _session_holds(
    backend: weakref.ref[LockBackend], session: object, holds: Callable[[Any], bool]
) -> bool:
    """Is ``session`` still the one of ``backend``'s connection (not closed since), and does
    it hold a lock?"""
    alive = backend()
    try:
        return alive is not None and alive.session() is session and holds(None)
    except ReferenceError:  # its Django connection object is gone
        return False


def _forget_session(backend: weakref.ref[LockBackend], session: object) -> None:
    alive = backend()
    if alive is not None and alive.noted is session:
        alive.noted = None


#: The process's recorder and the tables it writes: set when the directory's models load
#: (the app is installed), else None.
recorder: Recorder | None = None
tables: Tables | None = None


def install(directory: Tables) -> None:
    """Start noting holders into ``directory``'s tables, and read them back from there."""
    global recorder, tables
    tables = directory
    recorder = Recorder(directory.write)
