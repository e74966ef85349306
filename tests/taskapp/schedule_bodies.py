"""What the scheduled tasks of tests/test_schedule_tasks.py do, for Django Tasks
(``schedule_tasks``) and Celery (``schedule_celery``) alike: record each execution in a file
of its own, and fail on purpose for some task ids.

A task entry's arguments are the same for each of its slots: a task knows its slot by its own
id (the one its slot's ledger row records), which it writes down with each execution.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from tests.taskapp.bodies import mark


def record_execution(folder: str, task_id: str, **fields: Any) -> None:
    """Record one execution of the task ``task_id`` in ``folder``: a file of its own (a task
    run twice leaves two), with ``fields``."""
    name = f"{task_id}.{os.getpid()}.{time.monotonic_ns()}.run"
    mark(os.path.join(folder, name), task_id=task_id, **fields)


def executions(folder: str | Path) -> list[dict[str, Any]]:
    """What ``record_execution`` recorded in ``folder``."""
    return [json.loads(path.read_text()) for path in sorted(Path(folder).glob("*.run"))]


def fails(task_id: str, one_in: int) -> bool:
    """Does the task ``task_id`` fail on purpose? One id in ``one_in`` (0: none), whoever
    runs it, however often."""
    return one_in > 0 and int(hashlib.sha256(task_id.encode()).hexdigest(), 16) % one_in == 0


#: How long a held task waits for the test to kill its worker (a guard against a hang).
HOLD_TIMEOUT = 300.0


def hold_if(worker: str, hold_on: str) -> None:
    """On a worker whose name starts with ``hold_on``, run until the test kills it."""
    if hold_on and worker.startswith(hold_on):
        time.sleep(HOLD_TIMEOUT)
        raise TimeoutError(f"{worker} was not killed within {HOLD_TIMEOUT:g}s")
