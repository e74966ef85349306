"""What the tasks do, shared by Django Tasks and Celery: leave marks in files that the test
reads, since the task runs in another process.

Times are ``time.monotonic()``, one clock for every process on Linux, so the test can compare
a task's start with the moment it killed a worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

#: How long ``hold`` waits for the test's release file before it gives up (a stuck test).
RELEASE_TIMEOUT = 30.0


def mark(path: str, **fields: Any) -> None:
    """Write ``fields`` as JSON to ``path`` at once (a reader never sees half a file)."""
    partial = f"{path}.{os.getpid()}.partial"
    Path(partial).write_text(json.dumps(fields))
    os.replace(partial, path)


def read_mark(path: str | Path) -> dict[str, Any] | None:
    """The fields ``mark`` wrote, or None if it has not yet."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None


def hold(started: str, release: str) -> dict[str, Any]:
    """Say that the task started (its pid and time), then run until ``release`` exists."""
    started_at = time.monotonic()
    mark(started, pid=os.getpid(), at=started_at)
    deadline = started_at + RELEASE_TIMEOUT
    while not os.path.exists(release):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{release} did not appear within {RELEASE_TIMEOUT:g}s")
        time.sleep(0.01)
    return {"pid": os.getpid(), "started_at": started_at}
