"""Who holds which advisory lock: ``held_locks()``, for the admin page and ``advisory_locks``."""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db import DatabaseError

from advisory_lock.backends import backend_for
from advisory_lock.conf import get_setting
from advisory_lock.keys import make_key
from advisory_lock.keys import recent_names


@dataclass
class HeldLock:
    """One advisory lock held or awaited, and what the database tells of its holder."""

    db_key: Any
    name: str | None
    mode: str
    key_text: str
    granted: bool
    pid: int | None = None
    connection_id: int | None = None
    user: str | None = None
    application_name: str | None = None
    client_addr: str | None = None
    host: str | None = None
    backend_start: Any = None
    transaction_start: Any = None
    state: str | None = None
    query: str | None = None
    held_for: float | None = None
    waited_for: float | None = None

    @property
    def holder_id(self) -> int | None:
        """The id to terminate: PostgreSQL's pid, MySQL's connection id, SQLite's pid."""
        return self.pid if self.pid is not None else self.connection_id

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class HeldLocks(list[HeldLock]):
    """The locks, and where the database got them from (``source``), with a ``note``."""

    def __init__(self, locks: list[HeldLock], *, using: str, source: str, note: str) -> None:
        super().__init__(locks)
        self.using, self.source, self.note = using, source, note


def held_locks(using: str | None = None) -> HeldLocks:
    """The advisory locks held and awaited on the database ``using`` (default: "default")."""
    using = using or DEFAULT_DB_ALIAS
    backend = backend_for(using)
    names = {}
    for name, key in known_keys(using).items():
        with contextlib.suppress(ValueError, TypeError):
            names.setdefault(backend.db_key(make_key(key)), name)
    source, note, rows = backend.list_locks(names)
    locks = [
        HeldLock(
            name=names.get(_hashable(row["db_key"])),
            key_text=backend.display_key(row["db_key"]),
            **row,
        )
        for row in rows
    ]
    return HeldLocks(locks, using=using, source=source, note=note)


def registered_keys() -> dict[str, Any]:
    """Names declared up front: ADVISORY_LOCK["NAMES"] and single-instance commands' keys.

    ``NAMES`` is a list of string keys, or a dict of names to keys (a str, an int or an int
    pair), which names keys that other code takes by number, e.g. ``{"legacy-import": 42}``.
    """
    from advisory_lock.commands import declared_lock_names

    configured = get_setting("NAMES")
    keys = dict(configured) if isinstance(configured, dict) else {n: n for n in configured}
    for name in declared_lock_names():
        keys.setdefault(name, name)
    return keys


def known_keys(using: str | None = None) -> dict[str, Any]:
    """Every name this process knows, with its key: the registered ones, the ledger's
    recent jobs, and names used in this process lately."""
    keys = registered_keys()
    with contextlib.suppress(DatabaseError, LookupError):
        for name in ledger_lock_names(using):
            keys.setdefault(name, name)
    for name in recent_names():
        keys.setdefault(name, name)
    return keys


def ledger_lock_names(using: str | None = None, recent: int = 1000) -> list[str]:
    """The locks held by the ledger's most recent runs (``run_once`` and commands)."""
    from advisory_lock.models import JobRun

    runs = JobRun.objects.using(using or DEFAULT_DB_ALIAS).order_by("-started_at")[:recent]
    names = set()
    for job_name, lock_key in runs.values_list("job_name", "lock_key"):
        names.add(lock_key or f"job:{job_name}")
    return sorted(names)


def _hashable(db_key: Any) -> Any:
    return tuple(db_key) if isinstance(db_key, list) else db_key
