"""A fleet: 32 instances of one single-instance command started together run exactly once.

Each instance is a real ``manage.py`` process (Django start-up is about 1 s of CPU here, so 32
of them take half a minute on 2 idle cores, minutes on loaded ones). The one that gets the
lock keeps it (``--until``) until the 31 others have exited, so none of them can find it free.
"""

from __future__ import annotations

import time

from tests.commands import HANG
from tests.commands import finish
from tests.commands import start
from tests.probes import is_free

FLEET = 32
BUSY = 3  # busy_exit_code of the test commands
KEY = "command:lockapp.mixin_job"


def test_a_fleet_of_32_started_together_runs_exactly_once(using, tmp_path):
    ran, done = tmp_path / "ran", tmp_path / "done"
    processes = [
        start(using, "mixin_job", "--ran", str(ran), "--until", str(done)) for _ in range(FLEET)
    ]
    try:
        # A guard against a hung fleet, not a timing: 31 Django start-ups on a loaded 2-core
        # machine take minutes. The runner holds until "done", so none can find it free.
        deadline = time.monotonic() + HANG
        while sum(p.poll() is not None for p in processes) < FLEET - 1:
            assert time.monotonic() < deadline, "the fleet's 31 others did not exit"
            time.sleep(0.05)
    finally:
        done.touch()  # the runner lets go
    results = [finish(process) for process in processes]
    statuses = sorted(status for status, _, _ in results)
    others = [(status, err[-300:]) for status, _, err in results if status not in (0, BUSY)]
    assert statuses == [0] + [BUSY] * (FLEET - 1), (statuses, others)
    [runner] = [p for p, (status, _, _) in zip(processes, results, strict=True) if status == 0]
    assert results[processes.index(runner)][1].startswith(f"running {runner.pid}")
    assert ran.read_text().split() == [str(runner.pid), "acme"]
    busy_lines = [err for status, _, err in results if status == BUSY]
    for err in busy_lines:
        assert "lockapp.mixin_job: skipped, another instance holds lock" in err, err
        assert f"'{KEY}'" in err, err
        # The holder is named: its process (PostgreSQL, SQLite) or the server's connection id
        # (MySQL/MariaDB).
        assert " by process " in err or " by MySQL connection id " in err, err
    assert is_free(KEY, using)
