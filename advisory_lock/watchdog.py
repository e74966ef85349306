"""The watchdog of a dedicated lock: a thread that checks, every heartbeat, that the lock it
watches is still held, and says so at once when it is not.

One thread watches one lock at a time, and may watch one lock after another: a process
that runs job after job on one kept lock connection (a scheduler's worker) keeps one
watchdog for it, started with its first run, instead of starting and joining a thread for
each run (their start-up and the context switches cost a worker more than its run's own
statements: bench/README.md). A watchdog whose watched lock changes between two of its checks
is not woken for it: it wakes when the check it planned falls due, and then plans the next
one from what it watches then. So each lock is checked first ``heartbeat`` seconds after
``watch()``, and every ``heartbeat`` seconds after each check, exactly as a thread of its own
would.

The same thread keeps the deadline of a statement that its owner runs on the lock's
connection (``within()``): at the deadline it calls the statement's ``expire()``, which shuts
the connection's socket down, and the statement's read ends at once with an error. So such a
statement runs on the caller's thread, not on a thread started for it (see
``DedicatedLock._within``). A deadline that falls due while a check of the watched lock runs
is kept when the check ends: the check has its own deadline, ``heartbeat``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from time import monotonic


@dataclass(eq=False)
class Watch:
    """What a watchdog watches: ``held(seconds)`` answers whether the lock is still held
    (False when the database did not answer within ``seconds``), ``on_lost`` is called once
    if it is not; ``due`` is when the next check is (``time.monotonic()``)."""

    held: Callable[[float], bool]
    heartbeat: float
    on_lost: Callable[[], None]
    due: float


@dataclass(eq=False)
class Deadline:
    """A statement's deadline: ``expire()`` is called once, from the watchdog's thread, if
    the statement has not ended by ``due`` (``time.monotonic()``); ``expired`` says so."""

    due: float
    expire: Callable[[], None]
    expired: bool = False


class Watchdog:
    """A thread that watches one lock at a time (see the module's docstring).

    ``watch()`` starts watching (and the thread, the first time), ``unwatch()`` stops
    watching (after it returns, ``on_lost`` is never called), ``close()`` ends the thread.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._condition = threading.Condition()
        self._watched: Watch | None = None
        #: The watch whose check (or whose ``on_lost``) is running, outside the condition.
        self._checking: Watch | None = None
        #: The deadline of the statement running on the watched connection, if any.
        self._deadline: Deadline | None = None
        #: When the thread wakes next, if it waits (None: only when notified).
        self._wakes_at: float | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(
        self, held: Callable[[float], bool], heartbeat: float, on_lost: Callable[[], None]
    ) -> Watch:
        """Check ``held(heartbeat)`` every ``heartbeat`` seconds from now on, in place of
        what was watched before; call ``on_lost()`` (from the watchdog's thread) the first
        time it returns False. Returns what ``unwatch()`` takes."""
        watch = Watch(held, heartbeat, on_lost, due=monotonic() + heartbeat)
        with self._condition:
            if self._closed:
                raise RuntimeError(f"{self.name}: the watchdog was closed.")
            self._watched = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            elif self._wakes_at is None or self._wakes_at > watch.due:
                self._condition.notify()  # it would wake too late for this lock's first check
        return watch

    def unwatch(self, watch: Watch) -> None:
        """Stop watching ``watch`` (if it is still watched). A check of it that is running is
        waited for: once this returns, its ``on_lost`` is never called."""
        with self._condition:
            if self._watched is watch:
                self._watched = None
            while self._checking is watch:
                self._condition.wait()

    def can_keep_deadlines(self) -> bool:
        """Can ``within()`` be used now: the thread runs, keeps no other deadline, and is
        not the caller (a check of its own can't be timed by itself)?"""
        with self._condition:
            return (
                self._thread is not None
                and self._thread.is_alive()
                and self._thread is not threading.current_thread()
                and self._deadline is None
                and not self._closed
            )

    @contextlib.contextmanager
    def within(self, seconds: float, expire: Callable[[], None]) -> Iterator[Deadline]:
        """A deadline for the block (see ``can_keep_deadlines``): ``expire()`` is called if
        the block has not ended ``seconds`` from now. Once the block has ended it is never
        called: it runs under the condition, which the block's end takes."""
        deadline = Deadline(monotonic() + seconds, expire)
        with self._condition:
            self._deadline = deadline
            if self._wakes_at is None or self._wakes_at > deadline.due:
                self._condition.notify()  # it would wake too late for this deadline
        try:
            yield deadline
        finally:
            with self._condition:
                self._deadline = None

    def close(self) -> None:
        """Stop watching and end the thread, and wait for it (unless called from it)."""
        with self._condition:
            self._watched = None
            while self._checking is not None and self._thread is not threading.current_thread():
                self._condition.wait()
            self._closed = True
            self._condition.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        with self._condition:
            while not self._closed:
                watch, deadline, now = self._watched, self._deadline, monotonic()
                if deadline is not None and not deadline.expired and now >= deadline.due:
                    deadline.expired = True
                    deadline.expire()  # a shutdown(2): it does not wait
                    continue
                if watch is None or now < watch.due:
                    # Until the next check or deadline; a lock found lost is never checked
                    # again, and with neither it waits until notified.
                    wakes_at = min(
                        math.inf if watch is None else watch.due,
                        math.inf if deadline is None or deadline.expired else deadline.due,
                    )
                    self._wakes_at = None if wakes_at == math.inf else wakes_at
                    self._condition.wait(None if self._wakes_at is None else self._wakes_at - now)
                    continue
                self._wakes_at = None
                self._checking = watch
                try:
                    self._check(watch)
                finally:
                    self._checking = None
                    self._condition.notify_all()  # an unwatch() waiting for this check

    def _check(self, watch: Watch) -> None:
        """Run one check of ``watch`` and, if the lock is lost and still watched, its
        ``on_lost``, both outside the condition (with ``_checking`` set, so that
        ``unwatch()`` waits for them). Called and returns with the condition held."""
        self._condition.release()
        try:
            held = watch.held(watch.heartbeat)
        finally:
            self._condition.acquire()
        if held:
            watch.due = monotonic() + watch.heartbeat
            return
        watch.due = math.inf  # lost: never checked again
        if self._watched is not watch:
            return  # unwatched while the check ran: its run is over
        self._condition.release()
        try:
            watch.on_lost()
        finally:
            self._condition.acquire()
