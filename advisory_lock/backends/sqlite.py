"""SQLite: an OS file lock (``flock``) per key, in a private folder beside the database file.

``flock`` locks belong to an open file description: two threads with their own open files
exclude each other as two processes do, and the OS drops a dead process's locks. They work
on one host only, and they are not tied to the SQLite connection, so this backend counts
repeated holds itself. A released key's file is removed, so the folder holds only the files
of locks in use; the folder must not be cleaned by hand while processes hold locks (a new
file at a held lock's path would let a second holder in).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import signal
import socket
import stat
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from advisory_lock.backends.base import PROCESS_ID
from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import Listing
from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.keys import LockKey
from advisory_lock.keys import shorten

MAX_FILE_NAME_LENGTH = 120
_POLL_START = 0.001
_POLL_MAX = 0.05
_OUTAGE = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_CANTOPEN", "SQLITE_IOERR")
_OUTAGE_MESSAGES = (
    "database is locked",
    "database table is locked",
    "unable to open database",
    "disk i/o error",
)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
# Folders found private to this user in this process (checked once each).
_checked_folders: set[str] = set()


@dataclass
class _File:
    """One open lock file and how often this holder took it in each mode."""

    fd: int
    exclusive: int = 0
    shared: int = 0


class SQLiteBackend(LockBackend):
    vendor = "sqlite"
    single_host = True
    local_locks = True

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        self._files: dict[str, _File] = {}
        # The identity of each key whose file name is shortened with a hash (recent ones):
        # the lock file records it, for the inspector.
        self._identities: dict[str, str] = {}

    @classmethod
    def is_outage(cls, error: BaseException) -> bool:
        # No server: only a busy or unreachable file ("no such table" is an
        # OperationalError too, and no outage).
        name = getattr(error, "sqlite_errorname", None)  # Python 3.11+
        if name is not None:
            return str(name).startswith(_OUTAGE)
        return str(error).lower().startswith(_OUTAGE_MESSAGES)

    def db_key(self, key: LockKey) -> str:
        name = shorten(key.identity, MAX_FILE_NAME_LENGTH, forbidden="/")
        path = os.path.join(lock_folder(self.connection), f"{name}.lock")
        if name != key.identity:
            if len(self._identities) >= 1024:
                self._identities.clear()
            self._identities[path] = key.identity
        return path

    def display_key(self, db_key: str) -> str:
        return os.path.basename(db_key)

    def session(self) -> object:
        # The file locks live in this backend, not on the SQLite connection.
        return self

    def acquire(
        self, db_key: Any, *, shared: bool, timeout: float | None, transaction: bool
    ) -> bool:
        # Django's own check: inside a running event loop this raises SynchronousOnlyOperation
        # (a wait here would block the loop), as it does for the server backends.
        self.connection.ensure_connection()
        held = self._files.get(db_key)
        if held is not None:
            if shared or held.exclusive:
                # A holder may take again what it holds, and shared under its exclusive.
                _count(held, shared, +1)
                return True
            raise AdvisoryLockError(
                f"Lock file {db_key} is held shared by this connection of {self.describe()}; "
                f"SQLite's file locks can't upgrade it to exclusive without letting go. "
                f"Release the shared hold first."
            )
        fd = _lock_file(db_key, shared, timeout, self._identities.get(db_key))
        if fd is None:
            return False
        try:
            held = _File(fd)
            _count(held, shared, +1)
        except BaseException:  # a signal handler's exception, before the file was recorded
            os.close(fd)  # the flock goes with its descriptor
            raise
        self._files[db_key] = held
        return True

    def undo_interrupted_acquire(self, db_key: Any, *, shared: bool) -> None:
        # Recorded in _files (each release() takes one count off), and no hold of this
        # connection holds it (the caller checked).
        while db_key in self._files and self.release(db_key, shared=shared):
            pass

    def release(self, db_key: Any, *, shared: bool) -> bool:
        held = self._files.get(db_key)
        if held is None or not (held.shared if shared else held.exclusive):
            return False
        _count(held, shared, -1)
        if held.exclusive or held.shared:
            if not held.exclusive:
                fcntl.flock(held.fd, fcntl.LOCK_SH)  # the exclusive holds are gone
            return True
        del self._files[db_key]
        _unlock_file(db_key, held.fd)
        return True

    def end_session(self) -> None:
        files, self._files = self._files, {}
        for path, held in files.items():
            _unlock_file(path, held.fd)

    def is_held(self, db_key: Any) -> bool:
        held = self._files.get(db_key)
        # Held for as long as the file we lock is the one at the path (not removed by hand).
        return held is not None and _same_file(db_key, held.fd)

    def held_count(self) -> int:
        """How many lock files this holder has open."""
        return len(self._files)


def lock_folder(connection: Any) -> str:
    """``ADVISORY_LOCK["LOCK_DIR"]``, else ``<database file>.locks`` (for an in-memory database,
    a folder of this user's in the temp dir), checked to be private to this user."""
    configured = get_setting("LOCK_DIR")
    if configured:
        folder: str = os.path.abspath(configured)
    elif connection.is_in_memory_db():
        folder = os.path.join(tempfile.gettempdir(), f"advisory_lock-{os.geteuid()}")
    else:
        folder = f"{os.path.abspath(connection.settings_dict['NAME'])}.locks"
    if folder not in _checked_folders:
        _check_private(folder)
        _checked_folders.add(folder)
    return folder


def _check_private(folder: str) -> None:
    """Create ``folder`` (0700) or accept it only if it is a directory of this user's that
    nobody else can write to: anyone who can write there could plant files or links."""
    parent = os.path.dirname(folder)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symbolic link is refused too)"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"
    elif info.st_mode & 0o022:
        problem = f"can be written by its group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem:
        raise ImproperlyConfigured(
            f"SQLite lock folder {folder} {problem}. Lock files must live in a folder private "
            f"to this user: remove it (no lock is held there), fix it with chmod 700, or set "
            f"ADVISORY_LOCK['LOCK_DIR'] to another folder."
        )


