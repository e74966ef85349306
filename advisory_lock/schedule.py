"""The schedule: ``ADVISORY_LOCK["SCHEDULE"]``, its entries and their slots.

An entry runs a management command (``command``, optional ``args``) or an importable callable
(``callable``), or enqueues a task (``task``: a ``django.tasks`` or Celery task, optional
JSON-serialisable ``args`` and ``kwargs``; see ``advisory_lock.queues``), on a cron expression
(``cron``, five fields or one of cron's aliases such as ``@daily``, in the ledger's time zone)
or every ``every`` seconds (the multiples of ``every`` since the Unix epoch). Each firing time
is a slot of the ``job_runs`` ledger: job name = the entry's name, period = the slot's start
in ISO 8601 in the ledger's time zone (with seconds when ``every`` is below a minute, and the
UTC offset in the hour that repeats when DST ends), so that it succeeds (or is enqueued) at
most once fleet-wide.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import fields
from typing import Any

from django.utils.module_loading import import_string

from advisory_lock.conf import get_setting
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.periods import check_job_name
from advisory_lock.periods import ledger_time_zone
from advisory_lock.queues import queue_for
from advisory_lock.validation import MAX_SECONDS
from advisory_lock.validation import check_seconds

CATCH_UP = ("latest", "all", "none")
#: The most retries of a slot: its attempts (1 + retries) are counted in a 32-bit column.
MAX_RETRIES = 2**31 - 2
#: At most this many missed slots are run by one scheduler pass with ``catch_up="all"``.
MAX_CATCH_UP = 100
#: The most slots ``alert_after`` can ask to look at (each a ledger row read per report).
MAX_ALERT_AFTER = 1000
UTC = datetime.timezone.utc
#: Cron's aliases (cron(8), as Vixie cron and cronie read them: lower case only), and the five
#: fields each stands for. cronsim reads five fields only: an alias is translated first.
CRON_ALIASES = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}


@dataclass(frozen=True)
class Entry:
    """One scheduled job. Its fields, less ``name``, are the keys an entry of ``SCHEDULE``
    accepts (``OPTIONS``): a key is added here, and nowhere else."""

    name: str
    command: str | None = None
    args: tuple[Any, ...] = ()
    callable: str | None = None
    #: A task to enqueue (its dotted path), with ``args`` and ``kwargs``.
    task: str | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()
    cron: str | None = None
    every: float | None = None
    catch_up: str = "latest"
    retries: int = 1
    timeout: float | None = None
    grace: float | None = None
    #: The job runs in a transaction on the ledger's database that commits its success.
    atomic: bool = False
    #: The entry is flagged as failing (the Schedule page, ``job_runs --overdue``) when its
    #: last ``alert_after`` slots that ran all failed.
    alert_after: int = 3

    @property
    def interval(self) -> float:
        """Seconds between two slots (for cron: 60 s, its finest step)."""
        return self.every if self.every is not None else 60.0

    def lock_key(self) -> str:
        return f"schedule:{self.name}"

    def slots_before(self, moment: datetime.datetime) -> Iterator[datetime.datetime]:
        """The entry's slots at or before ``moment``, newest first (aware, UTC)."""
        if self.every is not None:
            step = datetime.timedelta(seconds=self.every)
            epoch = datetime.datetime(1970, 1, 1, tzinfo=UTC)
            current = epoch + step * ((moment - epoch) // step)  # floor: before 1970 too
            while True:
                yield current
                try:
                    current -= step
                except OverflowError:
                    return  # the earliest slot a datetime can hold
        else:
            from cronsim import CronSim

            # cronsim yields firing times strictly before its start when reversed.
            start = (moment + datetime.timedelta(seconds=1)).astimezone(ledger_time_zone())
            fields = cron_fields(self.cron or "")
            for firing in CronSim(fields, start.replace(microsecond=0), reverse=True):
                if firing <= moment:
                    yield firing.astimezone(UTC)

    def next_slot(self, moment: datetime.datetime) -> datetime.datetime:
        """The entry's first slot after ``moment`` (aware, UTC)."""
        if self.every is not None:
            return next(self.slots_before(moment)) + datetime.timedelta(seconds=self.every)
        from cronsim import CronSim

        start = moment.astimezone(ledger_time_zone()).replace(microsecond=0)
        return next(iter(CronSim(cron_fields(self.cron or ""), start))).astimezone(UTC)

    def slot_name(self, slot: datetime.datetime) -> str:
        """The ledger period of ``slot``: its start in ISO 8601, in the ledger's time zone."""
        local = slot.astimezone(ledger_time_zone())
        name = local.strftime("%Y-%m-%dT%H:%M:%S" if self.interval < 60 else "%Y-%m-%dT%H:%M")
        # The hour that repeats when DST ends: its second pass gets its offset, a slot of its own.
        return name + local.strftime("%z") if local.fold else name

    def target(self) -> Callable[[], Any]:
        """What a run calls: the command with its arguments, or the callable; for a task,
        a function that enqueues it and returns its id in the queue."""
        if self.task is not None:
            task = import_string(self.task)
            queue = queue_for(task)
            task_args, task_kwargs = list(self.args), dict(self.kwargs)
            return lambda: queue.enqueue(task, task_args, task_kwargs)
        if self.command is not None:
            from django.core.management import call_command

            command, args = self.command, self.args
            return lambda: call_command(command, *args)
        return import_string(self.callable or "")  # type: ignore[no-any-return]


#: The keys an entry of ``SCHEDULE`` accepts: the fields of ``Entry`` but its name (the
#: entry's key in ``SCHEDULE``), in their order. Validation, the system check's hint and the
#: unknown-key message all read them here.
OPTIONS = tuple(field.name for field in fields(Entry) if field.name != "name")
#: An entry has exactly one of these (what it runs)...
TARGETS = ("command", "callable", "task")
#: ...and exactly one of these (when).
WHEN = ("cron", "every")
assert set(TARGETS + WHEN) <= set(OPTIONS)


def _one_of(keys: tuple[str, ...]) -> str:
    return ", ".join(keys[:-1]) + f" or {keys[-1]}"


#: What an entry is: every key it accepts, and the limits of its values (the hint of the
#: system check, which the admin's Schedule page can show beside ``schedule_problems()``).
SCHEDULE_HINT = (
    f"An entry has exactly one of {_one_of(TARGETS)} (what it runs), exactly one of "
    f"{_one_of(WHEN)} (when: five cron fields or one of {', '.join(CRON_ALIASES)}; or "
    f"seconds), and optionally "
    f"{_one_of(tuple(key for key in OPTIONS if key not in TARGETS + WHEN))}; e.g. "
    '{"command": "nightly_report", "cron": "0 3 * * *"} or '
    '{"callable": "feeds.jobs.poll", "every": 30}. Its name is the job name of its runs: at '
    f"most {MAX_JOB_NAME_LENGTH} characters, without NUL; its seconds are at most a century "
    f"({MAX_SECONDS})."
)


def schedule_problems() -> list[str]:
    """Every problem of ``ADVISORY_LOCK["SCHEDULE"]``, entry by entry; empty if it can be
    scheduled. What the system check warns of (``advisory_lock.W011``), ``run_jobs`` refuses
    to start on, and the admin's Schedule page shows."""
    schedule = get_setting("SCHEDULE")
    if not isinstance(schedule, dict):
        return [
            f"ADVISORY_LOCK['SCHEDULE'] must be a dict of entry names to entries, not "
            f"{schedule!r}."
        ]
    return [
        problem for name, options in schedule.items() for problem in entry_problems(name, options)
    ]


def entries() -> dict[str, Entry]:
    """The schedule's entries. Raises ``ValueError`` naming the first problem of a schedule
    that has one (``schedule_problems()`` lists them all): ``run_jobs`` refuses to start on
    it, and the admin's Schedule page says why."""
    problems = schedule_problems()
    if problems:
        raise ValueError(problems[0])
    return {name: _entry(name, options) for name, options in get_setting("SCHEDULE").items()}


def usable_entries() -> dict[str, Entry]:
    """The schedule's entries that have no problem (a bad one is the system checks' to
    report): for the overdue report and pruning, which must not lose every entry to one."""
    setting = get_setting("SCHEDULE")
    return {
        name: _entry(name, options)
        for name, options in (setting.items() if isinstance(setting, dict) else ())
        if not entry_problems(name, options)
    }


def entry_from(name: str, options: dict[str, Any]) -> Entry:
    """The ``Entry`` of a valid entry kept elsewhere than the setting, with the keys of one
    (``scheduling.stored``): ``entry_problems`` finds nothing wrong with it."""
    return _entry(name, options)


def _entry(name: str, options: dict[str, Any]) -> Entry:
    """The ``Entry`` of a valid entry: each key is the field of its name (the entry's lists
    and dicts made tuples, so that an ``Entry`` is hashable and can't change)."""
    values = dict(options)
    if "args" in values:
        values["args"] = tuple(values["args"])
    if "kwargs" in values:
        values["kwargs"] = tuple(values["kwargs"].items())
    if "every" in values:
        values["every"] = float(values["every"])
    return Entry(name=name, **values)


#: What the problems of an entry of ``ADVISORY_LOCK["SCHEDULE"]`` name it by.
SETTING = "ADVISORY_LOCK['SCHEDULE']"


def entry_problems(name: object, options: object, *, schedule: str = SETTING) -> list[str]:
    """What is wrong with one SCHEDULE entry (for the system checks); empty if it is fine.
    ``schedule`` names the schedule the entry is in, in each message (``SETTING``, or the
    table of the entries stored in the database): the messages are the same for both.

    Every value the entry makes the ledger store is checked against the ledger's columns: its
    name is the job name of its runs (and names their lock), and its numbers must make dates
    and timedeltas (``MAX_SECONDS``) and attempts (``MAX_RETRIES``) the code can compute.
    """
    if not isinstance(name, str) or not name.strip():
        return [f"{schedule} has an entry name that is not a non-blank str: {name!r}."]
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}..."
    where = f"{schedule}[{shown}]"
    try:
        check_job_name(name, "its name")
    except ValueError as error:
        return [
            f"{where} can't be scheduled: the entry's name is the job name of its runs in "
            f"the ledger, and {error}"
        ]
    if not isinstance(options, dict):
        return [
            f"{where} must be a dict (command, callable or task; cron or every), not {options!r}."
        ]
    problems = []
    unknown = sorted(set(options) - set(OPTIONS), key=str)
    if unknown:
        problems.append(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"{', '.join(OPTIONS)}."
        )
    targets = [key for key in TARGETS if key in options]
    if len(targets) != 1:
        problems.append(f"{where} needs exactly one of {_quoted(TARGETS)}.")
    elif "command" in options:
        problems += _command_problems(where, options)
    elif "task" in options:
        problems += _task_problems(where, options)
    elif not _importable(options["callable"]):
        problems.append(
            f"{where}['callable'] = {options['callable']!r} can't be imported (a dotted path "
            f"to a function, e.g. 'feeds.jobs.poll')."
        )
    if "kwargs" in options and "task" not in options:
        problems.append(f"{where}['kwargs'] goes with 'task' only.")
    if sum(key in options for key in WHEN) != 1:
        problems.append(f"{where} needs exactly one of {_quoted(WHEN)}.")
    elif "cron" in options:
        problems += _cron_problems(where, options["cron"])
    else:
        every = options["every"]
        if isinstance(every, bool) or not isinstance(every, int | float) or not every >= 1:
            problems.append(f"{where}['every'] must be a number of seconds >= 1, not {every!r}.")
        elif every > MAX_SECONDS:
            problems.append(
                f"{where}['every'] must be a number of seconds >= 1 and at most {MAX_SECONDS} "
                f"(a century), not {every!r}: a slot that far apart can't be computed."
            )
    if options.get("catch_up", "latest") not in CATCH_UP:
        problems.append(
            f"{where}['catch_up'] must be one of {', '.join(map(repr, CATCH_UP))}, not "
            f"{options['catch_up']!r}."
        )
    retries = options.get("retries", 1)
    if (
        isinstance(retries, bool)
        or not isinstance(retries, int)
        or not 0 <= retries <= MAX_RETRIES
    ):
        problems.append(
            f"{where}['retries'] must be a whole number >= 0 and at most {MAX_RETRIES} (the "
            f"ledger counts attempts in a 32-bit column), not {retries!r}."
        )
    alert_after = options.get("alert_after", 3)
    if (
        isinstance(alert_after, bool)
        or not isinstance(alert_after, int)
        or not 1 <= alert_after <= MAX_ALERT_AFTER
    ):
        problems.append(
            f"{where}['alert_after'] must be a whole number >= 1 and at most {MAX_ALERT_AFTER} "
            f"(the slots that must all have failed to flag the entry), not {alert_after!r}."
        )
    for seconds in ("timeout", "grace"):
        if options.get(seconds) is not None:
            try:
                check_seconds(
                    seconds, options[seconds], allow_zero=seconds == "grace", maximum=MAX_SECONDS
                )
            except ValueError as error:
                problems.append(f"{where}: {error}")
    if not isinstance(options.get("atomic", False), bool):
        problems.append(f"{where}['atomic'] must be True or False, not {options['atomic']!r}.")
    return problems


