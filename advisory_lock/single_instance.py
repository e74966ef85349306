"""``@single_instance`` and ``SingleInstanceMixin``: a management command runs once at a time.

The lock lives on a connection opened for it alone (``DedicatedLock``), held for the whole
run, watched by a heartbeat thread, and closed at the end. Django's own connections are left
alone: the command's queries run as usual.

A lost lock interrupts a command running in the main thread at once (the watchdog sends it
SIGINT, and the handler installed for the run raises ``LockLost``). Outside the main thread
no exception can be delivered into a running thread: the command's code may call
``self.lock.check()``, and ``LockLost`` is raised when ``handle()`` returns at the latest.
"""

from __future__ import annotations

import inspect
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import cast

from django.apps import apps
from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.core.management.base import OutputWrapper

from advisory_lock.dedicated import DedicatedLock
from advisory_lock.exceptions import LockLost
from advisory_lock.keys import Key
from advisory_lock.keys import make_key
from advisory_lock.periods import Period
from advisory_lock.periods import check_period
from advisory_lock.validation import check_alias
from advisory_lock.validation import check_seconds
from advisory_lock.validation import seconds_argument

logger = logging.getLogger("advisory_lock")

C = TypeVar("C", bound=type[BaseCommand])
OnLost = str | Callable[[str], Any]
INTERRUPTED_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class SingleInstanceMixin:
    """Make a management command single-instance; settings are class attributes.

    Put it before ``BaseCommand`` in the bases. ``@single_instance`` does the same.
    """

    #: The key: a str, or a callable that receives the parsed options and returns one.
    #: Default: ``"command:<app_label>.<command name>"``.
    lock_key: Key | Callable[[dict[str, Any]], Key] | None = None
    #: Seconds to wait for the lock before skipping (0: skip at once). ``--lock-wait`` overrides.
    lock_wait: float = 0
    #: Exit status when the lock is busy and the command skipped.
    lock_busy_exit_code: int = 0
    #: Database alias that holds the lock (default: "default").
    lock_using: str | None = None
    #: Seconds between two checks that the lock is still held.
    lock_heartbeat: float = 10
    #: What a lost lock does: "raise" (LockLost), "warn", or a callable(message).
    lock_on_lost: OnLost = "raise"
    #: A ledger period ("hourly", "daily", ... or a callable): at most one successful run per
    #: slot, recorded in ``job_runs`` under the command's name. None: no ledger.
    lock_ledger: Period | None = None

    #: The lock of the running command (None before and after the run).
    lock: DedicatedLock | None = None

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)  # type: ignore[misc]
        parser.add_argument(
            "--lock-wait",
            type=seconds_argument,
            metavar="SECONDS",
            help=(
                "Wait up to SECONDS for another instance to finish instead of skipping "
                f"(default: {self.lock_wait:g})."
            ),
        )
        return parser

    def get_lock_key(self, options: dict[str, Any]) -> Key:
        """The lock's key for this run."""
        key = _setting(self, "lock_key")
        if key is None:
            return f"command:{command_label(type(self))}"
        return key(options) if callable(key) else key  # type: ignore[no-any-return]

    def execute(self, *args: Any, **options: Any) -> Any:
        key = make_key(self.get_lock_key(options))
        wait = options.get("lock_wait")
        wait = self.lock_wait if wait is None else wait
        label = command_label(type(self))
        lock = DedicatedLock(key, using=self.lock_using, label=label)
        if not lock.acquire(wait):
            return self._skip(lock.busy_message(), options)
        # The ledger needs Django's app registry, which is not ready when this module loads.
        from advisory_lock.ledger import claim_under_lock
        from advisory_lock.ledger import describe_taken
        from advisory_lock.ledger import record_end

        interrupted: list[int] = []
        previous: dict[int, Any] = {}
        run = None
        error = ""
        self.lock = lock
        try:
            period = _setting(self, "lock_ledger")
            if period is not None:
                run, taken = claim_under_lock(label, period, lock)
                if run is None:
                    return self._skip(f"{label}: skipped, {describe_taken(taken)}.", options)
            in_main_thread = threading.current_thread() is threading.main_thread()
            lock.watch(self.lock_heartbeat, self._lost_handler(lock, in_main_thread))
            if in_main_thread:
                previous = _install_signal_handlers(lock, interrupted)
            result = super().execute(*args, **options)  # type: ignore[misc]
            if _setting(self, "lock_on_lost") == "raise":
                lock.check()  # a loss the body could not be interrupted for (not main thread)
            return result
        except BaseException as exc:
            error = traceback.format_exc()
            if isinstance(exc, LockLost) and getattr(self, "_called_from_command_line", False):
                raise CommandError(str(exc), returncode=1) from exc
            if interrupted and not lock.lost:
                logger.warning(
                    "%s: interrupted by signal %d; lock released.", label, interrupted[0]
                )
            raise
        finally:
            # The watchdog first: while it runs it may still signal, and our handler must
            # be the one to catch that.
            lock.stop_watching()
            _restore_signal_handlers(previous)
            self.lock = None
            try:
                if run is not None:
                    record_end(run, lock, error, self.lock_heartbeat)
            finally:
                # A loss already reported to on_lost="warn" or a callable is not raised again.
                _release(lock, raising=not error and _setting(self, "lock_on_lost") == "raise")

    def _skip(self, message: str, options: dict[str, Any]) -> None:
        """Say why the command did not run, then exit with the busy status."""
        OutputWrapper(options.get("stderr") or sys.stderr).write(message)
        if getattr(self, "_called_from_command_line", False):
            if self.lock_busy_exit_code:
                raise SystemExit(self.lock_busy_exit_code)
            return
        raise CommandError(message, returncode=self.lock_busy_exit_code)

    def _lost_handler(self, lock: DedicatedLock, in_main_thread: bool) -> Callable[[], None]:
        on_lost = _setting(self, "lock_on_lost")

        def lost() -> None:
            message = lock.lost_message()
            logger.error(message)
            if on_lost == "warn":
                return
            if callable(on_lost):
                on_lost(message)
                return
            if in_main_thread:
                # A signal wakes the main thread from sleep() and socket waits; the handler
                # installed for the run raises LockLost. (The watchdog is stopped before the
                # handler is removed, so this never reaches the host's own handler.)
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        return lost


