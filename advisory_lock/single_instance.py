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
from collections.abc import Callable
from typing import TYPE_CHECKING
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

if TYPE_CHECKING:
    from advisory_lock.models import JobRun

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
        wait = options.get("lock_wait")
        guarded = GuardedRun(
            self.get_lock_key(options),
            using=self.lock_using,
            label=command_label(type(self)),
            wait=self.lock_wait if wait is None else wait,
            heartbeat=self.lock_heartbeat,
            on_lost=_setting(self, "lock_on_lost"),
            period=_setting(self, "lock_ledger"),
        )
        if not guarded.start():
            return self._skip(guarded.skipped, options)
        self.lock = guarded.lock
        from_command_line = getattr(self, "_called_from_command_line", False)
        try:
            try:
                result = super().execute(*args, **options)  # type: ignore[misc]
            except BaseException as exc:
                self.lock = None
                guarded.end(exc)
                raise
            self.lock = None
            guarded.end(None)
        except LockLost as lost:
            if from_command_line:
                raise CommandError(str(lost), returncode=1) from lost
            raise
        return result

    def _skip(self, message: str, options: dict[str, Any]) -> None:
        """Say why the command did not run, then exit with the busy status."""
        OutputWrapper(options.get("stderr") or sys.stderr).write(message)
        if getattr(self, "_called_from_command_line", False):
            if self.lock_busy_exit_code:
                raise SystemExit(self.lock_busy_exit_code)
            return
        raise CommandError(message, returncode=self.lock_busy_exit_code)


class GuardedRun:
    """One run of a job under a lock of its own: the machinery of single-instance commands
    and ``run_once``.

    ``start()`` takes the lock on a dedicated connection (waiting at most ``wait`` seconds),
    claims the ledger's slot when there is a ``period``, starts the watchdog and, in the main
    thread, the signal handlers. ``end(exc)`` runs after the body, in this order: the
    watchdog stops (so a loss can no longer be signalled), the handlers are restored, the
    end is recorded in the ledger (fenced), the lock is released.

    A lost lock, with ``on_lost="raise"``, raises ``LockLost``: at once in the main thread (the
    watchdog interrupts it with SIGINT, which the run's handler turns into ``LockLost``); at
    ``end()`` elsewhere, or when the body calls ``lock.check()``.
    """

    def __init__(
        self,
        key: Key,
        *,
        using: str | None,
        label: str,
        wait: float = 0,
        heartbeat: float = 10,
        on_lost: OnLost = "raise",
        period: Period | None = None,
        retry_failed: bool = True,
    ) -> None:
        self.key = make_key(key)
        self.using = using
        self.label = label
        self.wait = wait
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.period = period
        self.retry_failed = retry_failed
        self.lock: DedicatedLock | None = None
        self.run: JobRun | None = None
        #: Why the run did not go ahead (after ``start()`` returned False).
        self.skipped = ""
        self._interrupted: list[int] = []
        self._handlers: dict[int, Any] = {}

    def start(self) -> bool:
        """Take the lock and claim the slot: True if the run goes ahead."""
        # The ledger needs Django's app registry, which is not ready when this module loads.
        from advisory_lock.ledger import claim_slot
        from advisory_lock.ledger import describe_taken

        lock = DedicatedLock(self.key, using=self.using, label=self.label)
        if not lock.acquire(self.wait):
            self.skipped = lock.busy_message()
            return False
        if self.period is not None:
            try:
                run, taken = claim_slot(
                    lock.using, self.label, self.period, self.retry_failed, held=lock.key
                )
            except BaseException:
                lock.close()  # closing the connection releases the lock
                raise
            if run is None:
                lock.close()
                self.skipped = f"{self.label}: skipped, {describe_taken(taken)}."
                return False
            run.lock = lock
            self.run = run
        self.lock = lock
        in_main_thread = threading.current_thread() is threading.main_thread()
        lock.watch(self.heartbeat, self._lost_handler(in_main_thread))
        if in_main_thread:
            self._handlers = _install_signal_handlers(lock, self._interrupted)
        return True

    def end(self, exc: BaseException | None) -> None:
        """After the body (``exc``: what it raised): record the end, release the lock.

        Raises ``LockLost`` (with ``on_lost="raise"``, and unless ``exc`` propagates) if the
        lock was lost, or the run's row was taken over meanwhile.
        """
        from advisory_lock.ledger import finish
        from advisory_lock.ledger import format_error

        lock = self.lock
        assert lock is not None, "end() after a start() that returned False"
        # The watchdog first: while it runs it may still signal, and the run's handler must
        # be the one to catch that.
        lock.stop_watching()
        _restore_signal_handlers(self._handlers)
        if exc is not None and self._interrupted and not lock.lost:
            logger.warning(
                "%s: interrupted by signal %d; lock released.", self.label, self._interrupted[0]
            )
        raising = exc is None and self.on_lost == "raise"
        problems: list[LockLost] = []
        recorded = False
        if self.run is not None:
            error = format_error(exc) if exc is not None else ""
            try:
                # After a lost lock the database may be out of reach: bounded then, so that
                # a silent network can't hold the process (the row is abandoned later).
                timeout = max(2 * self.heartbeat, 1.0) if lock.lost else None
                finish(lock.using, self.run, error=error, timeout=timeout)
                recorded = True
            except LockLost as taken_over:
                problems.append(taken_over)
            except Exception as failure:
                if exc is None and not lock.lost:
                    lock.close()
                    raise  # a success that can't be recorded must not pass silently
                logger.error(
                    "%s: could not record the end of run %s (%s); the next run will mark it "
                    "abandoned.",
                    self.label,
                    self.run.pk,
                    failure,
                )
        try:
            lock.release()
        except LockLost as lost:
            if recorded and not lock.lost:
                # The fenced end was recorded: nobody took the run over, so nobody ran it
                # meanwhile; the lock went after the work was done.
                logger.warning("%s (after the run was recorded)", lost)
            else:
                problems.append(lost)
        if problems:
            if raising:
                raise problems[0]
            for problem in problems:
                logger.error("%s", problem)

    def _lost_handler(self, in_main_thread: bool) -> Callable[[], None]:
        on_lost, lock = self.on_lost, self.lock
        assert lock is not None

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
                # installed for the run raises LockLost.
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        return lost


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
