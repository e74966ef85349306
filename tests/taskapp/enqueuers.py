"""Many processes calling ``enqueue_unique`` at once, for tests/test_enqueue_unique.py:
``python -m tests.taskapp.enqueuers --count N --kind django|celery --folder F --release R``.

Django is set up once here, then N children are forked: real processes, each with its own
database connection (opened after the fork) and, for Celery, its own broker connection. Each
child opens its connection, says ``ready`` and blocks reading a pipe whose write end only this
process holds; on ``go`` (a line on stdin) it closes that end, which wakes every child at once.
Each child then calls ``enqueue_unique(task, F, R)`` and says ``enqueued`` with the task id it
got back (or ``error`` with the traceback); this process says ``done`` with the children's
exit statuses once all have exited.

Every message is one JSON line, written with a single ``os.write`` on the shared stdout (a
pipe: writes of up to 4096 bytes never interleave). The environment is the workers'
(tests/taskapp/services.py: ``worker_env``): the run's test database of ``using`` is
"default", where the tasks (django-tasks-db) and the pending marks go; for Celery,
ADVISORY_LOCK_TEST_BROKER and ADVISORY_LOCK_TEST_QUEUE name the broker and the queue.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

import django


def say(event: str, **fields: Any) -> None:
    os.write(1, (json.dumps({"event": event, **fields}) + "\n").encode())


def the_task(kind: str, queue: str) -> Any:
    if kind == "django":
        from tests.taskapp import tasks

        return tasks.unique_job.using(queue_name=queue)
    from tests.taskapp import celery_worker

    celery_worker.app.finalize()  # the task registry, before the fork (no connection yet)
    return celery_worker.unique_hold


def child(task: Any, args: argparse.Namespace, go: int) -> int:
    from django.db import connections

    from advisory_lock.tasks import enqueue_unique

    try:
        connections["default"].ensure_connection()  # ready to go: connected, and waiting
        say("ready", pid=os.getpid())
        os.read(go, 1)  # b"" when the parent closes the write end: everyone wakes at once
        options = {"key": args.key} if args.key else {}
        result = enqueue_unique(task, args.folder, args.release, **options)
        task_id = result if isinstance(result, str) else str(result.id)
        say("enqueued", pid=os.getpid(), id=task_id, handle=type(result).__name__)
        connections.close_all()
    except BaseException:
        say("error", pid=os.getpid(), traceback=traceback.format_exc())
        return 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.taskapp.enqueuers")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--kind", choices=["django", "celery"], required=True)
    parser.add_argument("--queue", required=True, help="the django-tasks queue name")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--release", required=True)
    parser.add_argument("--key", default="")
    args = parser.parse_args()
    django.setup()
    from django.db import connections

    task = the_task(args.kind, args.queue)
    connections.close_all()  # nothing open to share with the children
    sys.stdout.flush()
    go_read, go_write = os.pipe()
    children = []
    for _ in range(args.count):
        pid = os.fork()
        if pid == 0:
            os.close(go_write)
            status = 1
            try:
                status = child(task, args, go_read)
            finally:
                os._exit(status)
        children.append(pid)
    os.close(go_read)
    say("forked", pids=children)
    sys.stdin.readline()  # "go" (or EOF: the test is gone, the children go and end anyway)
    os.close(go_write)
    statuses = {}
    for pid in children:
        _, status = os.waitpid(pid, 0)
        statuses[str(pid)] = os.waitstatus_to_exitcode(status)
    say("done", statuses=statuses)


if __name__ == "__main__":
    main()
