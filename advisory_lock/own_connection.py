"""The app's own writes on a connection of their own, committed at once.

The ledger's rows (``job_runs``) and the fencing tokens (``lock_fences``) must commit whatever
transaction the caller is in: a claim that a rollback undid would let a second run in, a token
that a rollback gave back would be issued twice. Django gives each thread connections of its
own, in autocommit: ``on_own_connection`` runs a write in a short-lived thread (or, in a
process that runs job after job, on the caller's connection when it is in no transaction, else
in one kept thread: ``keep_ledger_connection``). ``write`` adds what every such write needs:
the tests' ``LEDGER_IN_CALLERS_TRANSACTION``, and ``LedgerNotMigrated`` when the app's tables
are missing (``table_checked``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import TypeVar

from django.apps import apps
from django.db import DEFAULT_DB_ALIAS
from django.db import DatabaseError
from django.db import OperationalError
from django.db import ProgrammingError
from django.db import connections
from django.db import transaction

from advisory_lock.backends import driver_error_is_outage
from advisory_lock.conf import get_setting
from advisory_lock.exceptions import LedgerNotMigrated

T = TypeVar("T")


def write(using: str, func: Callable[[], T], timeout: float | None = None) -> T:
    """Run the ledger's ``func`` on a connection of its own (see ``on_own_connection``), or,
    with ``ADVISORY_LOCK["LEDGER_IN_CALLERS_TRANSACTION"]`` (for tests: see
    ``advisory_lock.testing``), in a savepoint of the caller's transaction, so that a test's
    rollback takes the ledger's rows with it. A database without the ledger's table raises
    ``LedgerNotMigrated`` (see ``table_checked``)."""
    if get_setting("LEDGER_IN_CALLERS_TRANSACTION"):
        # Checked after the savepoint is rolled back: PostgreSQL answers nothing in a
        # transaction that a failed statement aborted.
        with table_checked(using), transaction.atomic(using=using):
            return func()

    def checked() -> T:
        # In the thread whose connection failed (the caller's may be in a transaction).
        with table_checked(using):
            return func()

    if _keeping and timeout is None and _outside_transactions(using):
        return checked()
    return on_own_connection(checked, timeout=timeout)


def _outside_transactions(using: str) -> bool:
    """Is this thread's connection to ``using`` in autocommit, in no transaction? Then each
    statement on it commits at once (Django's autocommit is the driver's: PEP 249's
    ``autocommit`` attribute), which is all that a write on a connection of its own buys."""
    connection = connections[using]
    return not connection.in_atomic_block and connection.get_autocommit()


@contextlib.contextmanager
def table_checked(using: str) -> Iterator[None]:
    """Raise ``LedgerNotMigrated``, which says to run ``migrate``, when a statement of the
    block fails because the ledger's table is missing on ``using``.

    The table is looked for only after a failure (Django's introspection: SQLite's "no such
    table" is an OperationalError, PostgreSQL's and MySQL's a ProgrammingError), never before
    the ledger's statements; an error that means the database is out of reach is left as it
    is (asking again would only wait as long).
    """
    try:
        yield
    except (OperationalError, ProgrammingError) as error:
        if isinstance(error, OperationalError) and driver_error_is_outage(
            error.__cause__ or error
        ):
            raise
        if _table_missing(using):
            migrate = "manage.py migrate"
            if using != DEFAULT_DB_ALIAS:
                migrate += f" --database {using}"
            raise LedgerNotMigrated(
                f"The ledger's tables ({', '.join(_app_tables())}) do not all exist on "
                f"database {using!r}: the advisory_lock app's migrations are not applied "
                f"there. Run '{migrate}', then try again."
            ) from error
        raise


def _table_missing(using: str) -> bool:
    """Does the database ``using`` say that it lacks a table of the app (the ledger's, or the
    control room's: ``job_controls``, ``job_schedulers``)? False if it has them all, or does
    not answer (then the caller's error stands)."""
    connection = connections[using]
    wanted = set(_app_tables())
    try:
        with connection.cursor() as cursor:
            return not wanted <= set(connection.introspection.table_names(cursor))
    except DatabaseError:
        return False


def _app_tables() -> list[str]:
    return sorted(
        model._meta.db_table for model in apps.get_app_config("advisory_lock").get_models()
    )


#: Whether this process keeps its ledger connections (see ``keep_ledger_connection``).
_keeping = False
#: The thread that then runs the ledger's writes that can't go on the caller's connection,
#: and the connections it opened with it; made at its first write.
_kept: concurrent.futures.ThreadPoolExecutor | None = None


def keep_ledger_connection() -> None:
    """From now on, this process's ledger writes open no connection each: for a process that
    runs job after job (a scheduler's worker). A write goes on the calling thread's own
    connection when that one is in autocommit, in no transaction (it commits at once there
    as well), and has no time bound; any other runs in one thread that keeps its
    connections, instead of a new thread (and so a new connection) each. That thread's
    connections are its own, as a short-lived thread's are, and hold no lock; they are
    closed after a write that failed, and reopen at the next."""
    global _keeping
    _keeping = True


def close_kept_connection() -> None:
    """Close the connections of the thread that runs this process's ledger writes, if it
    has one (they reopen at the next write)."""
    if _kept is not None:
        _kept.submit(connections.close_all).result()


def _kept_thread() -> concurrent.futures.ThreadPoolExecutor:
    global _kept
    if _kept is None:
        _kept = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="advisory_lock-ledger")
    return _kept


def _on_kept_connection(func: Callable[[], T], timeout: float | None) -> T:
    def target() -> T:
        try:
            return func()
        except BaseException:
            connections.close_all()  # the next write starts on fresh connections
            raise

    future = _kept_thread().submit(target)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        # The thread waits on a silent database: left to it, and a new one for what follows.
        global _kept
        _kept = None
        raise TimeoutError(f"the database did not answer within {timeout:g}s") from None


def on_own_connection(func: Callable[[], T], timeout: float | None = None) -> T:
    """Run ``func`` in a short-lived thread: Django gives a thread connections of its own,
    in autocommit, so what it writes commits at once whatever transaction the caller is in.
    (In a process that keeps its ledger connection, in that one thread instead.)"""
    if _keeping:
        return _on_kept_connection(func, timeout)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = func()
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            connections.close_all()

    # Bounded: a daemon thread, left behind if the database does not answer in time.
    thread = threading.Thread(
        target=target, name="advisory_lock-ledger", daemon=timeout is not None
    )
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"the database did not answer within {timeout:g}s")
    if "error" in outcome:
        raise outcome["error"]
    value: T = outcome["value"]
    return value
