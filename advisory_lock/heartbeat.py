"""A plain lock's heartbeat: ``advisory_lock(key, heartbeat=5)`` learns within seconds that
its lock is gone, instead of at the block's end.

A session lock lives as long as the server session that took it. The session can end under
a block that is still running: killed (``pg_terminate_backend()``, ``KILL``), cut by the
network, or lost with its server in a failover. The server then frees the lock at once, and
another process may take it while the block goes on. The block's own connection can't be
asked meanwhile (it belongs to the block's thread, which is busy with the block), so the
heartbeat asks from a connection of its own: every ``heartbeat`` seconds, does the session
that took the lock (the id the server's lock table knows it by) still hold it? After a
failover the heartbeat's connection reaches the new primary, whose lock table has no such
session: the lock is lost. A check that fails, or gets no answer within ``heartbeat``
seconds (a silent network), counts as a loss too: a lock that can't be proved held must be
treated as lost. SQLite's locks are this process's own files (``LockBackend.local_locks``):
they are looked at directly, without a connection.

On a loss the handle's ``lost`` is set (``check()`` raises ``LockLost``), then ``on_lost`` is
called once, from the heartbeat's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.dedicated import dedicated_connection
from advisory_lock.dedicated import direct_alias

logger = logging.getLogger("advisory_lock")


class Heartbeat:
    """Checks every ``seconds`` that the session that took ``db_key`` on ``backend``'s
    connection holds it; ``on_lost()`` once when it does not (or can't be shown to)."""

    def __init__(
        self,
        backend: LockBackend,
        using: str,
        db_key: Any,
        seconds: float,
        on_lost: Callable[[], None],
        label: str,
    ) -> None:
        self.seconds = seconds
        self._using = using
        self._db_key = db_key
        self._label = label
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._mutex = threading.Lock()  # a stop and a loss's report, one at a time
        #: Where the lock is this process's own: asked there, from any thread.
        self._local = backend if backend.local_locks else None
        #: Else the id the server knows the holding session by, read now, in the thread
        #: that owns its connection.
        self._session = None if backend.local_locks else backend.server_session()
        self._thread = threading.Thread(
            target=self._run, name=f"advisory_lock heartbeat {label}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        questions: queue.SimpleQueue[bool] = queue.SimpleQueue()
        answers: queue.SimpleQueue[bool] = queue.SimpleQueue()
        # The questions go to a thread of their own, so that one that never gets an answer
        # (a silent network) can be given up on here, after ``seconds``.
        threading.Thread(
            target=self._answer, args=(questions, answers), name=self._thread.name, daemon=True
        ).start()
        try:
            while not self._stop.wait(self.seconds):
                questions.put(True)
                try:
                    held = answers.get(timeout=self.seconds)
                except queue.Empty:
                    held = False
                if not held:
                    with self._mutex:
                        if not self._stop.is_set():
                            self._on_lost()
                    return
        finally:
            questions.put(False)

    def _answer(
        self, questions: queue.SimpleQueue[bool], answers: queue.SimpleQueue[bool]
    ) -> None:
        """Answer each question: is the lock held? On a connection of the heartbeat's own,
        made here (a Django connection belongs to the thread that made it)."""
        connection: BaseDatabaseWrapper | None = None
        watcher: LockBackend | None = None
        while questions.get():
            try:
                if self._local is not None:
                    held = self._local.is_held(self._db_key)
                else:
                    if watcher is None:
                        alias = direct_alias(self._using)
                        label = f"heartbeat {self._label}"
                        connection = dedicated_connection(alias, label)
                        watcher = backend_for(connection)  # which refers to it weakly
                    assert self._session is not None
                    held = watcher.held_by(self._db_key, self._session)
            except Exception as error:  # unreachable, refused: not shown to be held
                logger.debug("advisory_lock heartbeat %s: %r", self._label, error)
                held = False
            answers.put(held)
        if connection is not None:
            connection.close()

    def stop(self) -> None:
        """Stop checking: after this returns, ``on_lost`` is never called. Does not wait for
        a question on its way (its thread ends once answered)."""
        with self._mutex:
            self._stop.set()
