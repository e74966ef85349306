"""``SingleInstanceMixin``: a management command runs once at a time (``@single_instance`` on a
command class makes the same subclass)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from django.apps import apps
from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.core.management.base import OutputWrapper

from advisory_lock.dedicated import DedicatedLock
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.exceptions import LockLost
from advisory_lock.expectations import Expectation
from advisory_lock.expectations import declaration_source
from advisory_lock.keys import Key
from advisory_lock.periods import Period
from advisory_lock.single_instance.guarded import GuardedRun
from advisory_lock.single_instance.guarded import OnLost
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_seconds
from advisory_lock.validation import seconds_argument
from advisory_lock.validation import wait_limit


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
    #: With a ``lock_ledger``: run ``handle()`` in ``transaction.atomic`` on the ledger's
    #: database, and commit the run's success with its writes there, or neither.
    lock_ledger_atomic: bool = False
    #: Seconds after a slot's end when a slot without a successful run is overdue (see
    #: ``advisory_lock.scheduling.overdue``); None: the command is not watched.
    lock_grace: float | None = None

    #: The lock of the running command (None before and after the run).
    lock: DedicatedLock | None = None
    #: Run by ``manage.py`` / ``django-admin`` (``run_from_argv``), not by ``call_command``.
    _from_argv = False

    def run_from_argv(self, argv: list[str]) -> None:
        """What manage.py and django-admin call (Django's documented entry point): then a
        skipped run exits with the busy status, and a lost lock is a ``CommandError``."""
        self._from_argv = True
        super().run_from_argv(argv)  # type: ignore[misc]

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
        if wait is not None:
            try:
                wait_limit("--lock-wait", wait, self.lock_using)
            except ValueError as error:  # a usage error, as any other bad --lock-wait
                raise CommandError(str(error), returncode=2) from None
        guarded = GuardedRun(
            self.get_lock_key(options),
            using=self.lock_using,
            label=command_label(type(self)),
            wait=self.lock_wait if wait is None else wait,
            heartbeat=self.lock_heartbeat,
            on_lost=_setting(self, "lock_on_lost"),
            period=_setting(self, "lock_ledger"),
            owns_process=True,
            atomic=self.lock_ledger_atomic,
            exit_after_loss=self._from_argv,
        )
        try:
            started = guarded.start()
        except LedgerNotMigrated as error:
            raise CommandError(str(error), returncode=1) from error
        if not started:
            return self._skip(guarded.skipped, options)
        self.lock = guarded.lock
        from_command_line = self._from_argv
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
        if self._from_argv:
            if self.lock_busy_exit_code:
                raise SystemExit(self.lock_busy_exit_code)
            return
        raise CommandError(message, returncode=self.lock_busy_exit_code)


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


def declared_lock_names() -> list[str]:
    """The static keys of this project's single-instance commands (callable keys excluded)."""
    names = []
    for command_class in single_instance_commands():
        key = _setting(command_class, "lock_key")
        if key is None:
            names.append(f"command:{command_label(command_class)}")
        elif isinstance(key, str):
            names.append(key)
    return names


@declaration_source
def declared_command_jobs() -> list[Expectation]:
    """The jobs that single-instance commands declare: a named ledger period and a grace
    (registered with ``advisory_lock.scheduling.overdue``, whose report calls it)."""
    jobs = []
    for command_class in single_instance_commands():
        period, grace = _setting(command_class, "lock_ledger"), command_class.lock_grace
        if isinstance(period, str) and grace is not None and not grace_problem(grace):
            jobs.append(Expectation(command_label(command_class), period, grace))
    return jobs


def grace_problem(grace: object) -> str | None:
    """What is wrong with a command's ``lock_grace`` (the system checks say it; the overdue
    report leaves the command out), or None."""
    try:
        check_seconds("lock_grace", grace, maximum=MAX_SECONDS)
    except ValueError as error:
        return str(error)
    return None


def single_instance_commands() -> list[type[SingleInstanceMixin]]:
    """This project's single-instance command classes (loading each command's module)."""
    from django.core.management import get_commands
    from django.core.management import load_command_class

    found = []
    for command_name, app_name in get_commands().items():
        if isinstance(app_name, BaseCommand):  # an already loaded command
            command_class: type = type(app_name)
        else:
            try:
                command_class = type(load_command_class(app_name, command_name))
            except Exception:  # a broken command is not ours to report here
                continue
        if issubclass(command_class, SingleInstanceMixin):
            found.append(command_class)
    return found