def _release(lock: DedicatedLock, *, raising: bool) -> None:
    """Release the run's lock; a loss found now raises unless an error already propagates."""
    try:
        lock.release()
    except LockLost as lost:
        if raising:
            raise
        logger.error("%s", lost)


def single_instance(
    cls: C | None = None,
    *,
    key: Key | Callable[[dict[str, Any]], Key] | None = None,
    wait: float = 0,
    busy_exit_code: int = 0,
    using: str | None = None,
    heartbeat: float = 10,
    on_lost: OnLost = "raise",
    ledger: Period | None = None,
) -> Any:
    """Class decorator for a ``BaseCommand``: the same as ``SingleInstanceMixin`` with settings.

    Use bare (``@single_instance``) or with arguments (``@single_instance(wait=30)``).
    """
    settings = _checked_settings(key, wait, busy_exit_code, using, heartbeat, on_lost, ledger)

    def decorate(command_class: C) -> C:
        if not (isinstance(command_class, type) and issubclass(command_class, BaseCommand)):
            raise TypeError(
                f"@single_instance decorates a BaseCommand subclass, not {command_class!r}."
            )
        attributes = {
            "__module__": command_class.__module__,
            "__qualname__": command_class.__qualname__,
            "__doc__": command_class.__doc__,
            **settings,
        }
        subclass = type(command_class.__name__, (SingleInstanceMixin, command_class), attributes)
        return cast("C", subclass)  # a subclass of command_class, which type() can't express

    return decorate if cls is None else decorate(cls)


def _setting(command: Any, name: str) -> Any:
    """A ``lock_*`` attribute as set on the class: read statically, so that a function set
    there (a key or period callable) is never bound to the command as a method."""
    value = inspect.getattr_static(command, name)
    if isinstance(value, staticmethod):
        return value.__func__
    if isinstance(value, classmethod):
        return value.__get__(None, command if isinstance(command, type) else type(command))
    return value


def command_label(command_class: type) -> str:
    """``<app_label>.<command name>``: the command's name in messages and in the ledger."""
    module = command_class.__module__
    name = module.rsplit(".", 1)[-1]
    app_config = apps.get_containing_app_config(module)
    return f"{app_config.label}.{name}" if app_config else module


def _checked_settings(
    key: Any, wait: Any, busy_exit_code: Any, using: Any, heartbeat: Any, on_lost: Any, ledger: Any
) -> dict[str, Any]:
    if key is not None and not callable(key):
        make_key(key)
    check_seconds("wait", wait)
    if isinstance(busy_exit_code, bool) or not isinstance(busy_exit_code, int):
        raise TypeError(f"busy_exit_code must be an int, not {busy_exit_code!r}.")
    if not 0 <= busy_exit_code <= 255:
        raise ValueError(f"busy_exit_code must be 0 to 255, not {busy_exit_code}.")
    check_alias(using)
    check_seconds("heartbeat", heartbeat, allow_zero=False)
    if on_lost not in ("raise", "warn") and not callable(on_lost):
        raise ValueError(f"on_lost must be 'raise', 'warn' or a callable, not {on_lost!r}.")
    return {
        "lock_key": key,
        "lock_wait": wait,
        "lock_busy_exit_code": busy_exit_code,
        "lock_using": using,
        "lock_heartbeat": heartbeat,
        "lock_on_lost": on_lost,
        "lock_ledger": None if ledger is None else check_period(ledger),
    }


# Signals: SIGTERM and SIGINT stop the command through its finally blocks (so the lock is
# released and the run recorded); a lost lock reaches a main thread blocked in sleep() or
# I/O as a SIGINT, which the handler turns into LockLost.


def _install_signal_handlers(lock: DedicatedLock, interrupted: list[int]) -> dict[int, Any]:
    def handler(signum: int, frame: Any) -> None:
        if lock.lost:
            raise LockLost(lock.lost_message())
        interrupted.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(INTERRUPTED_EXIT_CODES[signal.Signals(signum)])

    return {signum: signal.signal(signum, handler) for signum in INTERRUPTED_EXIT_CODES}


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def declared_lock_names() -> list[str]:
    """The static keys of this project's single-instance commands (callable keys excluded)."""
    from django.core.management import get_commands
    from django.core.management import load_command_class

    names = []
    for command_name, app_name in get_commands().items():
        if isinstance(app_name, BaseCommand):  # an already loaded command
            command_class: type = type(app_name)
        else:
            try:
                command_class = type(load_command_class(app_name, command_name))
            except Exception:  # a broken command is not ours to report here
                continue
        if not issubclass(command_class, SingleInstanceMixin):
            continue
        key = _setting(command_class, "lock_key")
        if key is None:
            names.append(f"command:{command_label(command_class)}")
        elif isinstance(key, str):
            names.append(key)
    return names
