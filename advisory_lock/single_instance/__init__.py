"""``@single_instance``: one instance at a time of a management command or a function, fleet-wide.

- ``commands``: ``SingleInstanceMixin``, what the decorator makes of a command class;
- ``functions``: what it makes of a function (sync or async), e.g. under a task decorator;
- ``guarded``: ``GuardedRun``, the lock on its own connection, the watchdog, the ledger.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Callable
from collections.abc import Coroutine
from typing import Any
from typing import Literal
from typing import ParamSpec
from typing import Protocol
from typing import TypeVar
from typing import cast
from typing import overload

from django.core.management.base import BaseCommand

from advisory_lock.expectations import declare
from advisory_lock.keys import Key
from advisory_lock.keys import make_key
from advisory_lock.periods import check_period
from advisory_lock.single_instance.commands import SingleInstanceMixin
from advisory_lock.single_instance.commands import command_label
from advisory_lock.single_instance.commands import declared_command_jobs
from advisory_lock.single_instance.commands import declared_lock_names
from advisory_lock.single_instance.functions import single_instance_function
from advisory_lock.single_instance.guarded import GuardedRun
from advisory_lock.single_instance.guarded import OnLost
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_flag
from advisory_lock.validation import check_seconds
from advisory_lock.validation import wait_limit

__all__ = [
    "GuardedRun",
    "SingleInstanceMixin",
    "command_label",
    "declared_command_jobs",
    "declared_lock_names",
    "single_instance",
]

C = TypeVar("C", bound=type[BaseCommand])
P = ParamSpec("P")
R = TypeVar("R")
#: What a function's call that finds the lock busy does: return None, or raise LockNotAcquired.
OnBusy = Literal["skip", "raise"]
ON_BUSY: tuple[OnBusy, ...] = ("skip", "raise")
#: A ledger period: one of ``advisory_lock.periods.PERIODS``, or a callable from the time (in
#: the ledger's time zone) to the slot's name.
LedgerPeriod = (
    Literal["once", "hourly", "daily", "weekly", "monthly"] | Callable[[datetime.datetime], str]
)
#: A key, or a callable that makes it: from a command's parsed options, or from a function
#: call's arguments (whatever the function takes, hence ``...``).
KeyOrCallable = Key | Callable[..., Key]


class FunctionDecorator(Protocol):
    """``@single_instance(..., on_busy=...)``: it decorates a function, sync or async; a call
    returns the function's result, or None when skipped (the lock busy with
    ``on_busy="skip"``, the ledger's slot done)."""

    @overload
    def __call__(
        self, target: Callable[P, Coroutine[Any, Any, R]], /
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, target: Callable[P, R], /) -> Callable[P, R | None]: ...


