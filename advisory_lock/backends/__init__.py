"""The registry of database backends: one module per database, each with a ``LockBackend``
(locking) and a ``LockInspector`` (who holds what). Adding a database means adding a module
and a line to ``BACKENDS``."""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils.module_loading import import_string

from advisory_lock.backends.base import LockBackend
from advisory_lock.backends.base import LockInspector
from advisory_lock.exceptions import NotSupportedError

# Django's ``connection.vendor`` → the module that implements locks for it.
BACKENDS: dict[str, str] = {
    "postgresql": "advisory_lock.backends.postgresql.PostgreSQL",
    "mysql": "advisory_lock.backends.mysql.MySQL",
    "sqlite": "advisory_lock.backends.sqlite.SQLite",
}


# A driver's top-level module → the vendor whose backend knows its errors.
DRIVERS: dict[str, str] = {
    "psycopg": "postgresql",
    "psycopg2": "postgresql",
    "MySQLdb": "mysql",
    "pymysql": "mysql",
    "sqlite3": "sqlite",
}


def driver_error_is_outage(error: BaseException) -> bool:
    """Does a driver's OperationalError mean that the database is out of reach for now (so
    that a retry may succeed), rather than that the statement failed? Its backend says;
    for a driver we don't know, PEP 249's meaning of OperationalError: yes."""
    vendor = DRIVERS.get(type(error).__module__.partition(".")[0])
    if vendor is None:
        return True
    backend: type[LockBackend] = import_string(BACKENDS[vendor] + "Backend")
    return backend.is_outage(error)


def backend_class(connection: BaseDatabaseWrapper) -> type[LockBackend]:
    """The ``LockBackend`` class for ``connection``'s database; NotSupportedError if none."""
    return import_string(_path(connection) + "Backend")  # type: ignore[no-any-return]


def backend_for(connection: BaseDatabaseWrapper) -> LockBackend:
    """A lock backend for ``connection``. The locks taken through Django's connections use
    the one that ``locks.connection_locks()`` keeps per connection object."""
    return backend_class(connection)(connection)


def inspector_for(connection: BaseDatabaseWrapper) -> LockInspector:
    """What can tell who holds which lock on ``connection``'s database."""
    inspector: LockInspector = import_string(_path(connection) + "Inspector")(connection)
    return inspector


def is_supported(connection: BaseDatabaseWrapper) -> bool:
    return connection.vendor in BACKENDS


def _path(connection: BaseDatabaseWrapper) -> str:
    try:
        return BACKENDS[connection.vendor]
    except KeyError:
        raise NotSupportedError(
            f"Database alias {connection.alias!r} uses {connection.settings_dict['ENGINE']!r} "
            f"(vendor {connection.vendor!r}), which django-advisory-lock does not support. "
            f"Use PostgreSQL, MySQL/MariaDB or SQLite for locks (pass using=...)."
        ) from None