def _lock_file(
    path: str, shared: bool, timeout: float | None, identity: str | None = None
) -> int | None:
    """Open and flock the file at ``path``: its descriptor, or None if busy or timed out.
    The holder's record in it names the key's ``identity`` when its file name is shortened.

    A releaser removes the file while it still holds it exclusively, so a waiter can get the
    lock of a file that is no longer at ``path``: it then tries again with the file there
    now. Whatever goes wrong after the open (a signal, a failed write), the file is closed,
    which drops the lock.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        except FileNotFoundError:  # the folder was removed: check it (and make it) again
            _checked_folders.discard(os.path.dirname(path))
            _check_private(os.path.dirname(path))
            _checked_folders.add(os.path.dirname(path))
            fd = os.open(path, _OPEN_FLAGS, 0o600)
        try:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, left):
                os.close(fd)
                return None
            if not _same_file(path, fd):
                os.close(fd)
                continue
            _write_holder(fd, identity)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _unlock_file(path: str, fd: int) -> None:
    """Remove the file if no one else holds it (we hold it exclusively), then close it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # other shared holders: the file stays for them
    else:
        if _same_file(path, fd):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)  # closing the last descriptor drops the flock


def _flock(fd: int, operation: int, timeout: float | None) -> bool:
    if timeout is None:
        fcntl.flock(fd, operation)
        return True
    deadline = time.monotonic() + timeout
    interval = _POLL_START
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(interval, left))
            interval = min(interval * 2, _POLL_MAX)


def _same_file(path: str, fd: int) -> bool:
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (opened.st_dev, opened.st_ino)


def _count(held: _File, shared: bool, step: int) -> None:
    if shared:
        held.shared += step
    else:
        held.exclusive += step


def _write_holder(fd: int, identity: str | None) -> None:
    """Record who holds the lock in its file, so that a busy instance and the inspector can
    say, and the key's identity when the file name does not tell it (percent-encoded: one
    line, no spaces). Shared holders each write theirs: every write is one ``pwrite`` of a
    whole line from offset 0, so the first line is always one holder's whole record."""
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    named = "" if identity is None else f" key={urllib.parse.quote(identity, safe='')}"
    record = f"pid={os.getpid()} host={socket.gethostname()} since={since}{named}\n".encode()
    # Write, then cut: a reader never sees an empty file, and reads only the first line.
    os.pwrite(fd, record, 0)
    os.ftruncate(fd, len(record))


