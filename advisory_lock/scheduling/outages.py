"""What a database outage is, to a scheduler: the errors after which the same pass may
succeed later (see ``scheduling.scheduler``, "A database outage"); what a refusal to lock
is: a database in reach that takes no lock now (a replica, or a primary that a failover
demoted) and may take them again without a restart; and how a scheduler paces its tries and
says an outage (``Outage``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from django.db import utils

from advisory_lock.backends import driver_error_is_outage
from advisory_lock.exceptions import ReplicaError

logger = logging.getLogger("advisory_lock")
#: The longest wait, in seconds, between two tries of a scheduler while the database is out
#: of reach: a scheduler is back at most this long after its database.
RETRY_CAP = 3.0
_RETRY_FIRST = 0.2  # seconds between the first failed pass of an outage and the next try


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


class Outage:
    """The outage of the database ``using`` that a scheduler is riding out, if any: since
    when, the wait before its next try, and whether it is a refusal to lock."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.since: float | None = None  # time.monotonic() of its first failed pass
        self.retry_in = 0.0
        self.refused = False  # a refusal to lock (``is_refusal``), not out of reach

    def failed(self, error: Exception) -> float:
        """A pass failed with ``error``: warn at the start of the outage, and return how
        long to wait before the next try: ``_RETRY_FIRST``, then twice the last wait, at
        most ``RETRY_CAP``."""
        if self.since is not None:
            self.retry_in = min(2 * self.retry_in, RETRY_CAP)
            return self.retry_in
        self.since = time.monotonic()
        self.retry_in = _RETRY_FIRST
        self.refused = is_refusal(error) and not is_outage(error)
        summary = (str(error).strip().splitlines() or [""])[0]
        logger.warning(
            "run_jobs: the database %r %s (%s: %s); no run starts until %s. "
            "Retrying, at most %gs apart.",
            self.using,
            "takes no lock now" if self.refused else "is unreachable",
            type(error).__name__,
            summary,
            "it takes locks again" if self.refused else "it is back",
            RETRY_CAP,
        )
        return self.retry_in

    def over(self) -> None:
        """A pass got through: if it ends an outage, say how long that lasted."""
        if self.since is None:
            return
        lasted = time.monotonic() - self.since
        self.since = None
        logger.info(
            "run_jobs: the database %r %s after %.1fs; scheduling again.",
            self.using,
            "takes locks again" if self.refused else "is back",
            lasted,
        )
