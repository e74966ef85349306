"""``run_once``: a block or a function that runs at most once per slot of the ``job_runs``
ledger, one instance at a time: a ``GuardedRun`` (the machinery of single-instance commands)
under the lock ``job:<job_name>``, around the body.

Imported on first use of ``advisory_lock.run_once``, not with the package: the ledger needs
Django's app registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from advisory_lock.ledger import JobRun
from advisory_lock.periods import Period
from advisory_lock.periods import check_job_name
from advisory_lock.periods import check_period
from advisory_lock.single_instance import GuardedRun
from advisory_lock.single_instance.guarded import check_heartbeat
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag

logger = logging.getLogger("advisory_lock")
Func = TypeVar("Func", bound=Callable[..., Any])


class run_once:
    """Claim the job's slot, run the body, record ``succeeded`` or ``failed``.

    As a context manager it gives the running ``JobRun``, or ``None`` when the slot is
    already taken or another instance is running the job (the body then returns early). As a
    decorator a skipped call returns ``None`` without running. The lock ``job:<job_name>``
    is held on a connection of its own during the run and watched every ``heartbeat``
    seconds, as for single-instance commands: a lost lock raises ``LockLost``.

    Whatever interrupts a run, a cancelled task included, lets go of all it took before it
    propagates: the lock is released, its connection closed, the run recorded ``failed``
    ("cancelled ..." for a cancellation). A ``heartbeat`` the watchdog can't wait on is a
    ``ValueError`` here, before anything is taken.

    ``atomic=True`` (sync code only): the body runs in ``transaction.atomic`` on the
    ledger's database, and the run's success is written in that transaction, so the body's
    writes there and the success commit together or not at all (docs/jobs.md).
    """

    def __init__(
        self,
        job_name: str,
        *,
        period: Period = "daily",
        using: str | None = None,
        retry_failed: bool = True,
        heartbeat: float = 10,
        atomic: bool = False,
    ) -> None:
        self.job_name = check_job_name(job_name)
        self.period = check_period(period)
        self.using = check_alias(using)
        self.retry_failed = check_flag("retry_failed", retry_failed)
        self.heartbeat = check_heartbeat(heartbeat)
        self.atomic = check_flag("atomic", atomic)
        self._stacks: dict[object, list[GuardedRun | None]] = {}

    def __enter__(self) -> JobRun | None:
        guarded = self._guarded()
        started = guarded.start()
        self._push(guarded if started else None)
        if not started:
            logger.info("%s", guarded.skipped)
            return None
        return guarded.run

    def __exit__(self, exc_type: Any, exc_value: BaseException | None, tb: Any) -> None:
        guarded = self._pop()
        if guarded is not None:
            guarded.end(exc_value)

    async def __aenter__(self) -> JobRun | None:
        # The lock's connection and the ledger's writes are connections of their own: their
        # statements run in a worker thread, without holding up the thread of the ORM calls.
        # Cancelled meanwhile, the run lets go of what it took (see GuardedRun.astart).
        self._check_sync("async with run_once(...)")
        guarded = self._guarded()
        started = await guarded.astart()
        self._push(guarded if started else None)
        if not started:
            logger.info("%s", guarded.skipped)
            return None
        return guarded.run

    async def __aexit__(self, exc_type: Any, exc_value: BaseException | None, tb: Any) -> None:
        guarded = self._pop()
        if guarded is not None:
            # Run to its end even if the task is cancelled meanwhile (raised after).
            await guarded.aend(exc_value)

    def __call__(self, func: Func) -> Func:
        if inspect.iscoroutinefunction(func):
            self._check_sync(f"@run_once on the coroutine function {func.__qualname__}")

            @functools.wraps(func)
            async def async_inner(*args: Any, **kwargs: Any) -> Any:
                async with self as run:
                    if run is None:
                        return None
                    return await func(*args, **kwargs)

            return async_inner  # type: ignore[return-value]

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self as run:
                if run is None:
                    return None
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def _guarded(self) -> GuardedRun:
        return GuardedRun(
            f"job:{self.job_name}",
            using=self.using,
            label=self.job_name,
            heartbeat=self.heartbeat,
            period=self.period,
            retry_failed=self.retry_failed,
            atomic=self.atomic,
        )

    def _check_sync(self, where: str) -> None:
        if self.atomic:
            raise TypeError(
                f"{where}: atomic=True is for sync code. Django's transactions do not work "
                f"in async code: write the job as a sync function, decorate it with "
                f"@run_once(..., atomic=True), and call it through sync_to_async()."
            )

    # The runs this object is in, innermost last: per asyncio task in async code, else per
    # thread (one object may be used by several at once).

    def _push(self, guarded: GuardedRun | None) -> None:
        self._stacks.setdefault(_owner(), []).append(guarded)

    def _pop(self) -> GuardedRun | None:
        owner = _owner()
        stack = self._stacks[owner]
        guarded = stack.pop()
        if not stack:
            del self._stacks[owner]
        return guarded


def _owner() -> object:
    """The asyncio task running this code, else the thread."""
    with contextlib.suppress(RuntimeError):  # no running event loop: sync code
        return asyncio.current_task()
    return threading.get_ident()
