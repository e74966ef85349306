"""A lock holder in a process of its own: ``python -m tests.holder_child ALIAS KEY``.

Started by tests/test_lock_directory.py with DJANGO_SETTINGS_MODULE=tests.settings and
ADVISORY_LOCK_TEST_WORKER=1 (the pytest run's test databases). It takes ``advisory_lock(KEY)``
as any program would, waits until its lock directory thread has written what it noted (the
holder's name and process: ``advisory_lock.directory``), says ``{"event": "holding", "pid":
..., "host": ...}`` on stdout, holds the lock until a line or EOF arrives on stdin, then
releases it and exits. ``--shared`` takes it shared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import django


def say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("using")
    parser.add_argument("key")
    parser.add_argument("--shared", action="store_true")
    args = parser.parse_args()
    django.setup()

    from advisory_lock import advisory_lock
    from advisory_lock import directory

    with advisory_lock(args.key, using=args.using, shared=args.shared):
        assert directory.recorder is not None, "the app's models install the directory"
        assert directory.recorder.flush(timeout=300), "the directory thread did not write"
        say("holding", pid=os.getpid(), host=socket.gethostname())
        sys.stdin.readline()
    say("released")


if __name__ == "__main__":
    main()
