"""A child process for tests/test_ledger_faults.py: ``python -m tests.ledger_child --using A CMD``.

Started like tests/worker.py (see tests/processes.py), with the run's settings; it writes one
JSON object per line on stdout and reads its cues on stdin. Commands:

* ``claim JOB [--period P]``: ``JobRun.objects.using(A).claim(JOB, P)``; say ``claimed``
  (with the run's pk and attempt) or ``refused``, then wait for a cue: ``finish`` records
  the end (``finished``, or ``lost`` with the error), anything else or EOF exits at once.
* ``run-once JOB [--period P]``: ``with run_once(JOB, period=P, using=A) as run``: say
  ``running`` (pk, attempt) or ``skipped``, wait for a cue inside the block, say
  ``leaving``, and after the block ``done``; a ``LockLost`` at any point says ``lost`` (with
  the error and its cause) and exits with status 1. The cue ``fail`` makes the body raise
  ``RuntimeError`` (``failed``, status 2). ``--heartbeat`` is the run's.

* ``atomic JOB EFFECT [--period P]``: ``with run_once(JOB, period=P, using=A,
  atomic=True) as run``: create the Counter named EFFECT (the job's write, in the run's
  transaction), say ``wrote`` (pk, attempt), wait for a cue, say ``leaving``, and after the
  block ``done``; ``lost`` and status 1 on a ``LockLost``, ``skipped`` if the slot is taken.
* ``atomic-fenced JOB EFFECT [--period P]``: as ``atomic``, but the run's first statement
  on the ledger's database after its claim (the UPDATE that locks its row, run through
  Django's documented ``execute_wrapper``) waits: say ``fencing``, wait for a cue, then go
  on. The test takes the lock away meanwhile, between the claim and the body.
* ``atomic-jobs PREFIX --jobs N``: say ``ready``, wait for ``go``, then run N atomic jobs
  one after the other, ``PREFIX-0`` to ``PREFIX-<N-1>``, each reading the Counter table
  and then creating the Counter named after the job; say ``done`` with the number that
  succeeded and the errors (``type: message``) of those that did not.

* ``fenced-write KEY TABLE``: ``with advisory_lock(KEY, using=A, fencing=True) as lock``:
  say ``holding`` (the token), wait for a cue, then write through a new connection (Django's
  is closed first, as after a broken one) ``UPDATE TABLE SET value = 'child', fence = token
  WHERE id = 1 AND fence <= token``; say ``wrote`` with the number of rows it changed. The
  block's end (its lock lost meanwhile) is not looked at.

* ``heartbeat KEY [--beat S]``: ``with advisory_lock(KEY, using=A, heartbeat=S,
  on_lost=...) as lock``: say ``holding``; ``on_lost`` says ``lost`` (with the handle's
  ``lost``) from the heartbeat's thread; at a cue, ``lock.check()``: say ``checked`` with its
  error ('' if none); after the block, ``ended`` with the block's error ('' if none).

Any is meant to be killed (SIGKILL) at any point: a crash, as the ledger must survive it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

import django

from tests.worker import cue
from tests.worker import say


def claim(args: argparse.Namespace) -> None:
    from advisory_lock import AdvisoryLockError
    from advisory_lock import JobRun

    rows = JobRun.objects.using(args.using)
    run = rows.claim(args.job, period=args.period)
    if run is None:
        say("refused")
        return
    say("claimed", pk=run.pk, attempt=run.attempt)
    if cue() != "finish":
        return
    try:
        rows.finish(run)
    except AdvisoryLockError as error:
        say("lost", error=f"{type(error).__name__}: {error}")
        sys.exit(1)
    say("finished")


def run_once_block(args: argparse.Namespace) -> None:
    from advisory_lock import LockLost
    from advisory_lock import run_once

    try:
        with run_once(
            args.job, period=args.period, using=args.using, heartbeat=args.heartbeat
        ) as run:
            if run is None:
                say("skipped")
                return
            say("running", pk=run.pk, attempt=run.attempt)
            if cue() == "fail":
                raise RuntimeError(f"{args.job}: the body failed")
            say("leaving")
    except LockLost as error:
        cause = error.__cause__
        say("lost", error=f"{type(error).__name__}: {error}", cause=repr(cause))
        sys.exit(1)
    except RuntimeError as error:
        say("failed", error=f"{type(error).__name__}: {error}")
        sys.exit(2)
    say("done")


def atomic_block(args: argparse.Namespace) -> None:
    from advisory_lock import LockLost
    from advisory_lock import run_once
    from testproject.example.models import Counter

    try:
        with run_once(args.job, period=args.period, using=args.using, atomic=True) as run:
            if run is None:
                say("skipped")
                return
            Counter.objects.using(args.using).create(name=args.effect)
            say("wrote", pk=run.pk, attempt=run.attempt)
            cue()
            say("leaving")
    except LockLost as error:
        say("lost", error=f"{type(error).__name__}: {error}")
        sys.exit(1)
    say("done")


def atomic_fenced(args: argparse.Namespace) -> None:
    from django.db import connections

    paused = []

    def pause_at_the_row_lock(execute, sql, params, many, context):
        if not paused and sql.lstrip().upper().startswith("UPDATE") and "job_runs" in sql:
            paused.append(sql)
            say("fencing")
            cue()
        return execute(sql, params, many, context)

    with connections[args.using].execute_wrapper(pause_at_the_row_lock):
        atomic_block(args)


def atomic_jobs(args: argparse.Namespace) -> None:
    from django.db import connections

    from advisory_lock import run_once
    from testproject.example.models import Counter

    connections[args.using].ensure_connection()
    say("ready")
    if cue() != "go":
        return
    counters = Counter.objects.using(args.using)
    succeeded, errors = 0, []
    for number in range(args.jobs):
        name = f"{args.prefix}-{number}"
        try:
            with run_once(name, period="once", using=args.using, atomic=True) as run:
                assert run is not None, f"{name}: skipped"
                counters.filter(name__startswith=args.prefix).count()  # a read first
                counters.create(name=name)
            succeeded += 1
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
    say("done", succeeded=succeeded, errors=errors)


def fenced_write(args: argparse.Namespace) -> None:
    from django.db import DatabaseError
    from django.db import connections

    from advisory_lock import LockLost
    from advisory_lock import advisory_lock

    with contextlib.suppress(DatabaseError, LockLost):  # the block's end: its lock was lost
        with advisory_lock(args.key, using=args.using, fencing=True) as lock:
            say("holding", token=lock.token)
            cue()
            connections[args.using].close()  # a new connection for the write
            with connections[args.using].cursor() as cursor:
                cursor.execute(
                    f"UPDATE {args.table} SET value = 'child', fence = %s "
                    f"WHERE id = 1 AND fence <= %s",
                    [lock.token, lock.token],
                )
                say("wrote", rows=cursor.rowcount)


def heartbeat_block(args: argparse.Namespace) -> None:
    from advisory_lock import LockLost
    from advisory_lock import advisory_lock

    def lost(lock: Any) -> None:
        say("lost", flag=lock.lost)

    try:
        with advisory_lock(args.key, using=args.using, heartbeat=args.beat, on_lost=lost) as lock:
            say("holding")
            cue()
            try:
                lock.check()
            except LockLost as error:
                say("checked", error=str(error))
            else:
                say("checked", error="")
    except LockLost as error:
        say("ended", error=str(error))
    else:
        say("ended", error="")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.ledger_child")
    parser.add_argument("--using", required=True, help="the database alias")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, run in (("claim", claim), ("run-once", run_once_block)):
        command = commands.add_parser(name)
        command.add_argument("job")
        command.add_argument("--period", default="once")
        command.add_argument("--heartbeat", type=float, default=10)
        command.set_defaults(run=run)
    command = commands.add_parser("atomic")
    command.add_argument("job")
    command.add_argument("effect")
    command.add_argument("--period", default="once")
    command.set_defaults(run=atomic_block)
    command = commands.add_parser("atomic-fenced")
    command.add_argument("job")
    command.add_argument("effect")
    command.add_argument("--period", default="once")
    command.set_defaults(run=atomic_fenced)
    command = commands.add_parser("fenced-write")
    command.add_argument("key")
    command.add_argument("table")
    command.set_defaults(run=fenced_write)
    command = commands.add_parser("heartbeat")
    command.add_argument("key")
    command.add_argument("--beat", type=float, default=0.05)
    command.set_defaults(run=heartbeat_block)
    command = commands.add_parser("atomic-jobs")
    command.add_argument("prefix")
    command.add_argument("--jobs", type=int, required=True)
    command.set_defaults(run=atomic_jobs)
    args = parser.parse_args()
    django.setup()
    args.run(args)


if __name__ == "__main__":
    main()