class SQLiteInspector(LockInspector):
    def holder(self, db_key: Any) -> Holder | None:
        """The kernel's lock table names the pid; the file's record the rest.

        The record is written just after the ``flock`` is taken, so a busy instance can read
        it a moment too early (empty); the kernel's pid is never stale.
        """
        try:
            inode = os.stat(db_key).st_ino
        except OSError:
            return None
        flocks = _kernel_flocks()
        if flocks is None:
            return _recorded_holder(db_key, None)
        holders = [
            (not exclusive, pid)
            for lock_inode, pid, exclusive, waiting in flocks
            if lock_inode == inode and not waiting
        ]
        if not holders:
            return None
        pid = min(holders)[1]  # the exclusive holder when there is one
        return _recorded_holder(db_key, pid) or _process(pid)

    def list_locks(self, known: dict[Any, str], names_table: str | None = None) -> Listing:
        """Lock files in the lock folder, with the flock holders that /proc/locks shows, and
        the name of each key, from the file's name or, when that is shortened, its record."""
        folder = lock_folder(self.connection)
        files = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if entry.name.endswith(".lock"):
                    with contextlib.suppress(OSError):
                        files[entry.inode()] = entry.path
        flocks = _kernel_flocks()
        if flocks is None:
            return Listing(
                "lock files", [], "This OS does not tell which process holds a file lock."
            )
        rows = []
        for inode, pid, exclusive, waiting in flocks:
            if inode not in files:
                continue
            record = _record(files[inode])
            holder = _holder_of(record, pid) or _process(pid)
            held_for = None
            if not waiting and holder.since is not None:
                held_for = (
                    datetime.datetime.now(datetime.timezone.utc) - holder.since
                ).total_seconds()
            rows.append(
                LockRow(
                    db_key=files[inode],
                    mode="exclusive" if exclusive else "shared",
                    granted=not waiting,
                    holder=holder,
                    held_for=held_for,
                    name=_name_of(files[inode], record),
                )
            )
        return Listing("/proc/locks", rows)

    def may_terminate(self, holder_id: int) -> bool:
        # A holder is a process here: never init, this process, or its parent (that would
        # stop the server itself), nor a process group (0 or a negative id).
        return holder_id > 1 and holder_id not in (os.getpid(), os.getppid())

    def terminate(self, holder_id: int) -> None:
        os.kill(holder_id, signal.SIGTERM)

    def database_now(self) -> datetime.datetime:
        # SQLite is a file on this host: its clock is this host's.
        return datetime.datetime.now(datetime.timezone.utc)

    @contextlib.contextmanager
    def writer_from_the_start(self, table: str) -> Iterator[None]:
        # SQLite allows one writer per database file. A transaction that has read and then
        # writes gets SQLITE_BUSY at once if another connection writes, without calling the
        # busy handler (sqlite3_busy_handler: waiting could deadlock, so SQLite returns
        # "database is locked" instead). A transaction whose first statement writes waits for
        # the write lock up to the busy timeout (the ``timeout`` option), and then keeps it.
        # Any write statement takes the lock when it starts, one matching no row too (the
        # same as Django 5.1+'s OPTIONS["transaction_mode"] = "IMMEDIATE" for one block).
        with transaction.atomic(using=self.connection.alias):
            with self.connection.cursor() as cursor:
                cursor.execute(f"DELETE FROM {self.connection.ops.quote_name(table)} WHERE 0")
            yield


def _recorded_holder(path: str, pid: int | None) -> Holder | None:
    """The record in the lock file, if it is that of ``pid`` (any pid when ``None``)."""
    return _holder_of(_record(path), pid)


def _record(path: str) -> dict[str, str]:
    """The fields of the holder's record in the lock file (none if it can't be read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    with open(fd, closefd=True) as lock_file:
        text = lock_file.readline()
    return dict(item.split("=", 1) for item in text.split() if "=" in item)


def _name_of(path: str, record: dict[str, str]) -> str | None:
    """The string key a lock file is for: its record's ``key``, else its file name when that
    is the key's identity as it is (``namespace:name``; not shortened with a hash)."""
    identity = urllib.parse.unquote(record["key"]) if "key" in record else None
    if identity is None:
        identity = os.path.basename(path).removesuffix(".lock")
        if "~" in identity:  # shortened (keys.shorten's mark): the record did not say
            return None
    if identity.startswith("#"):
        return None  # an int key: it has no name
    _namespace, separator, name = identity.partition(":")
    return name if separator else None


def _holder_of(fields: dict[str, str], pid: int | None) -> Holder | None:
    """The holder a record names, if it is ``pid`` (any pid when ``None``)."""
    if not fields.get("pid", "").isdigit() or pid not in (None, int(fields["pid"])):
        return None
    since = None
    with contextlib.suppress(KeyError, ValueError):
        since = datetime.datetime.fromisoformat(fields["since"])
    return _process(int(fields["pid"]), host=fields.get("host"), since=since)


def _process(pid: int, host: str | None = None, since: datetime.datetime | None = None) -> Holder:
    """A holder that is a process: /proc/locks lists the flocks of this host's processes."""
    host = host or socket.gethostname()
    return Holder(pid, PROCESS_ID, host=host, since=since, process_id=pid, process_host=host)


def _kernel_flocks() -> list[tuple[int, int, bool, bool]] | None:
    """``(inode, pid, exclusive, waiting)`` per ``flock`` in /proc/locks; ``None`` off Linux."""
    try:
        with open("/proc/locks") as proc_locks:
            lines = proc_locks.read().splitlines()
    except OSError:
        return None
    flocks = []
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters have a "->" before it.
        fields = line.replace("->", " -> ").split()
        waiting = "->" in fields
        fields = [field for field in fields if field != "->"]
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].isdigit():
            continue
        inode = int(fields[5].rsplit(":", 1)[1])
        flocks.append((inode, int(fields[4]), fields[3] == "WRITE", waiting))
    return flocks
