"""SQLite: an OS file lock (``flock``) per key, in a folder beside the database file.

``flock`` locks belong to an open file description, so two threads with their own open files
exclude each other just as two processes do, and the OS drops a dead process's locks. They
work on one host only. The lock is not tied to the SQLite connection, so this backend counts
repeated holds itself, and releases transaction-scoped holds when Django ends the
transaction.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from advisory_lock.backends.base import LockBackend
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import AdvisoryLockError
from advisory_lock.keys import LockKey
from advisory_lock.keys import shorten

MAX_FILE_NAME_LENGTH = 120
_POLL_START = 0.001
_POLL_MAX = 0.05


@dataclass
class _Hold:
    """One open lock file and how often this holder took it in each mode."""

    fd: int
    exclusive: int = 0
    shared: int = 0


class SQLiteBackend(LockBackend):
    vendor = "sqlite"
    single_host = True

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        self._holds: dict[str, _Hold] = {}

    def lock_dir(self) -> Path:
        """``ADVISORY_LOCK["LOCK_DIR"]``, else ``<database file>.locks`` (temp dir in memory)."""
        configured = get_setting("LOCK_DIR")
        if configured:
            return Path(configured)
        if self.connection.is_in_memory_db():
            return Path(tempfile.gettempdir()) / f"advisory_lock-{os.getuid()}"
        return Path(f"{os.path.abspath(self.connection.settings_dict['NAME'])}.locks")

    def db_key(self, key: LockKey) -> str:
        name = shorten(key.identity, MAX_FILE_NAME_LENGTH, forbidden="/")
        return str(self.lock_dir() / f"{name}.lock")

    def display_key(self, db_key: Any) -> str:
        return os.path.basename(db_key)

    def holder_token(self) -> object:
        # The file lock does not depend on the SQLite connection staying open.
        return self

    def acquire(
        self, db_key: Any, *, shared: bool, transaction: bool, timeout: float | None
    ) -> bool:
        hold = self._holds.get(db_key)
        if hold is not None:
            if shared or hold.exclusive:
                # A holder may take again what it holds, and shared under its exclusive.
                self._count(hold, shared, +1)
                return True
            raise AdvisoryLockError(
                f"Lock file {db_key} is held shared by this connection of {self.describe()}; "
                f"SQLite's file locks can't upgrade it to exclusive without letting go. "
                f"Release the shared hold first."
            )
        fd = self._open(db_key)
        if not self._flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, timeout):
            os.close(fd)
            return False
        hold = self._holds[db_key] = _Hold(fd)
        self._count(hold, shared, +1)
        if not shared:
            _write_holder(fd)
        return True

    def release(self, db_key: Any, *, shared: bool, after_rollback: bool = False) -> bool:
        hold = self._holds.get(db_key)
        if hold is None or not (hold.shared if shared else hold.exclusive):
            return False
        self._count(hold, shared, -1)
        if not hold.exclusive and not hold.shared:
            del self._holds[db_key]
            os.close(hold.fd)  # closing the last descriptor drops the flock
        elif not hold.exclusive:
            fcntl.flock(hold.fd, fcntl.LOCK_SH)  # exclusive holds are gone: keep it shared
        return True

    def release_all(self) -> None:
        for hold in self._holds.values():
            os.close(hold.fd)
        self._holds.clear()
        self.session_holds.clear()

    def discard_connection(self) -> None:
        self.connection.close()  # the file locks are not on the connection: nothing to drop

    def is_held(self, db_key: Any) -> bool:
        hold = self._holds.get(db_key)
        if hold is None:
            return False
        # Held for as long as the file we lock is the one at the path (not deleted, replaced).
        try:
            return os.stat(db_key).st_ino == os.fstat(hold.fd).st_ino
        except OSError:
            return False

    def list_locks(self, names: dict[Any, str]) -> tuple[str, str, list[dict[str, Any]]]:
        """Lock files in the lock folder, with the flock holders that /proc/locks shows."""
        folder = self.lock_dir()
        files = {}
        if folder.is_dir():
            for path in folder.glob("*.lock"):
                with contextlib.suppress(OSError):
                    files[os.stat(path).st_ino] = str(path)
        flocks = _kernel_flocks()
        if flocks is None:
            return "lock files", "This OS does not tell which process holds a file lock.", []
        locks = []
        for inode, pid, exclusive, waiting in flocks:
            if inode not in files:
                continue
            holder = self._recorded_holder(files[inode], pid) or {}
            locks.append(
                {
                    "db_key": files[inode],
                    "mode": "exclusive" if exclusive else "shared",
                    "granted": not waiting,
                    "pid": pid,
                    "host": holder.get("host"),
                    "backend_start": holder.get("since"),
                    "held_for": holder.get("held_for") if not waiting else None,
                }
            )
        return "/proc/locks", "", locks

    def terminate(self, holder_id: int) -> None:
        os.kill(holder_id, signal.SIGTERM)

    def database_now(self) -> datetime.datetime:
        # SQLite is a file on this host: its clock is this host's.
        return datetime.datetime.now(datetime.timezone.utc)

    def holder(self, db_key: Any) -> dict[str, Any] | None:
        """Who holds the lock file: the kernel's lock table names the pid, the file the rest.

        The record in the file is written just after the ``flock`` is taken, so a busy instance
        can read it a moment too early (empty, or the previous holder's); the kernel's pid is
        never stale.
        """
        try:
            inode = os.stat(db_key).st_ino
        except OSError:
            return None
        flocks = _kernel_flocks()
        if flocks is None:
            return self._recorded_holder(db_key, None)
        holders = [
            (not exclusive, pid)
            for lock_inode, pid, exclusive, waiting in flocks
            if lock_inode == inode and not waiting
        ]
        if not holders:
            return None
        pid = min(holders)[1]  # the exclusive holder when there is one
        return self._recorded_holder(db_key, pid) or {"pid": pid, "host": socket.gethostname()}

    @staticmethod
    def _recorded_holder(db_key: str, pid: int | None) -> dict[str, Any] | None:
        """The record in the lock file, if it is that of ``pid`` (any pid when ``None``)."""
        try:
            with open(db_key) as lock_file:
                text = lock_file.readline()
        except OSError:
            return None
        fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
        if not fields.get("pid", "").isdigit() or pid not in (None, int(fields["pid"])):
            return None
        holder: dict[str, Any] = {"pid": int(fields["pid"]), "host": fields.get("host")}
        with contextlib.suppress(KeyError, ValueError):
            since = datetime.datetime.fromisoformat(fields["since"])
            holder["since"] = since
            holder["held_for"] = (
                datetime.datetime.now(datetime.timezone.utc) - since
            ).total_seconds()
        return holder

    def held_count(self) -> int:
        """How many lock files this holder has open (for tests and inspection)."""
        return len(self._holds)

    @staticmethod
    def _count(hold: _Hold, shared: bool, step: int) -> None:
        if shared:
            hold.shared += step
        else:
            hold.exclusive += step

    @staticmethod
    def _open(path: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)

    @staticmethod
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


def _write_holder(fd: int) -> None:
    """Record who holds an exclusive lock in its file, so that a busy instance can say."""
    since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = f"pid={os.getpid()} host={socket.gethostname()} since={since}\n".encode()
    # Write, then cut: a reader never sees an empty file, only the first line is read.
    os.pwrite(fd, record, 0)
    os.ftruncate(fd, len(record))


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