class SingleInstanceDecorator(Protocol):
    """``@single_instance(...)`` without ``on_busy``: as ``FunctionDecorator``, and it also
    decorates a command class (it gives a subclass of it)."""

    @overload
    def __call__(self, target: C, /) -> C: ...
    @overload
    def __call__(
        self, target: Callable[P, Coroutine[Any, Any, R]], /
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
    @overload
    def __call__(self, target: Callable[P, R], /) -> Callable[P, R | None]: ...


# Bare, on a command class, an async function or a sync function (the first overload that
# matches wins: an async function is a callable too, whose wrapper returns a coroutine).
@overload
def single_instance(target: C) -> C: ...
@overload
def single_instance(
    target: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
@overload
def single_instance(target: Callable[P, R]) -> Callable[P, R | None]: ...
# With arguments: on_busy is for functions only (a command raises TypeError).
@overload
def single_instance(
    target: None = None,
    *,
    key: KeyOrCallable | None = None,
    wait: float = 0,
    busy_exit_code: int = 0,
    using: str | None = None,
    heartbeat: float = 10,
    on_lost: OnLost = "raise",
    ledger: LedgerPeriod | None = None,
    on_busy: OnBusy,
    grace: float | None = None,
    atomic: bool = False,
) -> FunctionDecorator: ...
@overload
def single_instance(
    target: None = None,
    *,
    key: KeyOrCallable | None = None,
    wait: float = 0,
    busy_exit_code: int = 0,
    using: str | None = None,
    heartbeat: float = 10,
    on_lost: OnLost = "raise",
    ledger: LedgerPeriod | None = None,
    on_busy: None = None,
    grace: float | None = None,
    atomic: bool = False,
) -> SingleInstanceDecorator: ...
def single_instance(
    target: Any = None,
    *,
    key: KeyOrCallable | None = None,
    wait: float = 0,
    busy_exit_code: int = 0,
    using: str | None = None,
    heartbeat: float = 10,
    on_lost: OnLost = "raise",
    ledger: LedgerPeriod | None = None,
    on_busy: OnBusy | None = None,
    grace: float | None = None,
    atomic: bool = False,
) -> Any:
    """Decorate a ``BaseCommand`` subclass or a function (sync or async): one instance runs
    at a time, fleet-wide.

    Use bare (``@single_instance``) or with arguments (``@single_instance(wait=30)``). For a
    command the same as ``SingleInstanceMixin`` with these settings. For a function, ``key``
    is a key or a callable taking the call's arguments (default ``task:<module>.<qualname>``),
    and ``on_busy`` says what a call that finds the lock busy does: ``"skip"`` (the default:
    return None) or ``"raise"`` (``LockNotAcquired``). ``grace`` (seconds) declares the job
    for the overdue report: a slot without a successful run is overdue that long after its
    end (``advisory_lock.scheduling.overdue``). ``atomic=True`` (with a ``ledger``, sync code
    only): the body runs in ``transaction.atomic`` on the ledger's database, and the run's
    success commits with its writes there, or neither does (docs/jobs.md).
    """
    settings = _checked_settings(
        key, wait, busy_exit_code, using, heartbeat, on_lost, ledger, on_busy, grace, atomic
    )

    def decorate(decorated: Any) -> Any:
        if isinstance(decorated, type) and issubclass(decorated, BaseCommand):
            if on_busy is not None:
                raise TypeError(
                    "on_busy= is for functions; a command that finds the lock busy exits with "
                    "busy_exit_code."
                )
            return _command_subclass(decorated, settings)
        if inspect.isfunction(decorated) or inspect.iscoroutinefunction(decorated):
            if busy_exit_code:
                raise TypeError("busy_exit_code= is for commands; a function uses on_busy=.")
            if atomic and inspect.iscoroutinefunction(decorated):
                raise TypeError(
                    f"@single_instance(atomic=True) on the coroutine function "
                    f"{decorated.__qualname__}: atomic=True is for sync code. Django's "
                    f"transactions do not work in async code: write the job as a sync "
                    f"function and call it through sync_to_async()."
                )
            if grace is not None and isinstance(ledger, str):
                declare(f"{decorated.__module__}.{decorated.__qualname__}", ledger, grace)
            return single_instance_function(
                decorated,
                key=key,
                wait=wait,
                using=using,
                heartbeat=heartbeat,
                on_lost=on_lost,
                ledger=settings["lock_ledger"],
                on_busy=on_busy or "skip",
                atomic=atomic,
            )
        raise TypeError(
            f"@single_instance decorates a BaseCommand subclass or a function, not {decorated!r}."
        )

    return decorate if target is None else decorate(target)


def _command_subclass(command_class: C, settings: dict[str, Any]) -> C:
    attributes = {
        "__module__": command_class.__module__,
        "__qualname__": command_class.__qualname__,
        "__doc__": command_class.__doc__,
        **settings,
    }
    subclass = type(command_class.__name__, (SingleInstanceMixin, command_class), attributes)
    return cast("C", subclass)  # a subclass of command_class, which type() can't express


def _checked_settings(
    key: Any,
    wait: Any,
    busy_exit_code: Any,
    using: Any,
    heartbeat: Any,
    on_lost: Any,
    ledger: Any,
    on_busy: Any,
    grace: Any,
    atomic: Any,
) -> dict[str, Any]:
    if key is not None and not callable(key):
        make_key(key)
    check_seconds("wait", wait)
    wait_limit("wait", wait, using)  # now if the database is known, else before locking
    if isinstance(busy_exit_code, bool) or not isinstance(busy_exit_code, int):
        raise TypeError(f"busy_exit_code must be an int, not {busy_exit_code!r}.")
    if not 0 <= busy_exit_code <= 255:
        raise ValueError(f"busy_exit_code must be 0 to 255, not {busy_exit_code}.")
    check_alias(using)
    check_seconds("heartbeat", heartbeat, allow_zero=False)
    if on_lost not in ("raise", "warn") and not callable(on_lost):
        raise ValueError(f"on_lost must be 'raise', 'warn' or a callable, not {on_lost!r}.")
    if on_busy is not None and on_busy not in ON_BUSY:
        raise ValueError(f"on_busy must be 'skip' or 'raise', not {on_busy!r}.")
    check_flag("atomic", atomic)
    if atomic and ledger is None:
        raise ValueError(
            "atomic=True commits the run's success in the ledger together with its writes: "
            "it needs a ledger period (ledger=...)."
        )
    if grace is not None:
        check_seconds("grace", grace, maximum=MAX_SECONDS)
        if not isinstance(ledger, str) or ledger == "once":
            raise ValueError(
                "grace= declares a job for the overdue report: it needs a named ledger period "
                "that ends (hourly, daily, weekly or monthly)."
            )
    return {
        "lock_key": key,
        "lock_wait": wait,
        "lock_busy_exit_code": busy_exit_code,
        "lock_using": using,
        "lock_heartbeat": heartbeat,
        "lock_on_lost": on_lost,
        "lock_ledger": None if ledger is None else check_period(ledger),
        "lock_grace": grace,
        "lock_ledger_atomic": atomic,
    }
