"""A scheduler's worker reads the server's clock at most once a second for its claims and
ends (``advisory_lock.server_clock``), and counts on from the reading: the times it stores are
still the server's. Real child processes (tests/clock_child.py) on every database; counts
of the statements its connection sent, bounded by the seconds its own clock says the runs
took, never a timing.
"""

from __future__ import annotations

import datetime

import pytest

from advisory_lock import JobRun
from tests.processes import Worker
from tests.processes import Workers
from tests.schedulers import server_now

RUNS = 20
#: How far a time counted from a reading may run ahead of the server's own clock: the
#: drift of two NTP-disciplined clocks over a second (microseconds), and the rounding of a
#: stored time.
DRIFT = datetime.timedelta(milliseconds=5)


@pytest.fixture
def runs(using):
    rows = JobRun.objects.using(using).filter(job_name="clock")
    rows.delete()
    yield rows
    rows.delete()


def child(using: str, *flags: str) -> dict:
    worker = Worker([using, str(RUNS), *flags], Workers().env, module="tests.clock_child")
    try:
        return worker.expect("done", timeout=120)
    finally:
        worker.kill()


@pytest.mark.parametrize("counting", [False, True], ids=["each time", "counting"])
def test_a_workers_claims_and_ends_read_the_clock_once_a_second_and_store_the_servers_time(
    using, runs, counting
):
    before = server_now(using)
    done = child(using, *(["--counting"] if counting else []))
    after = server_now(using)
    reads = done["clock"]
    if using == "default":
        assert reads == 0  # SQLite's clock is this host's: no statement either way
    elif counting:
        # A reading is taken again only once it is a second old.
        assert 1 <= reads <= 1 + int(done["seconds"]), done
    else:
        assert reads == 2 * RUNS, done  # a claim's and an end's
    stored = [
        (datetime.datetime.fromisoformat(start), datetime.datetime.fromisoformat(end))
        for start, end in done["runs"]
    ]
    assert len(stored) == RUNS
    previous_end = before - DRIFT
    for start, end in stored:
        assert previous_end - DRIFT <= start <= end, stored
        previous_end = end
    assert previous_end <= after + DRIFT, (stored, after)
