"""The callables that the schedules of ``tests/test_scheduler.py``, ``tests/test_control_room.py``
and ``bench/scheduler.py`` run.

Each run appends one JSON line to ``$ADVISORY_LOCK_TEST_JOBS_DIR/runs.jsonl`` when it ends:
its entry, slot and attempt (read from its own ``running`` row of the ledger), its pid and
parent pid, and its start and end in ``time.monotonic()``, which on Linux is one clock for
every process, so that the test can tell whether two runs overlapped. One ``write()`` to a
file opened with O_APPEND: lines of different processes never interleave.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def nothing() -> None:
    """A run that does nothing, not even read its row: what tests/test_scheduler_costs.py
    counts is what the schedulers themselves cost a slot."""


def tick() -> None:
    """A short run (0.2 s): long enough for two runs of one slot to overlap, if they could."""
    _run(0.2)


def nap() -> None:
    """A run of 2 s."""
    _run(2.0)


def sleep_long() -> None:
    """A run of two minutes: longer than any test waits for it."""
    _run(120.0)


def until_go() -> None:
    """A run that lasts until the file ``go`` appears in the jobs folder (five minutes at
    most): the test decides when it ends."""
    deadline = time.monotonic() + 300
    while not (_folder() / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    _run(0.0)


def fork_an_heir() -> None:
    """Fork a process, the heir, that inherits this run's open connections (and SQLite's lock
    files) and keeps them until the file ``go`` appears in the jobs folder (five minutes at
    most); write its pid to ``heir.pid``; then run for two minutes. This run killed, its
    lock stays held until the heir exits: as a server holds a killed process's locks until
    it has noticed its connections close, here for as long as the test wants."""
    heir = os.fork()
    if heir == 0:
        deadline = time.monotonic() + 300
        while not (_folder() / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # closes the inherited connections without a word to the server
    temporary = _folder() / f"heir.pid.{os.getpid()}"
    temporary.write_text(str(heir))
    temporary.rename(_folder() / "heir.pid")
    _run(120.0)


def slow_the_first_time() -> None:
    """The first run of all (fleet-wide) writes its pid to ``slow.pid`` and sleeps for two
    minutes; the others end at once. For a run to be killed, and its retry to succeed."""
    try:
        os.close(os.open(_folder() / "slow.first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        _run(0.0)
        return
    temporary = _folder() / f"slow.pid.{os.getpid()}"
    temporary.write_text(f"{os.getpid()} {os.getppid()}")
    temporary.rename(_folder() / "slow.pid")
    _run(120.0)


def fail() -> None:
    """A run that fails."""
    raise RuntimeError("the scheduled job failed on purpose")


def runs(folder: Path) -> list[dict]:
    """The runs recorded in ``folder``, in the order they ended."""
    path = folder / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(seconds: float) -> None:
    from advisory_lock import JobRun

    started = time.monotonic()
    row = JobRun.objects.get(pid=os.getpid(), status=JobRun.Status.RUNNING)
    time.sleep(seconds)
    record = {
        "job": row.job_name,
        "slot": row.period,
        "attempt": row.attempt,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "start": started,
        "end": time.monotonic(),
    }
    fd = os.open(_folder() / "runs.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _folder() -> Path:
    return Path(os.environ["ADVISORY_LOCK_TEST_JOBS_DIR"])


def write_effect() -> None:
    """Create the Counter named after the running job (the job's write)."""
    from advisory_lock import JobRun
    from testproject.example.models import Counter

    row = JobRun.objects.get(pid=os.getpid(), status=JobRun.Status.RUNNING)
    Counter.objects.create(name=row.job_name)


def write_effect_then_fail() -> None:
    """``write_effect()``, then fail."""
    write_effect()
    raise RuntimeError("the scheduled job failed on purpose")
