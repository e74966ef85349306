"""Look at a lock from another database connection (another thread, so another connection)."""

from __future__ import annotations

import threading
import time

from django.db import connections

from advisory_lock import advisory_lock


def in_other_connection(func, *args, **kwargs):
    """Run ``func`` in a new thread, which gets its own Django connections; return its result."""
    outcome = {}

    def target():
        try:
            outcome["value"] = func(*args, **kwargs)
        except BaseException as exc:  # handed back to the caller below
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(300)  # a guard against a hang, not a timing
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def is_free(key, using, *, shared=False):
    """True if another connection can take ``key`` right now (it lets go at once)."""

    def attempt():
        with advisory_lock(key, using=using, wait=False, shared=shared) as handle:
            return handle.acquired

    return in_other_connection(attempt)


def freed(key, using, *, guard=300.0):
    """True once ``key`` is free, after a holder's process exited or was killed: the server
    frees a dead client's locks when it notices its connection is gone, after the process
    is reaped (MySQL/MariaDB: when the thread serving it sees the closed socket). False only
    if it is still held after ``guard`` seconds, a guard against a hang, not a timing."""
    deadline = time.monotonic() + guard
    while not is_free(key, using):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
