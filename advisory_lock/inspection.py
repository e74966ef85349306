"""Who holds which advisory lock: ``held_locks()``, for the admin page and ``advisory_locks``."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError
from django.db import connections
from django.db import transaction

from advisory_lock import directory
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.backends.base import BACKEND_PID
from advisory_lock.backends.base import CONNECTION_ID
from advisory_lock.backends.base import PROCESS_ID
from advisory_lock.backends.base import Holder
from advisory_lock.backends.base import LockInspector
from advisory_lock.backends.base import LockRow
from advisory_lock.conf import get_setting
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.keys import recent_names
from advisory_lock.validation import check_alias


@dataclass(frozen=True)
class HeldLock:
    """One advisory lock held or awaited, its name if known, and its holder."""

    db_key: Any
    #: The registered or recently used name that maps to ``db_key``, if any.
    name: str | None
    #: ``db_key`` as people read it (SQLite: the file name).
    key_text: str
    mode: str
    granted: bool
    holder: Holder | None
    held_for: float | None = None
    waited_for: float | None = None

    @property
    def holder_id(self) -> int | None:
        """The id to terminate: PostgreSQL's pid, MySQL's connection id, SQLite's pid."""
        return None if self.holder is None else self.holder.id

    @property
    def pid(self) -> int | None:
        """PostgreSQL's backend pid (the server's process), or SQLite's holding process."""
        kind = self.holder.kind if self.holder else None
        return self.holder_id if kind in (BACKEND_PID, PROCESS_ID) else None

    @property
    def connection_id(self) -> int | None:
        return self.holder_id if self.holder and self.holder.kind == CONNECTION_ID else None

    @property
    def process(self) -> str | None:
        """The holding program's OS process and host, "1234 on web-3", where the database
        can tell (SQLite; PostgreSQL for this app's dedicated connections)."""
        process_id = _holder_field(self, "process_id")
        if process_id is None:
            return None
        host = _holder_field(self, "process_host")
        return f"{process_id} on {host}" if host else str(process_id)

    # What the holder's session shows, for the templates.
    user = property(lambda self: _holder_field(self, "user"))
    application_name = property(lambda self: _holder_field(self, "application_name"))
    client_addr = property(lambda self: _holder_field(self, "client_addr"))
    host = property(lambda self: _holder_field(self, "host"))
    backend_start = property(lambda self: _holder_field(self, "since"))
    state = property(lambda self: _holder_field(self, "state"))
    query = property(lambda self: _holder_field(self, "query"))
    process_id = property(lambda self: _holder_field(self, "process_id"))
    process_host = property(lambda self: _holder_field(self, "process_host"))

    def as_dict(self) -> dict[str, Any]:
        document = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "holder"
        }
        document["holder"] = None if self.holder is None else dataclasses.asdict(self.holder)
        document["holder_id"] = self.holder_id
        return document


def _holder_field(lock: HeldLock, name: str) -> Any:
    return None if lock.holder is None else getattr(lock.holder, name)


class HeldLocks(list[HeldLock]):
    """The locks, and where the database got them from (``source``), with a ``note``."""

    def __init__(self, locks: list[HeldLock], *, using: str, source: str, note: str) -> None:
        super().__init__(locks)
        self.using, self.source, self.note = using, source, note


def held_locks(using: str | None = None) -> HeldLocks:
    """The advisory locks held and awaited on the database ``using`` (default: "default").

    Each lock's name and its holder's process come from the database where it keeps them
    (SQLite's lock files; the application_name of our dedicated connections on PostgreSQL),
    else from the lock directory that the holders write (``advisory_lock.directory``).
    """
    using = check_alias(using)
    connection = connections[using]
    backend = backend_for(connection)
    inspector = inspector_for(connection)
    names: dict[Any, str] = {}
    for name, key in known_keys(using).items():
        with contextlib.suppress(ValueError, TypeError):
            names.setdefault(backend.db_key(make_key(key)), name)
    tables = directory.tables
    listing = inspector.list_locks(names, None if tables is None else tables.names_table)
    recorded_names: dict[str, str] = {}
    clients: dict[int, tuple[str, int]] = {}
    if tables is not None and listing.rows:
        recorded_names, clients = _directory(tables, inspector, using, listing.rows)
    locks = [
        HeldLock(
            db_key=row.db_key,
            name=names.get(row.db_key) or row.name or recorded_names.get(str(row.db_key)),
            key_text=backend.display_key(row.db_key),
            mode=row.mode,
            granted=row.granted,
            holder=_with_process(row.holder, clients),
            held_for=row.held_for,
            waited_for=row.waited_for,
        )
        for row in listing.rows
    ]
    return HeldLocks(locks, using=using, source=listing.source, note=listing.note)