def _command_problems(where: str, options: dict[str, Any]) -> list[str]:
    from django.core.management import get_commands

    problems = []
    if options["command"] not in get_commands():
        problems.append(f"{where}['command'] = {options['command']!r} is not a known command.")
    args = options.get("args", [])
    if not isinstance(args, list | tuple) or not all(isinstance(arg, str) for arg in args):
        problems.append(f"{where}['args'] must be a list of strings, not {args!r}.")
    return problems


def _task_problems(where: str, options: dict[str, Any]) -> list[str]:
    path = options["task"]
    try:
        task = import_string(path) if isinstance(path, str) else None
    except ImportError:
        task = None
    if task is None:
        return [
            f"{where}['task'] = {path!r} can't be imported (a dotted path to a django.tasks "
            f"or Celery task, e.g. 'billing.tasks.send_invoices')."
        ]
    try:
        queue_for(task)
    except TypeError as error:
        return [f"{where}['task'] = {path!r}: {error}"]
    problems = []
    args, kwargs = options.get("args", []), options.get("kwargs", {})
    if not isinstance(args, list | tuple):
        problems.append(f"{where}['args'] must be a list, not {args!r}.")
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        problems.append(f"{where}['kwargs'] must be a dict with str keys, not {kwargs!r}.")
    try:
        json.dumps([args, kwargs])
    except (TypeError, ValueError) as error:
        problems.append(
            f"{where}: a task's 'args' and 'kwargs' must be JSON-serialisable (a queue "
            f"stores them): {error}."
        )
    return problems


