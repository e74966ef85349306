"""The registry of lock backends: one module per database, one interface (``base.LockBackend``)."""

from __future__ import annotations

import threading
from asyncio import _get_running_loop

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string

from advisory_lock.backends.base import LockBackend
from advisory_lock.exceptions import NotSupportedError

# Django's ``connection.vendor`` → the backend class that implements locks for it.
BACKENDS: dict[str, str] = {
    "postgresql": "advisory_lock.backends.postgresql.PostgreSQLBackend",
    "mysql": "advisory_lock.backends.mysql.MySQLBackend",
    "sqlite": "advisory_lock.backends.sqlite.SQLiteBackend",
}


def get_backend(connection: BaseDatabaseWrapper) -> LockBackend:
    """Return the lock backend bound to ``connection``, created on first use."""
    try:
        return connection._advisory_lock_backend
    except AttributeError:
        pass
    try:
        backend_class = import_string(BACKENDS[connection.vendor])
    except KeyError:
        raise NotSupportedError(
            f"Database alias {connection.alias!r} uses {connection.settings_dict['ENGINE']!r} "
            f"(vendor {connection.vendor!r}), which django-advisory-lock does not support. "
            f"Use PostgreSQL, MySQL/MariaDB or SQLite for locks (pass using=...)."
        ) from None
    backend = connection._advisory_lock_backend = backend_class(connection)
    return backend


# django.db.connections keeps each thread's connections in an asgiref Local(thread_critical=True).
# In a thread with no running event loop that Local reads and writes a plain threading.local,
# but it learns that the thread is sync by raising and catching a RuntimeError through three
# Python calls: with 8 processes contending on one CPU (cold caches), 4 µs of CPU per try, of
# the 20 µs that a whole failed `with advisory_lock(...)` cost (getrusage in the processes).
# So in a sync thread we read that same threading.local ourselves; in an async context, or
# if a version of asgiref or Django stores connections differently, we ask connections[alias].
_CONNECTIONS_LOCAL = getattr(connections, "_connections", None)
_SYNC_STORAGE = vars(_CONNECTIONS_LOCAL).get("_storage") if _CONNECTIONS_LOCAL else None
if not isinstance(_SYNC_STORAGE, threading.local):
    _SYNC_STORAGE = None


def backend_for(alias: str) -> LockBackend:
    """The lock backend of ``connections[alias]``: this thread's (or async context's)
    connection for ``alias``."""
    if (
        _SYNC_STORAGE is not None
        and _get_running_loop() is None
        and connections._connections is _CONNECTIONS_LOCAL
    ):
        try:
            connection = getattr(_SYNC_STORAGE, alias)
        except AttributeError:  # not made in this thread yet: connections[] makes it, or
            connection = connections[alias]  # names the bad alias
    else:
        connection = connections[alias]
    try:
        return connection._advisory_lock_backend
    except AttributeError:
        return get_backend(connection)
