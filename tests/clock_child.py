"""A child process for tests/test_server_clock.py: ``python -m tests.clock_child ALIAS RUNS
[--counting]``.

Started as tests/worker.py is (tests/processes.py), with the run's settings. It claims and
ends RUNS slots of one job on ALIAS through the ledger, as a scheduler's worker does
(``keep_ledger_connection``; with ``--counting``, ``count_from_readings`` too), and says
``done`` with the clock statements its connection sent (``CaptureQueriesContext``), the
seconds the runs took by ``time.monotonic()``, and each run's start and end as stored.
"""

from __future__ import annotations

import re
import sys
import time

import django

#: A read of the server's clock: PostgreSQL's statement_timestamp(), MySQL's UTC_TIMESTAMP().
CLOCK = re.compile(r"^SELECT (statement_timestamp|UTC_TIMESTAMP)\(", re.IGNORECASE)


def main(alias: str, runs: int, counting: bool) -> None:
    django.setup()
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    from advisory_lock import JobRun
    from advisory_lock.keys import make_key
    from advisory_lock.ledger import claim_slot
    from advisory_lock.ledger import finish
    from advisory_lock.own_connection import keep_ledger_connection
    from advisory_lock.server_clock import count_from_readings
    from tests.worker import say

    keep_ledger_connection()
    if counting:
        count_from_readings()
    key = make_key("clock-child")
    started = time.monotonic()
    with CaptureQueriesContext(connections[alias]) as statements:
        for number in range(runs):
            period = f"slot-{number}"
            run, _taken = claim_slot(
                alias, "clock", lambda _now, period=period: period, True, held=key
            )
            assert run is not None
            finish(alias, run)
    took = time.monotonic() - started
    rows = JobRun.objects.using(alias).filter(job_name="clock").order_by("pk")
    say(
        "done",
        clock=sum(1 for s in statements if CLOCK.search(s["sql"])),
        seconds=took,
        runs=[[row.started_at.isoformat(), row.finished_at.isoformat()] for row in rows],
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--counting" in sys.argv[3:])
