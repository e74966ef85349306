"""``@single_instance`` on a function, sync or async: one call at a time, fleet-wide.

The machinery of commands (``GuardedRun``: a lock on a connection of its own, the watchdog,
the ledger) around each call, so that it can sit under a task queue's decorator::

    @app.task
    @single_instance(key=lambda tenant_id: f"import:{tenant_id}", on_busy="skip")
    def import_tenant(tenant_id): ...

A call that finds the lock busy returns None (``on_busy="skip"``: one INFO line naming the
holder, and ``lock_busy`` is sent) or raises ``LockNotAcquired`` (``on_busy="raise"``, for
a queue's retry). A call whose ledger slot is already done returns None either way: running
it again later would find the slot done again.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any
from typing import Literal

from advisory_lock import signals
from advisory_lock.exceptions import LockNotAcquired
from advisory_lock.keys import Key
from advisory_lock.keys import LockKey
from advisory_lock.keys import make_key
from advisory_lock.periods import Period
from advisory_lock.single_instance.guarded import GuardedRun
from advisory_lock.single_instance.guarded import OnLost
from advisory_lock.single_instance.guarded import check_heartbeat

logger = logging.getLogger("advisory_lock")


def single_instance_function(
    func: Callable[..., Any],
    *,
    key: Key | Callable[..., Key] | None,
    wait: float,
    using: str | None,
    heartbeat: float,
    on_lost: OnLost,
    ledger: Period | None,
    on_busy: Literal["skip", "raise"],
    atomic: bool = False,
) -> Callable[..., Any]:
    """``func`` wrapped: each call runs under ``GuardedRun`` (see the module's docstring)."""
    label = f"{func.__module__}.{func.__qualname__}"
    heartbeat = check_heartbeat(heartbeat)  # at decoration, not once the lock is held

    def guarded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> GuardedRun:
        return GuardedRun(
            _key_of_call(key, label, args, kwargs),
            using=using,
            label=label,
            wait=wait,
            heartbeat=heartbeat,
            on_lost=on_lost,
            period=ledger,
            atomic=atomic,
        )

    def skipped(run: GuardedRun) -> None:
        logger.info("%s", run.skipped)
        if run.busy:
            signals.lock_busy.send_robust(
                sender=func,
                key=run.key.value,
                name=run.key.value if isinstance(run.key.value, str) else None,
                using=using or "default",
                scope="session",
                wait_time=wait,
                hold_time=None,
            )
            if on_busy == "raise":
                raise LockNotAcquired(run.skipped)

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_call(*args: Any, **kwargs: Any) -> Any:
            run = guarded(args, kwargs)
            # The lock's connection is its own: its statements run in a worker thread. A
            # cancellation at any point lets go of what the run took (GuardedRun.astart and
            # aend), and propagates.
            outcome: BaseException | None = None
            try:
                if not await run.astart():
                    return skipped(run)
                return await func(*args, **kwargs)
            except BaseException as exc:
                outcome = exc
                raise
            finally:
                if run.holding:
                    await run.aend(outcome)

        return async_call

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        run = guarded(args, kwargs)
        outcome: BaseException | None = None
        try:
            if not run.start():  # it lets go of what it took if interrupted
                return skipped(run)
            return func(*args, **kwargs)
        except BaseException as exc:
            outcome = exc
            raise
        finally:
            if run.holding:
                run.end(outcome)

    return call


def _key_of_call(
    key: Key | Callable[..., Key] | None, label: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> LockKey:
    """The lock's key for one call: ``key``, what the ``key`` callable returns for the call's
    arguments, or ``task:<module>.<qualname>``; a clear error (before any lock) if unusable."""
    if key is None:
        return make_key(f"task:{label}")
    if not callable(key):
        return make_key(key)
    try:
        value = key(*args, **kwargs)
    except Exception as error:
        raise ValueError(
            f"The key callable of @single_instance on {label} raised {error!r} for this call: "
            f"it must return a lock key from the call's arguments."
        ) from error
    try:
        return make_key(value)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"The key callable of @single_instance on {label} returned {value!r}: {error}"
        ) from error
