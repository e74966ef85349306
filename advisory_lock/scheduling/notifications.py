"""Notifications between the processes of a fleet, where the database has them
(PostgreSQL's LISTEN/NOTIFY).

Operators' requests (pause, resume, run now) and the changes of the stored schedule entries
are announced on the channel ``advisory_lock`` (``notify``); a scheduler listens
(``Listening``) and acts at once instead of at its next poll. A notification is a shortcut,
never the only way: a scheduler still polls, and one that can't listen (another database, a
lost connection, a transaction-mode pooler in the way) just polls (once a minute while it
hears them). The ends of runs are not announced: a scheduler
looks at its clock at every pass, 5 times a second, and at the ledger for the slots due and
not yet settled, so it acts on a slot's end within 0.2 s without a NOTIFY.

- PostgreSQL delivers a notification to every listening session when the transaction that
  sent it commits, and never one that rolled back: a request is heard once its row is there.
- NOTIFY serialises the commits of the transactions that send one: only an operator's
  request (or change of a stored entry) sends one.
- At most one listening connection per process and alias (a scheduler is alone in its
  process), opened at the first wait, on the alias that reaches the database directly
  (``DIRECT_ALIAS``): a transaction-mode pooler would hand the listening session to other
  clients between transactions, and the notifications to nobody (PgBouncer drops what a
  server connection receives while no client is linked to it). An alias declared behind one
  (``POOL_MODE``) without a direct alias is not listened on (system check W002).
- An undeclared pooler is found out by its effect: once its LISTEN has committed, a new
  listening connection sends a test notification (``PROBE``) from the process's own
  connection, another server session, and counts as listening only once it has heard it
  (it is then reported, ``LISTENING``). Its LISTEN, committed, is registered before the test
  notification commits, so a direct connection hears it (within milliseconds). Behind a
  transaction-mode pooler it never arrives, whatever the size of the pool: the listening
  client sends nothing after its LISTEN, so no server connection is ever linked to it. No
  statement could tell instead: with one server connection in the pool every statement
  reaches the listening session, which holds the LISTEN. Not heard within ``PROBE_WAIT``,
  the process says so once and never listens on that alias again. Until a listener has
  heard its probe, ``deaf`` is true: the caller polls for requests every second.
- A lost connection is logged once (by the caller, unless a database outage explains it),
  the process polls meanwhile, and a new one is tried after ``RECONNECT_AFTER`` seconds;
  notifications sent while it was down are lost, so a new connection is reported as a
  notification of its own (``LISTENING``): poll now.
"""

from __future__ import annotations

import logging
import secrets
import select
from collections.abc import Sequence
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
#: The kind of notification: a stored schedule entry was saved or deleted
#: (``scheduling.stored``): the schedulers read the stored entries again.
SCHEDULE_CHANGED = "schedule"
#: The kind of notification: a new listening connection's test that it hears (``kind:token``).
PROBE = "probe"
#: How long, in seconds, a new listening connection may take to hear its test notification
#: before the process takes it for deaf (a transaction-mode pooler in between). A guard, far
#: above need: the process polls every second meanwhile, so only the warning waits for it.
PROBE_WAIT = 10.0


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


def unheard_advice(alias: str) -> str:
    """What to do when ``alias``'s listening connection hears nothing (a pooler found)."""
    direct = direct_alias(alias)
    if direct != alias:
        return (
            f"Point ADVISORY_LOCK['DIRECT_ALIAS'][{alias!r}] at an alias that reaches the "
            f"database without the pooler: the scheduler listens there."
        )
    return (
        f"Declare the pooler (ADVISORY_LOCK['POOL_MODE'] = {{{alias!r}: 'transaction'}}) and "
        f"set ADVISORY_LOCK['DIRECT_ALIAS'] = {{{alias!r}: <an alias that reaches the "
        f"database without the pooler>}}: the scheduler listens there, and its job processes "
        f"take their session locks there."
    )


class Listening:
    """The notifications of ``using``'s database, for one process: waits for them."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.listener: Listener | None = None
        self.unavailable = False  # this database has no notifications, or can't be listened on
        self.retry_at = 0.0
        self.failing = False  # said once per run of failures
        self.unsaid: Exception | None = None  # a failure not yet said (see say_failure)
        self.probe = ""  # the token of the listener's test notification
        self.probe_until = 0.0  # time.monotonic() after which it is taken for deaf
        self.hears = False  # the listener has heard its test notification
        self._silent: bool | None = None  # the database has no notifications at all

    @property
    def deaf(self) -> bool:
        """True while the database announces requests and this process does not hear them
        (not listening yet, its test not heard yet, a pooler in the way, a lost connection):
        the caller then polls for them every second. False where the database has no
        notifications: polling is all there is, at the caller's pace."""
        if self._silent is None:
            connection = connections[direct_alias(self.using)]
            self._silent = not backend_class(connection).notifications
        return not (self._silent or (self.listener is not None and self.hears))

    @property
    def hearing(self) -> bool:
        """True while a listening connection is up and has heard its test notification: the
        caller hears requests at once, and polls only as a fallback."""
        return self.listener is not None and self.hears

    def wait(self, seconds: float, also: Sequence[int] = ()) -> list[str]:
        """Wait at most ``seconds`` for notifications, and return their payloads (``kind:job
        name``, or ``LISTENING`` once a new listening connection has heard its test);
        without a listener, wait ``seconds`` and return none. Either wait ends sooner once
        a file descriptor of ``also`` is readable (a scheduler's workers' answers)."""
        listener = self.listener
        if listener is None:
            if not self._open():
                select.select(also, [], [], seconds)
                return []
            listener = self.listener
            assert listener is not None
        try:
            payloads = listener.receive(seconds, also)
        except Exception as error:  # the connection is lost: poll until a new one is up
            self.close()
            self._failed(error)
            return []
        return self._sorted_out(payloads)

    def close(self) -> None:
        self.hears = False
        if self.listener is not None:
            try:
                self.listener.close()
            except Exception:  # closing a broken connection may fail; it is gone either way
                logger.debug("Closing the listening connection failed.", exc_info=True)
            self.listener = None

    def _sorted_out(self, payloads: list[str]) -> list[str]:
        """``payloads`` without the test notifications (every listener of the database hears
        every process's), and ``LISTENING`` if ours is among them; a listener that has not
        heard ours in ``PROBE_WAIT`` seconds is deaf: said, and closed for good."""
        heard = []
        for payload in payloads:
            kind, _, token = payload.partition(":")
            if kind != PROBE:
                heard.append(payload)
            elif token == self.probe and not self.hears:
                self.hears = True
                heard.append(LISTENING)
        if not self.hears and monotonic() >= self.probe_until:
            logger.warning(
                "Listening for notifications on database alias %r hears nothing: its test "
                "notification did not arrive in %gs. A transaction-mode pooler (PgBouncer) in "
                "between does that: it hands the listening session to other clients between "
                "transactions, and drops the notifications. Not listening; polling for "
                "operators' requests every second instead. %s",
                direct_alias(self.using),
                PROBE_WAIT,
                unheard_advice(self.using),
            )
            self.close()
            self.unavailable = True
        return heard

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
        self.listener = listener
        try:
            listener.open()
            # From another session (this process's own connection): after the LISTEN has
            # committed, so a listening session that the notifications reach hears it.
            self.probe = secrets.token_hex(8)
            notify(self.using, PROBE, self.probe)
        except Exception as error:
            self.close()
            self._failed(error)
            return False
        self.probe_until = monotonic() + PROBE_WAIT
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
