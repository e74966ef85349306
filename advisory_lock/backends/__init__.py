"""The registry of lock backends: one module per database, one interface (``base.LockBackend``)."""

from __future__ import annotations

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
