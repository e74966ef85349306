"""Notifications between the processes of a fleet, where the database has them
(PostgreSQL's LISTEN/NOTIFY).

Operators' requests (pause, resume, run now) are announced on the channel ``advisory_lock``
(``notify``); a scheduler listens (``Listening``) and acts at once instead of at its next
poll. A notification is a shortcut, never the only way: a scheduler still polls, and one that
can't listen (another database, a lost connection, a transaction-mode pooler in the way) just
polls. The ends of runs are not announced: a scheduler looks at the clock and the ledger at
every pass, 5 times a second, so it acts on a slot's end within 0.2 s without a NOTIFY.

- PostgreSQL delivers a notification to every listening session when the transaction that
  sent it commits, and never one that rolled back: a request is heard once its row is there.
- NOTIFY serialises the commits of the transactions that send one: only an operator's
  request sends one.
- At most one listening connection per process and alias (a scheduler is alone in its
  process), opened at the first wait, on the alias that reaches the database directly
  (``DIRECT_ALIAS``): a transaction-mode pooler would hand the listening session to other
  clients between transactions, and the notifications to nobody. An alias declared behind
  one (``POOL_MODE``) without a direct alias is not listened on (system check W002).
- A lost connection is logged once (by the caller, unless a database outage explains it),
  the process polls meanwhile, and a new one is tried after ``RECONNECT_AFTER`` seconds;
  notifications sent while it was down are lost, so a new connection is reported as a
  notification of its own (``LISTENING``): poll now.
"""

from __future__ import annotations

import logging
import time
from time import monotonic

from django.db import connections

from advisory_lock.backends import backend_class
from advisory_lock.backends.base import Listener
from advisory_lock.conf import get_setting
from advisory_lock.dedicated import direct_alias

logger = logging.getLogger("advisory_lock")

CHANNEL = "advisory_lock"
RECONNECT_AFTER = 1.0
#: What ``Listening.wait`` returns when a listening connection was (re)opened.
LISTENING = "listening:"
#: The kind of notification: an operator's request for an entry.
CONTROL = "control"


def notify(using: str, kind: str, job_name: str) -> None:
    """Tell the listeners of ``using``'s database that ``kind`` happened to ``job_name``,
    when the current transaction commits (at once in autocommit)."""
    connection = connections[using]
    backend_class(connection).notify(connection, CHANNEL, f"{kind}:{job_name}")


def listening_problem(alias: str) -> str | None:
    """Why a process can't listen on ``alias``'s database, or None."""
    direct = direct_alias(alias)
    if get_setting("POOL_MODE").get(direct) == "transaction":
        return (
            f"ADVISORY_LOCK['POOL_MODE'] declares database alias {direct!r} behind a "
            f"transaction-mode pooler, which would hand the listening session to other clients"
        )
    return None


class Listening:
    """The notifications of ``using``'s database, for one process: waits for them."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listener: Listener | None = None
        self.unavailable = False  # this database has no notifications, or can't be listened on
        self.retry_at = 0.0
        self.failing = False  # said once per run of failures
        self.unsaid: Exception | None = None  # a failure not yet said (see say_failure)

    def wait(self, seconds: float) -> list[str]:
        """Wait at most ``seconds`` for notifications, and return their payloads (``kind:job
        name``, or ``LISTENING``); without a listener, sleep ``seconds`` and return none."""
        listener = self.listener
        if listener is None:
            if self._open():
                return [LISTENING]
            time.sleep(seconds)
            return []
        try:
            return listener.receive(seconds)
        except Exception as error:  # the connection is lost: poll until a new one is up
            self.close()
            self._failed(error)
            return []

    def close(self) -> None:
        if self.listener is not None:
            try:
                self.listener.close()
            except Exception:  # closing a broken connection may fail; it is gone either way
                logger.debug("Closing the listening connection failed.", exc_info=True)
            self.listener = None

    def _open(self) -> bool:
        if self.unavailable or monotonic() < self.retry_at:
            return False
        if problem := listening_problem(self.using):
            logger.warning("Not listening for notifications: %s; polling.", problem)
            self.unavailable = True
            return False
        connection = connections[direct_alias(self.using)]
        listener = backend_class(connection).listener(connection, CHANNEL)
        if listener is None:
            self.unavailable = True
            return False
        try:
            listener.open()
        except Exception as error:
            self.listener = listener
            self.close()
            self._failed(error)
            return False
        self.listener = listener
        if self.failing:
            self.failing = False
            logger.info("Listening for notifications on database %r again.", self.using)
        return True

    def say_failure(self) -> None:
        """Log the failure of the last wait or connection, once per run of failures. The
        caller says when: a failure that a database outage explains is the outage's to say
        (``forget_failure``)."""
        if self.unsaid is not None:
            logger.warning(
                "Listening for notifications on database %r failed (%s); polling meanwhile, "
                "trying again every %gs.",
                self.using,
                self.unsaid,
                RECONNECT_AFTER,
            )
            self.unsaid = None

    def forget_failure(self) -> None:
        self.unsaid = None

    def _failed(self, error: Exception) -> None:
        self.retry_at = monotonic() + RECONNECT_AFTER
        if not self.failing:
            self.failing = True
            self.unsaid = error
