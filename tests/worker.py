"""A worker process for the concurrency tests: ``python -m tests.worker --using ALIAS COMMAND``.

Started by tests/processes.py with DJANGO_SETTINGS_MODULE=tests.settings and
ADVISORY_LOCK_TEST_WORKER=1, so it uses the test databases (and SQLite lock folder) of the
pytest run that started it. It writes one JSON object per line on stdout, ``{"event": ...}``,
and reads its cues, one per line, on stdin. Timestamps are ``time.monotonic()``, which on
Linux is one clock for every process, so the test can order events of different workers.

Commands:

* ``hold KEY [--shared] [--try]``: take the lock (``--try``: once, ``wait=False``), say
  ``acquired`` (or ``busy``), hold it until a line or EOF arrives on stdin, then say
  ``releasing`` (with the time), release it and say ``released``.
* ``wait KEY --timeout T``: say ``waiting``, then wait up to T seconds for the lock: say
  ``acquired`` (with the time) and release it at once, or say ``timed_out``.
* ``contend KEY --id N --iterations I --log FILE --marker FILE``: say ``ready``, wait for
  ``go`` on stdin, then I times: take the lock (blocking) and spend ``--hold-ms`` inside it
  while owning FILE ``--marker`` (created with O_EXCL: if it exists, someone else is inside
  too, which counts as an overlap); append ``N enter leave`` to ``--log``. Says ``done``.
  ``--unlocked`` skips the lock, to check that the detector sees overlaps.
* ``count KEY NAME --iterations I``: say ``ready``, wait for ``go``, then I times: in
  ``transaction.atomic``, under the lock, read Counter NAME, sleep, write value + 1; end the
  lock block and sleep again before the commit. Says ``done``. ``--scope session`` makes the
  lock end with its block (a naive lock), and ``--retry`` retries transactions that fail with
  a database error (counted in ``errors``), for the experiment described in the test.

SQLite needs no busy timeout here: under a correct lock only one worker at a time touches the
database file. (Under the naive ``--scope session`` lock a longer busy timeout would not help
either: SQLite refuses at once to upgrade a reader to a writer while another writer waits.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import django


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def cue() -> str:
    """Block until the test writes a line on stdin (or closes it)."""
    return sys.stdin.readline().strip()


def hold(args: argparse.Namespace) -> None:
    from advisory_lock import advisory_lock

    with advisory_lock(
        args.key, using=args.using, shared=args.shared, wait=not args.try_
    ) as handle:
        if not handle:
            say("busy")
            return
        say("acquired", at=handle.acquired_at)
        cue()
        say("releasing", at=time.monotonic())
    say("released")


def wait(args: argparse.Namespace) -> None:
    from advisory_lock import LockNotAcquired
    from advisory_lock import advisory_lock

    say("waiting")
    try:
        with advisory_lock(args.key, using=args.using, timeout=args.timeout) as handle:
            say("acquired", at=handle.acquired_at, wait_time=handle.wait_time)
    except LockNotAcquired:
        say("timed_out")


def interrupted_wait(args: argparse.Namespace) -> None:
    """Wait for ``key`` with no limit, after a first lock on another key (the session known:
    PostgreSQL's wait is then the prepared one). Ctrl-C during the wait says ``interrupted``;
    either way the process then waits for a cue with its connection open, so that the test
    can look at what that session still holds."""
    from advisory_lock import advisory_lock

    with advisory_lock(f"{args.key}-first", using=args.using):
        pass
    say("waiting")
    try:
        with advisory_lock(args.key, using=args.using):
            say("acquired")
    except KeyboardInterrupt:
        say("interrupted")
    cue()


def contend(args: argparse.Namespace) -> None:
    from django.db import connections

    from advisory_lock import advisory_lock

    connections[args.using].ensure_connection()
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    say("ready")
    if cue() != "go":
        return
    iterations = overlaps = 0
    for _ in range(args.iterations):
        lock = (
            contextlib.nullcontext()
            if args.unlocked
            else advisory_lock(args.key, using=args.using)
        )
        with lock:
            enter = time.monotonic()
            try:
                marker = os.open(args.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                overlaps += 1  # another worker is inside the critical section right now
                marker = None
            time.sleep(args.hold_ms / 1000)
            if marker is not None:
                os.close(marker)
                os.unlink(args.marker)
            leave = time.monotonic()
        # One small O_APPEND write per line: lines of different workers never interleave.
        os.write(log, f"{args.id} {enter!r} {leave!r}\n".encode())
        iterations += 1
    os.close(log)
    say("done", iterations=iterations, overlaps=overlaps)


def count(args: argparse.Namespace) -> None:
    from django.db import DatabaseError
    from django.db import connections
    from django.db import transaction

    from advisory_lock import advisory_lock
    from testproject.example.models import Counter

    connections[args.using].ensure_connection()
    say("ready")
    if cue() != "go":
        return
    committed = errors = 0
    while committed < args.iterations:
        try:
            with transaction.atomic(using=args.using):
                with advisory_lock(args.key, using=args.using, scope=args.scope):
                    counter = Counter.objects.using(args.using).get(name=args.name)
                    time.sleep(0.005)
                    counter.value += 1
                    counter.save(using=args.using, update_fields=["value"])
                # The lock block is over but the transaction is not committed yet.
                time.sleep(0.003)
        except DatabaseError:
            if not args.retry:
                raise
            errors += 1
            if errors > 100 * args.iterations:
                raise
            continue
        committed += 1
    say("done", committed=committed, errors=errors)


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when the test run was started in
    # the background: a shell without job control starts background commands with SIGINT
    # ignored (POSIX), the processes they start inherit that, and Python installs its own
    # handler only where SIGINT was not ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(prog="python -m tests.worker")
    parser.add_argument("--using", required=True, help="the database alias")
    commands = parser.add_subparsers(dest="command", required=True)

    command = commands.add_parser("hold")
    command.add_argument("key")
    command.add_argument("--shared", action="store_true")
    command.add_argument("--try", dest="try_", action="store_true")
    command.set_defaults(run=hold)

    command = commands.add_parser("wait")
    command.add_argument("key")
    command.add_argument("--timeout", type=float, required=True)
    command.set_defaults(run=wait)

    command = commands.add_parser("interrupted-wait")
    command.add_argument("key")
    command.set_defaults(run=interrupted_wait)

    command = commands.add_parser("contend")
    command.add_argument("key")
    command.add_argument("--id", type=int, required=True)
    command.add_argument("--iterations", type=int, required=True)
    command.add_argument("--log", required=True)
    command.add_argument("--marker", required=True)
    command.add_argument("--hold-ms", type=float, default=2.0)
    command.add_argument("--unlocked", action="store_true")
    command.set_defaults(run=contend)

    command = commands.add_parser("count")
    command.add_argument("key")
    command.add_argument("name")
    command.add_argument("--iterations", type=int, required=True)
    command.add_argument("--scope", choices=["auto", "session"], default="auto")
    command.add_argument("--retry", action="store_true")
    command.set_defaults(run=count)

    args = parser.parse_args(argv)
    django.setup()
    args.run(args)


if __name__ == "__main__":
    main()