def _directory(
    tables: directory.Tables, inspector: LockInspector, using: str, rows: list[LockRow]
) -> tuple[dict[str, str], dict[int, tuple[str, int]]]:
    """What the lock directory knows of ``rows``: ``{str(db_key): name}`` and ``{session:
    (host, pid)}``; nothing when its tables are not migrated on ``using``."""
    sessions = {
        row.holder.id
        for row in rows
        if row.holder is not None
        and row.holder.kind != PROCESS_ID
        and row.holder.process_id is None
    }
    connection = connections[using]
    # A failed read in a transaction (ATOMIC_REQUESTS) is rolled back to a savepoint:
    # PostgreSQL refuses every later statement of a transaction after a failed one.
    savepoint = (
        transaction.atomic(using=using) if connection.in_atomic_block else contextlib.nullcontext()
    )
    try:
        with savepoint:
            unnamed = [str(row.db_key) for row in rows if row.name is None]
            found = tables.names(using, unnamed) if unnamed else {}
            clients = (
                tables.clients(using, inspector.session_started(sorted(sessions)))
                if sessions
                else {}
            )
    except DatabaseError:
        return {}, {}
    return found, clients


def _with_process(holder: Holder | None, clients: dict[int, tuple[str, int]]) -> Holder | None:
    """``holder`` with its client process, if the lock directory knows its session."""
    if holder is None or holder.process_id is not None or holder.id not in clients:
        return holder
    host, pid = clients[holder.id]
    return dataclasses.replace(holder, process_id=pid, process_host=host)


def find_lock_session(using: str, holder_id: int) -> HeldLock | None:
    """The lock that ``holder_id`` holds or waits for on ``using`` now, or None: only such a
    session may be terminated from the admin."""
    if not inspector_for(connections[using]).may_terminate(holder_id):
        return None
    # The same live list the locks page shows (with the names it knows, which is all some
    # MySQL servers can be asked about).
    return next((lock for lock in held_locks(using) if lock.holder_id == holder_id), None)


def registered_keys() -> dict[str, Any]:
    """Names declared up front: ADVISORY_LOCK["NAMES"] and single-instance commands' keys.

    ``NAMES`` is a list of string keys, or a dict of names to keys (a str, an int or an int
    pair), which names keys that other code takes by number, e.g. ``{"legacy-import": 42}``.
    """
    from advisory_lock.single_instance import declared_lock_names

    configured = get_setting("NAMES")
    keys = dict(configured) if isinstance(configured, dict) else {n: n for n in configured}
    for name in declared_lock_names():
        keys.setdefault(name, name)
    return keys


def known_keys(using: str | None = None) -> dict[str, Any]:
    """Every name this process knows, with its key: the registered ones, the locks of the
    ledger's recent runs, and names used in this process lately."""
    keys = registered_keys()
    # The ledger may not be on this database (or not migrated there). In a transaction
    # (ATOMIC_REQUESTS), its failed read is rolled back to a savepoint: PostgreSQL refuses
    # every later statement of a transaction after a failed one, the locks' listing included,
    # until the transaction or a savepoint is rolled back.
    connection = connections[check_alias(using)]
    savepoint = (
        transaction.atomic(using=connection.alias)
        if connection.in_atomic_block
        else contextlib.nullcontext()
    )
    with contextlib.suppress(DatabaseError, LookupError), savepoint:
        keys.update((name, key) for name, key in ledger_keys(using).items() if name not in keys)
    for name in recent_names():
        keys.setdefault(name, name)
    return keys


def ledger_keys(using: str | None = None, recent: int = 1000) -> dict[str, LockKey]:
    """The locks that guard the ledger's most recent runs, by name."""
    from advisory_lock.models import JobRun

    runs = JobRun.objects.using(check_alias(using)).exclude(lock_key="")
    keys = {}
    for identity in runs.order_by("-started_at").values_list("lock_key", flat=True)[:recent]:
        with contextlib.suppress(ValueError, TypeError, ImproperlyConfigured):
            key = LockKey.from_identity(identity)
            keys[key.value if isinstance(key.value, str) else identity] = key
    return keys
