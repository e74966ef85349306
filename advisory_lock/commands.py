"""``@single_instance`` and ``SingleInstanceMixin``: a management command runs once at a time.

The lock lives on a connection opened for it alone (never Django's shared connection for the
alias, never a pooled one), held for the whole run, watched by a heartbeat thread, and closed
at the end. Django's own connections are left alone: the command's queries run as usual.
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import logging
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any
from typing import TypeVar

from django.apps import apps
from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.core.management.base import OutputWrapper

from advisory_lock.exceptions import LockLost
from advisory_lock.keys import Key
from advisory_lock.keys import make_key
from advisory_lock.locks import DedicatedLock
from advisory_lock.periods import Period
from advisory_lock.periods import check_period

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
    #: What a lost lock does: "raise" (LockLost in the main thread), "warn", or a callable.
    lock_on_lost: OnLost = "raise"
    #: A ledger period ("hourly", "daily", ... or a callable): at most one successful run per
    #: slot, recorded in ``job_runs`` under the command's name. None: no ledger.
    lock_ledger: Period | None = None

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        parser = super().create_parser(prog_name, subcommand, **kwargs)  # type: ignore[misc]
        parser.add_argument(
            "--lock-wait",
            type=_seconds,
            metavar="SECONDS",
            help=(
                "Wait up to SECONDS for another instance to finish instead of skipping "
                f"(default: {self.lock_wait:g})."
            ),
        )
        return parser

    def get_lock_key(self, options: dict[str, Any]) -> Key:
        """The lock's key for this run."""
        # Read statically: a function stored on the class must not become a bound method.
        key = inspect.getattr_static(self, "lock_key")
        if isinstance(key, staticmethod | classmethod):
            key = key.__get__(self, type(self))
        if key is None:
            return f"command:{_command_label(type(self))}"
        return key(options) if callable(key) else key

    def execute(self, *args: Any, **options: Any) -> Any:
        key = make_key(self.get_lock_key(options))
        wait = options.get("lock_wait")
        wait = self.lock_wait if wait is None else wait
        label = _command_label(type(self))
        lock = DedicatedLock(key, using=self.lock_using, label=label)
        if not lock.acquire(wait):
            return self._skip(lock.busy_message(), options)
        # The ledger's models can't be imported with the app package (apps not ready then).
        from advisory_lock.ledger import claim_with_lock
        from advisory_lock.ledger import describe_taken
        from advisory_lock.models import JobRun

        interrupted: list[int] = []
        previous: dict[int, Any] = {}
        run = None
        error = ""
        try:
            if self.lock_ledger is not None:
                run, taken = claim_with_lock(
                    label, self.lock_ledger, lock, using=lock.using, retry_failed=True
                )
                if run is None:
                    return self._skip(f"{label}: skipped, {describe_taken(taken)}.", options)
            lock.watch(self.lock_heartbeat, self._lost_handler(lock))
            previous = _install_signal_handlers(lock, interrupted)
            return super().execute(*args, **options)  # type: ignore[misc]
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
            _restore_signal_handlers(previous)
            try:
                if run is not None:
                    _record_end(JobRun, run, lock, error, self.lock_heartbeat)
            finally:
                lock.release()

    def _skip(self, message: str, options: dict[str, Any]) -> None:
        """Say why the command did not run, then exit with the busy status."""
        OutputWrapper(options.get("stderr") or sys.stderr).write(message)
        if getattr(self, "_called_from_command_line", False):
            if self.lock_busy_exit_code:
                raise SystemExit(self.lock_busy_exit_code)
            return
        raise CommandError(message, returncode=self.lock_busy_exit_code)

    def _lost_handler(self, lock: DedicatedLock) -> Callable[[], None]:
        on_lost = self.lock_on_lost
        main = threading.get_ident()

        def lost() -> None:
            message = lock.lost_message()
            logger.error(message)
            if on_lost == "warn":
                return
            if callable(on_lost):
                on_lost(message)
                return
            _raise_in_thread(main, lock)

        return lost


def _record_end(job_run: Any, run: Any, lock: DedicatedLock, error: str, heartbeat: float) -> None:
    """Record the end of the run. After a failure or a lost lock the database may be down or
    out of reach: then it is best effort (bounded after a lost lock) and never hides the
    exception that is propagating (a row left running is marked abandoned by the next claim,
    since its lock is free)."""
    rows = job_run.objects.using(lock.using)
    if not lock.lost and not error:
        rows.finish(run)  # a success that can't be recorded must not pass silently
        return
    try:
        rows.finish(run, error=error, timeout=max(2 * heartbeat, 1.0) if lock.lost else None)
    except Exception as exc:
        logger.error(
            "%s: could not record the end of run %s (%s); the next run will mark it abandoned.",
            lock.label,
            run.pk,
            exc,
        )


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
        return type(command_class.__name__, (SingleInstanceMixin, command_class), attributes)

    return decorate if cls is None else decorate(cls)


def _command_label(command_class: type) -> str:
    module = command_class.__module__
    name = module.rsplit(".", 1)[-1]
    app_config = apps.get_containing_app_config(module)
    return f"{app_config.label}.{name}" if app_config else module


_SECONDS = re.compile(r"[+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _seconds(text: str) -> float:
    if not _SECONDS.fullmatch(text):  # float() also reads " 1", "1_0" and non-ASCII digits
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds >= 0")
    return value


def _checked_settings(
    key: Any, wait: Any, busy_exit_code: Any, using: Any, heartbeat: Any, on_lost: Any, ledger: Any
) -> dict[str, Any]:
    if key is not None and not callable(key):
        make_key(key)
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < float("inf"):
        raise ValueError(f"wait must be a finite number of seconds >= 0, not {wait!r}.")
    if isinstance(busy_exit_code, bool) or not isinstance(busy_exit_code, int):
        raise TypeError(f"busy_exit_code must be an int, not {busy_exit_code!r}.")
    if not 0 <= busy_exit_code <= 255:
        raise ValueError(f"busy_exit_code must be 0 to 255, not {busy_exit_code}.")
    if using is not None and not isinstance(using, str):
        raise TypeError(f"using must be a database alias (str) or None, not {using!r}.")
    if (
        isinstance(heartbeat, bool)
        or not isinstance(heartbeat, int | float)
        or not 0 < heartbeat < float("inf")
    ):
        raise ValueError(f"heartbeat must be a finite number of seconds > 0, not {heartbeat!r}.")
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
# released); a lost lock reaches a main thread blocked in sleep or I/O as a SIGINT too.


def _install_signal_handlers(lock: DedicatedLock, interrupted: list[int]) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}

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


def _raise_in_thread(thread_id: int, lock: DedicatedLock) -> None:
    """Raise LockLost in the thread running the command."""
    if thread_id == threading.main_thread().ident:
        # A signal wakes the main thread from sleep() and socket waits; our handler raises.
        signal.pthread_kill(thread_id, signal.SIGINT)
        return
    # Elsewhere (call_command in a worker thread) it is raised at the thread's next bytecode.
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(LockLost)
    )


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
        key = inspect.getattr_static(command_class, "lock_key")
        if key is None:
            names.append(f"command:{_command_label(command_class)}")
        elif isinstance(key, str):
            names.append(key)
    return names
