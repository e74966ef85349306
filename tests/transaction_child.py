"""A lock holder for tests/test_transaction_end.py: ``python -m tests.transaction_child``.

``python -m tests.transaction_child --using ALIAS CASE KEY [--outer-key KEY]``

Started like tests/worker.py (see tests/processes.py), with the run's settings; it writes one
JSON object per line on stdout and reads its cues on stdin. The cyclic garbage collector is
off before Django is set up: nothing here may depend on it to release a lock.

Every case takes KEY with ``advisory_lock(KEY, using=ALIAS)`` inside
``transaction.atomic(using=ALIAS)``, so the lock is transaction-scoped (``scope="session"``
where the case says so), says ``acquired`` once its lock block is over but its transaction
is not, waits for a cue, then ends the transaction its own way and says ``ended`` (with the
exception that left the ``atomic`` block, if any). After ``ended`` it makes no further
database or lock call: it waits on stdin until EOF, then exits with ``os._exit`` (no
interpreter clean-up that could release anything). The cases:

* ``commit``: the block commits.
* ``raise``: an exception leaves the ``atomic`` block, which rolls back.
* ``set-rollback``: ``transaction.set_rollback(True)``; the block exits normally, rolling back.
* ``durable``: ``atomic(durable=True)``, left by an exception.
* ``kept-alive``: as ``raise``, but the lock object and its handle stay in a global list and
  the caught exception (with its traceback, so every frame of the block) in a local variable.
* ``failed-rollback``: says ``acquired`` with ``session``, its server's id for its connection
  (``None`` on SQLite), then waits for a cue: ``close-driver-connection`` closes the driver
  connection under Django first (what a dead server does to a server connection); anything
  else goes on as is (the test killed the session server-side); with ``unreachable`` in the
  cue, Django can't connect again either (``make_connecting_fail``). Then an exception leaves
  the ``atomic`` block: Django's rollback fails, so Django closes the connection. ``ended``
  says whether Django dropped the driver connection (``dropped``): it is then no longer the
  one Django's connection wraps (Django 5.2 opens a new one at once, in ``atomic``'s exit,
  to turn autocommit back on; when that fails, its error leaves ``atomic`` instead, with the
  block's exception in its ``__context__`` chain, which ``ended`` names as ``context``).
* ``savepoint``: takes ``--outer-key`` in the outer block, then KEY in an inner ``atomic()``
  left by an exception caught in the outer block; says ``inner_ended``, waits for a cue, then
  the outer block commits.
* ``session-aborted`` (PostgreSQL): a ``scope="session"`` lock whose block a failing
  statement ends, with the transaction aborted (25P02): the error leaves the lock block and
  the ``atomic`` block. ``ended`` says whether the exception is the very one the statement
  raised (``original``).
* ``session-aborted-savepoint`` (PostgreSQL): the same inside an inner ``atomic()``, whose
  savepoint rollback ends the failure; caught in the outer block, which says
  ``inner_ended``, waits for a cue, then commits.
* ``view-raises`` / ``view-set-rollback``: one request through Django's WSGI handler with
  ``ATOMIC_REQUESTS`` on for ALIAS, to a view that takes KEY and raises (or calls
  ``set_rollback(True)``). The one middleware says ``ended`` from ``process_exception`` (or,
  as the innermost middleware, once the view returned) and waits for a cue there, before the
  request ends; then ``responded``, and ``finished`` once ``request_finished`` was sent.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys

import django
from django.urls import path

from tests.worker import cue
from tests.worker import say

#: What user code keeps of a lock (the ``kept-alive`` case).
KEPT: list[object] = []


class Boom(Exception):
    """The exception that ends a block."""


def wait_for_eof() -> None:
    """Do nothing more, database or lock, until stdin closes; then leave at once."""
    while sys.stdin.readline():
        pass
    os._exit(0)


def failure(error: BaseException | None) -> str | None:
    return None if error is None else type(error).__name__


def contexts(error: BaseException | None) -> list[str]:
    """The type names of the exceptions ``error`` was raised while handling, innermost last."""
    names = []
    while error is not None and error.__context__ is not None:
        error = error.__context__
        names.append(type(error).__name__)
    return names


def make_connecting_fail(using: str) -> None:
    """From now on, Django's attempts to connect ``using`` fail, as when its server is down
    (SQLite: a statement Django runs on each new connection fails)."""
    from django.db import connections

    settings_dict = connections[using].settings_dict
    if connections[using].vendor == "sqlite":
        options = settings_dict["OPTIONS"]
        settings_dict["OPTIONS"] = {**options, "init_command": "SELECT * FROM no_such_table"}
        return
    with socket.socket() as unused:  # a port that nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    settings_dict.update(HOST="127.0.0.1", PORT=port)


def end_transaction(args: argparse.Namespace) -> None:
    from django.db import connections
    from django.db import transaction

    from advisory_lock import advisory_lock

    using, case = args.using, args.case
    error: BaseException | None = None
    raw = None
    try:
        with transaction.atomic(using=using, durable=case == "durable"):
            lock = advisory_lock(args.key, using=using)
            with lock as handle:
                assert handle.scope == "transaction", handle
                if case == "kept-alive":
                    KEPT.extend([lock, handle])
            session = None
            if case == "failed-rollback" and connections[using].vendor != "sqlite":
                from tests.servers import backend_id

                session = backend_id(using)
            raw = connections[using].connection  # kept: compared by identity below
            say("acquired", session=session)
            cues = cue().split()
            if "close-driver-connection" in cues:
                connections[using].connection.close()
            if "unreachable" in cues:
                make_connecting_fail(using)
            if case == "set-rollback":
                transaction.set_rollback(True, using=using)
            elif case != "commit":
                raise Boom(case)
    except Exception as caught:
        error = caught  # kept (with its traceback and frames) until this process ends
    say(
        "ended",
        error=failure(error),
        context=contexts(error),
        # Django dropped the driver connection (and may have opened a new one already).
        dropped=connections[using].connection is not raw,
        kept=len(KEPT),
    )
    wait_for_eof()


def savepoint(args: argparse.Namespace) -> None:
    from django.db import transaction

    from advisory_lock import advisory_lock

    using = args.using
    with transaction.atomic(using=using):
        with advisory_lock(args.outer_key, using=using):
            pass
        try:
            with transaction.atomic(using=using):
                with advisory_lock(args.key, using=using) as handle:
                    assert handle.scope == "transaction", handle
                say("acquired")
                cue()
                raise Boom("inner")
        except Boom:
            pass
        say("inner_ended")
        cue()
    say("ended", error=None)
    wait_for_eof()


def session_aborted(args: argparse.Namespace) -> None:
    from django.db import DatabaseError
    from django.db import connections
    from django.db import transaction

    from advisory_lock import advisory_lock

    using = args.using
    raised: list[DatabaseError] = []
    error: BaseException | None = None

    def lock_block_ended_by_a_failed_statement() -> None:
        with advisory_lock(args.key, using=using, scope="session") as handle:
            assert handle.scope == "session", handle
            say("acquired")
            cue()
            try:
                with connections[using].cursor() as cursor:
                    cursor.execute("SELECT 1 / 0")  # aborts the transaction (PostgreSQL)
            except DatabaseError as failed:
                raised.append(failed)
                raise

    try:
        with transaction.atomic(using=using):
            if args.case == "session-aborted":
                lock_block_ended_by_a_failed_statement()
            else:
                try:
                    with transaction.atomic(using=using):
                        lock_block_ended_by_a_failed_statement()
                except DatabaseError as caught:
                    say("inner_ended", error=failure(caught), original=caught is raised[0])
                    cue()
    except DatabaseError as caught:
        error = caught
    say("ended", error=failure(error), original=error is not None and error is raised[0])
    wait_for_eof()


def serve_one_request(args: argparse.Namespace) -> None:
    """One GET through Django's WSGI handler, as a WSGI server runs it."""
    from wsgiref.util import setup_testing_defaults

    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connections
    from django.test.utils import override_settings

    connections.settings[args.using]["ATOMIC_REQUESTS"] = True
    override_settings(
        ROOT_URLCONF="tests.transaction_child",
        MIDDLEWARE=["tests.transaction_child.EndedMiddleware"],
        ALLOWED_HOSTS=["*"],
    ).enable()
    view = "raises" if args.case == "view-raises" else "set-rollback"
    environ = {"PATH_INFO": f"/{view}/{args.using}/{args.key}/"}
    setup_testing_defaults(environ)
    statuses = []
    response = WSGIHandler()(environ, lambda status, headers: statuses.append(status))
    say("responded", status=statuses[0])
    response.close()  # what a WSGI server does once the body is sent: request_finished
    say("finished")
    wait_for_eof()