def _cron_problems(where: str, cron: object) -> list[str]:
    if importlib.util.find_spec("cronsim") is None:
        return [
            f"{where} uses 'cron', which needs cronsim: "
            f"pip install 'django-advisory-lock[schedule]'."
        ]
    from cronsim import CronSim
    from cronsim import CronSimError

    if isinstance(cron, str) and cron.strip().startswith("@"):
        if cron.strip() not in CRON_ALIASES:
            return [
                f"{where}['cron'] = {cron!r} is not one of cron's aliases: "
                f"{', '.join(CRON_ALIASES)} (or five fields, e.g. '0 3 * * *')."
            ]
    elif not isinstance(cron, str) or len(cron.split()) != 5:
        return [
            f"{where}['cron'] must be five fields, e.g. '0 3 * * *', or one of "
            f"{', '.join(CRON_ALIASES)}, not {cron!r}."
        ]
    try:
        CronSim(cron_fields(cron), datetime.datetime.now(UTC))
    except CronSimError as error:
        return [f"{where}['cron'] = {cron!r} is not a valid cron expression: {error}."]
    return []


def cron_fields(cron: str) -> str:
    """The five fields of ``cron``: itself, or what its alias stands for (``@daily``: ``0 0 *
    * *``), since cronsim reads fields only."""
    return CRON_ALIASES.get(cron.strip(), cron)


def _quoted(keys: tuple[str, ...]) -> str:
    return ", ".join(map(repr, keys[:-1])) + f" and {keys[-1]!r}"


def _importable(path: object) -> bool:
    if not isinstance(path, str):
        return False
    try:
        return callable(import_string(path))
    except ImportError:
        return False
