"""A child process for tests/test_sqlite_lock_files.py: ``python -m tests.sqlite_child CMD KEY``.

Started like tests/worker.py (see tests/processes.py), with the run's settings; it writes one
JSON object per line on stdout and reads its cues on stdin. Commands:

* ``write-fails KEY``: forbid this process to write any byte to a file (``RLIMIT_FSIZE`` 0,
  ``SIGXFSZ`` ignored, so a write fails with EFBIG as on a full disk), then take KEY on the
  SQLite alias: say ``acquired`` or ``refused`` (with the error), and stay alive, holding
  whatever the attempt left behind, until a line or EOF arrives on stdin.
* ``in-memory KEY``: take KEY on an in-memory SQLite database (alias "memory", added here):
  say ``acquired`` with the regular files this process had open only while holding it (the
  lock's file), or ``refused`` with the error; then exit. A fresh process: whatever the
  library learns about its folder, it learns here for the first time.
"""

from __future__ import annotations

import contextlib
import copy
import os
import resource
import signal
import stat
import sys

import django

from tests.worker import cue
from tests.worker import say


def open_files() -> set[str]:
    """The paths of the regular files this process has open."""
    paths = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.stat(f"/proc/self/fd/{fd}").st_mode):
                paths.add(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


def write_fails(key: str) -> None:
    from advisory_lock import AdvisoryLockError
    from advisory_lock import advisory_lock

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    try:
        with advisory_lock(key, using="default"):
            say("acquired")
            cue()
    except (OSError, AdvisoryLockError) as error:
        say("refused", error=f"{type(error).__name__}: {error}")
        cue()


def in_memory(key: str) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.db import connections

    from advisory_lock import AdvisoryLockError
    from advisory_lock import advisory_lock

    settings_dict = copy.deepcopy(connections.settings["default"])
    settings_dict.update(NAME=":memory:", TEST={"NAME": ":memory:", "MIRROR": None})
    connections.settings["memory"] = settings_dict
    before = open_files()
    try:
        with advisory_lock(key, using="memory"):
            say("acquired", files=sorted(open_files() - before))
    except (OSError, AdvisoryLockError, ImproperlyConfigured) as error:
        refused = isinstance(error, (PermissionError, AdvisoryLockError, ImproperlyConfigured))
        say("refused" if refused else "failed", error=f"{type(error).__name__}: {error}")


def main() -> None:
    command, key = sys.argv[1:]
    django.setup()
    {"write-fails": write_fails, "in-memory": in_memory}[command](key)


if __name__ == "__main__":
    main()
