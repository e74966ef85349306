"""A scheduler's claims: which scheduler of a fleet starts an entry's due slot.

Each entry has a claim: a session lock (key ``schedule-claim:<name>``, not the entry's own
lock) that a scheduler takes before it gives one of the entry's slots to a worker, and holds
until that run has ended and been recorded. Every scheduler tries the claims of the entries
it finds due, and only the one that gets a claim starts the slot; the others learn that it
is taken from the same statement, and start nothing.

The claims of a batch are tried in one statement (``LockBackend.try_many``) on a connection
of the scheduler's own, kept open for its life: no new connection per slot, and none while
nothing is due. A scheduler that dies, or loses that connection, loses its claims at once:
the server drops a session's locks when it ends, so no claim outlives its scheduler.

A claim decides who starts a slot; it does not guard the run. The run's guard is still the
entry's own lock, which the worker takes, and the ledger's claim of the slot (at most one
success per slot): a claim lost in an outage, or a slot that ended between a scheduler's
look at the ledger and its claim, at worst makes a worker find the entry's lock busy or its
slot taken, and skip.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable
from collections.abc import Iterable

from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.backends import backend_for
from advisory_lock.backends.base import LockBackend
from advisory_lock.dedicated import dedicated_connection
from advisory_lock.dedicated import direct_alias
from advisory_lock.keys import make_key

logger = logging.getLogger("advisory_lock")

#: At most this many claims are tried in one statement.
BATCH = 100


def claim_key(job_name: str) -> str:
    """The key of ``job_name``'s claim."""
    return f"schedule-claim:{job_name}"


class Claims:
    """The claims one scheduler holds on the database ``using``."""

    def __init__(self, using: str) -> None:
        self.using = direct_alias(using)
        #: The entries whose claim this scheduler holds.
        self.held: set[str] = set()
        self._connection: BaseDatabaseWrapper | None = None
        self._backend: LockBackend | None = None
        self._keys: dict[str, Hashable] = {}
        self._unsupported = False

    def claim(self, job_names: Iterable[str]) -> list[str]:
        """Try the claims of ``job_names`` (one statement per ``BATCH``): the names whose
        claim this scheduler took now, in their order."""
        wanted = [name for name in dict.fromkeys(job_names) if name not in self.held]
        taken: list[str] = []
        backend = self._backend_for_claims()
        if backend is None:
            return wanted  # no claims here: each slot's run finds out (see _backend_for_claims)
        for start in range(0, len(wanted), BATCH):
            batch = wanted[start : start + BATCH]
            got = backend.try_many([self._key(backend, name) for name in batch])
            taken.extend(name for name, ok in zip(batch, got, strict=True) if ok)
        self.held.update(taken)
        return taken

    def release(self, job_names: Iterable[str]) -> None:
        """Release the claims of ``job_names`` held here (one statement per ``BATCH``)."""
        names = [name for name in dict.fromkeys(job_names) if name in self.held]
        if not names:
            return
        backend = self._backend_for_claims()
        self.held.difference_update(names)
        if backend is None:
            return
        for start in range(0, len(names), BATCH):
            batch = names[start : start + BATCH]
            backend.release_many([self._key(backend, name) for name in batch])

    def close(self) -> None:
        """Close the claims' connection: the server drops every claim held on it."""
        self.held.clear()
        connection, self._connection = self._connection, None
        backend, self._backend = self._backend, None
        if connection is not None:
            with contextlib.suppress(Exception):  # a broken connection may fail to close
                connection.close()
        if backend is not None:
            backend.end_session()  # what the backend holds itself (SQLite's lock files)

    def _backend_for_claims(self) -> LockBackend | None:
        """The claims' backend; None where session locks can't be held (an alias behind a
        transaction-mode pooler, without a ``DIRECT_ALIAS``): every claim is then granted,
        and each slot's run finds out, as it would anyway (its entry's lock is refused
        there too: the run fails, saying why). Said once."""
        if self._backend is None and not self._unsupported:
            connection = dedicated_connection(self.using, "run_jobs claims")
            backend = backend_for(connection)
            if problem := backend.session_lock_problem():
                self._unsupported = True
                logger.warning("run_jobs: no claims, each scheduler tries each slot: %s", problem)
                return None
            self._connection, self._backend = connection, backend
        return self._backend

    def _key(self, backend: LockBackend, job_name: str) -> Hashable:
        key = self._keys.get(job_name)
        if key is None:
            key = self._keys[job_name] = backend.db_key(make_key(claim_key(job_name)))
        return key