# The views and the middleware of the view-* cases (``ROOT_URLCONF`` is this module).


def locks_then_raises(request, using, key):
    from advisory_lock import advisory_lock

    with advisory_lock(key, using=using) as handle:
        assert handle.scope == "transaction", handle
    say("acquired")
    cue()
    raise Boom("view")


def locks_then_sets_rollback(request, using, key):
    from django.db import transaction
    from django.http import HttpResponse

    from advisory_lock import advisory_lock

    with advisory_lock(key, using=using) as handle:
        assert handle.scope == "transaction", handle
    say("acquired")
    cue()
    transaction.set_rollback(True, using=using)
    return HttpResponse("rolled back")


class EndedMiddleware:
    """The only (so the innermost) middleware: it runs once the view's ``atomic`` is over,
    and holds the request there, before it ends, until the test's cue."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not getattr(request, "ended", False):
            say("ended", error=None, status=response.status_code)
            cue()
        return response

    def process_exception(self, request, exception):
        from django.http import HttpResponse

        request.ended = True
        say("ended", error=failure(exception))
        cue()
        return HttpResponse("failed", status=500)


urlpatterns = [
    path("raises/<str:using>/<str:key>/", locks_then_raises),
    path("set-rollback/<str:using>/<str:key>/", locks_then_sets_rollback),
]


CASES = {
    "commit": end_transaction,
    "raise": end_transaction,
    "set-rollback": end_transaction,
    "durable": end_transaction,
    "kept-alive": end_transaction,
    "failed-rollback": end_transaction,
    "savepoint": savepoint,
    "session-aborted": session_aborted,
    "session-aborted-savepoint": session_aborted,
    "view-raises": serve_one_request,
    "view-set-rollback": serve_one_request,
}


def main() -> None:
    gc.disable()  # first: nothing here may depend on the cyclic garbage collector
    parser = argparse.ArgumentParser(prog="python -m tests.transaction_child")
    parser.add_argument("--using", required=True, help="the database alias")
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("key")
    parser.add_argument("--outer-key")
    args = parser.parse_args()
    django.setup()
    CASES[args.case](args)


if __name__ == "__main__":
    main()
