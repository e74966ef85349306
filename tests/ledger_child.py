"""A child process for tests/test_ledger_faults.py: ``python -m tests.ledger_child --using A CMD``.

Started like tests/worker.py (see tests/processes.py), with the run's settings; it writes one
JSON object per line on stdout and reads its cues on stdin. Commands:

* ``claim JOB [--period P]``: ``JobRun.objects.using(A).claim(JOB, P)``; say ``claimed``
  (with the run's pk and attempt) or ``refused``, then wait for a cue: ``finish`` records
  the end (``finished``, or ``lost`` with the error), anything else or EOF exits at once.
* ``run-once JOB [--period P]``: ``with run_once(JOB, period=P, using=A) as run``: say
  ``running`` (pk, attempt) or ``skipped``, wait for a cue inside the block, say
  ``leaving``, and after the block ``done``; a ``LockLost`` at any point says ``lost`` (with
  the error) and exits with status 1.

Either is meant to be killed (SIGKILL) at any point: a crash, as the ledger must survive it.
"""

from __future__ import annotations

import argparse
import sys

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
        with run_once(args.job, period=args.period, using=args.using) as run:
            if run is None:
                say("skipped")
                return
            say("running", pk=run.pk, attempt=run.attempt)
            cue()
            say("leaving")
    except LockLost as error:
        say("lost", error=f"{type(error).__name__}: {error}")
        sys.exit(1)
    say("done")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.ledger_child")
    parser.add_argument("--using", required=True, help="the database alias")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, run in (("claim", claim), ("run-once", run_once_block)):
        command = commands.add_parser(name)
        command.add_argument("job")
        command.add_argument("--period", default="once")
        command.set_defaults(run=run)
    args = parser.parse_args()
    django.setup()
    args.run(args)


if __name__ == "__main__":
    main()
