"""What a database outage is, to a scheduler: the errors after which the same pass may
succeed later (see ``scheduling.scheduler``, "A database outage"); and what a refusal to lock
is: a database in reach that takes no lock now (a replica, or a primary that a failover
demoted) and may take them again without a restart."""

from __future__ import annotations

from collections.abc import Iterator

from django.db import utils

from advisory_lock.backends import driver_error_is_outage
from advisory_lock.exceptions import ReplicaError


def is_outage(error: BaseException) -> bool:
    """Does ``error`` mean that the database is out of reach (down, restarting, the network
    cut), so that the same pass may succeed later? Django's ``InterfaceError`` and
    ``OperationalError`` (and the drivers' own: PEP 249 names them alike), unless the
    driver's code says that the statement itself failed (MySQL's unknown column, a statement
    timeout); the socket's errors; and any error whose cause (``raise ... from``) is one.
    Anything else is a bug, or a statement the database refuses: not an outage."""
    for cause in _chain(error):
        verdict = _says_outage(cause)
        if verdict is not None:
            return verdict
    return False


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then its cause (``raise ... from``), its cause's, and so on (a loop once)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__


def _says_outage(error: BaseException) -> bool | None:
    """True or False if ``error`` tells whether the database is out of reach; None if it
    doesn't (its cause may)."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    names = {cls.__name__ for cls in type(error).__mro__}
    if "InterfaceError" in names:
        return True  # the connection is closed, or unusable
    if "OperationalError" not in names:
        return False if isinstance(error, utils.Error) else None
    if isinstance(error, utils.OperationalError) and error.__cause__ is not None:
        return None  # Django's wrapper: the driver's error says which
    # The driver's own error: its backend knows which of its codes mean "out of reach".
    return driver_error_is_outage(error)


def is_refusal(error: BaseException) -> bool:
    """Does ``error`` say that the database can't take locks now, though in reach? A
    ``ReplicaError`` (the server is read-only: a replica, or a primary demoted by a failover,
    which a new connection may no longer reach: libpq's ``target_session_attrs=read-write``
    and a proxy's health check lead it to the new primary), or an error caused by one."""
    return any(isinstance(cause, ReplicaError) for cause in _chain(error))
