"""A pass that starts many due slots: the heartbeat goes on during it, and a signal stops it.

A scheduler starts the due slots of its entries one after another in one pass. With many
entries due at once (here 120 new entries: each one's first run is its most recent due slot),
that pass lasts seconds. Found by bench/scale.py (500 entries): before, the heartbeat was only
recorded between passes, so a busy scheduler looked dead (``run_jobs --check`` failed,
run-now was refused), and a SIGTERM ("no new runs") let the pass go on starting runs.

Events only: the scheduler's output lines and its heartbeat row, read as they come; the
pass is known to be still going when the heartbeat moves because fewer runs than entries
have started by then (a pass of 120 forks can't end within one heartbeat interval).
"""

from __future__ import annotations

import signal

from advisory_lock.scheduling.liveness import SchedulerHeartbeat
from tests.schedulers import JOBS
from tests.schedulers import long_interval
from tests.schedulers import wait_for
from tests.test_control_room import controls  # noqa: F401 (a fixture)
from tests.test_control_room import heartbeats  # noqa: F401 (a fixture)
from tests.test_control_room import output
from tests.test_control_room import schedulers  # noqa: F401 (a fixture)
from tests.test_listen_notify import on_postgresql

ENTRIES = 120


@on_postgresql
def test_the_heartbeat_goes_on_during_a_long_pass_and_a_signal_stops_the_pass(
    using,
    ledger,
    controls,  # noqa: F811 (the fixture)
    heartbeats,  # noqa: F811
    schedulers,  # noqa: F811
):
    every = long_interval(using)
    schedule = {f"e{n:03}": {"callable": f"{JOBS}.tick", "every": every} for n in range(ENTRIES)}
    process = schedulers.start(schedule)

    def started() -> int:
        return output(schedulers, process).count("] started (pid")

    wait_for(lambda: started() >= 3, "the pass's first runs started", timeout=120)
    [first] = SchedulerHeartbeat.objects.using(using).filter(pid=process.pid)
    beat = wait_for(
        lambda: (
            SchedulerHeartbeat.objects.using(using)
            .filter(pid=process.pid, last_seen__gt=first.last_seen)
            .first()
        ),
        "a heartbeat after the pass began",
        timeout=120,
    )
    assert beat is not None
    during = started()
    assert during < ENTRIES, "the heartbeat moved only once the whole pass was over"
    process.send_signal(signal.SIGTERM)
    status, out, err = schedulers.finish(process, timeout=300)
    assert status == 0, err
    _, signal_line, after_signal = out.partition("run_jobs: signal 15")
    assert signal_line, out
    # At most the run whose start the signal interrupted; none after it.
    assert after_signal.count("] started (pid") <= 1, after_signal
    assert out.count("] started (pid") < ENTRIES
