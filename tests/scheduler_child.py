"""One scheduler of a fleet, driven step by step: ``python -m tests.scheduler_child --using A``.

For tests/test_scheduler_retries.py and test_scheduler_deaths.py (``SchedulerChild`` in
tests/processes.py). Started like tests/ledger_child.py (with the run's
settings, see tests/processes.py), it writes one JSON object per line on stdout and reads one
command per line on stdin, each naming a SCHEDULE entry as JSON (its name included):

* ``decide SLOT ENTRY``: does this scheduler want to run the entry's SLOT (the test that
  ``run_jobs`` makes before it starts a run: ``Scheduler._wants_run``, for the latest due
  slot)? Says ``decided`` with ``wants``.
* ``run SLOT ENTRY``: run SLOT as ``run_jobs`` does (``Scheduler.start``: one of its
  workers takes the entry's lock and claims the slot), wait for the run to end and say
  ``ended`` with what the scheduler said of it (``succeeded``, ``failed``, ``skipped``).
* ``pass - ENTRY``: one pass over the due slots, as ``run_jobs`` makes it
  (``Scheduler.start_due``), without waiting for what it started. Says ``passed`` with what
  the scheduler said (``said``, a list) and the job processes running (``running``, pids).
* ``reap - ENTRY``: collect the job processes that ended and record how, as a pass of
  ``run_jobs`` does (``Scheduler.reap``); once, or until none runs, if one does (the test
  has killed it). Says ``reaped`` with ``said``.

EOF on stdin ends it. No sleep orders anything: the test sends each command when the events
it waits for have been said.
"""

from __future__ import annotations

import argparse
import json
import time

import django

from tests.worker import cue
from tests.worker import say


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.scheduler_child")
    parser.add_argument("--using", required=True, help="the database alias")
    args = parser.parse_args()
    django.setup()

    from advisory_lock.ledger import deciding_attempts
    from advisory_lock.schedule import _entry
    from advisory_lock.scheduling.boundaries import Due
    from advisory_lock.scheduling.scheduler import Scheduler

    said: list[str] = []
    scheduler = Scheduler({}, using=args.using, say=said.append)
    say("ready")
    while command := cue():
        verb, slot, options = command.split(" ", 2)
        options = json.loads(options)
        entry = _entry(options.pop("name"), options)
        scheduler.entries = {entry.name: entry}
        scheduler.sharing.order = [entry.name]
        scheduler._settled.clear()  # each decision is made afresh, from the ledger
        scheduler._elsewhere.clear()
        scheduler.boundaries.forget([entry.name])  # the entry may have changed
        if verb == "decide":
            due = Due(slot, scheduler.now(), latest=True)
            last = deciding_attempts(args.using, {entry.name: slot}).get(entry.name)
            say("decided", wants=scheduler._wants_run(entry, due, last))
            continue
        if verb == "pass":
            said.clear()
            scheduler.start_due()
            running = [child.process.pid for child in scheduler.children.values()]
            say("passed", said=said, running=running)
            continue
        if verb == "reap":
            said.clear()
            scheduler.reap()
            while scheduler.children:
                time.sleep(0.01)  # polling the killed job process, as run_jobs does
                scheduler.reap()
            say("reaped", said=said)
            continue
        said.clear()
        scheduler.pool.fill()
        scheduler.start(entry, slot)
        while scheduler.children:
            scheduler.reap()
            time.sleep(0.01)  # polling the job process, as run_jobs does; orders nothing
        outcome = next(
            word for word in ("succeeded", "skipped", "failed") for line in said if word in line
        )
        say("ended", outcome=outcome, said=said[-1])


if __name__ == "__main__":
    main()
