"""System checks: configuration mistakes that would make locks silently unsafe."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage
from django.core.checks import Error
from django.core.checks import Info
from django.core.checks import Tags
from django.core.checks import Warning
from django.core.checks import register
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS
from django.db import connections

from advisory_lock.backends import backend_class
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.backends import is_supported
from advisory_lock.conf import get_setting
from advisory_lock.expectations import job_problems
from advisory_lock.keys import make_key
from advisory_lock.metrics import metrics_problem
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.periods import ledger_time_zone
from advisory_lock.schedule import SCHEDULE_HINT
from advisory_lock.schedule import schedule_problems
from advisory_lock.scheduling.liveness import heartbeat_interval
from advisory_lock.scheduling.notifications import listening_problem
from advisory_lock.validation import MAX_SECONDS

POOL_MODES = ("transaction", "session")
JOBS_HINT = (
    'An entry is {"period": "daily", "grace": 7200}: a named period, and seconds (at most a '
    f"century, {MAX_SECONDS}), under a job name of at most {MAX_JOB_NAME_LENGTH} characters."
)


def lock_aliases() -> list[str]:
    """The aliases locks are taken on: default, and those named in ADVISORY_LOCK."""
    aliases = [DEFAULT_DB_ALIAS, *get_setting("POOL_MODE"), *get_setting("DIRECT_ALIAS").values()]
    return [alias for alias in dict.fromkeys(aliases) if alias in settings.DATABASES]


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """ADVISORY_LOCK's values, and the engines of the aliases locks use."""
    messages: list[CheckMessage] = []
    try:
        make_key("check")
    except ImproperlyConfigured as error:
        messages.append(Error(str(error), id="advisory_lock.E006"))
    try:
        ledger_time_zone()
    except ImproperlyConfigured as error:
        messages.append(Error(str(error), id="advisory_lock.E007"))
    for alias, mode in get_setting("POOL_MODE").items():
        if alias not in settings.DATABASES or mode not in POOL_MODES:
            messages.append(
                Error(
                    f"ADVISORY_LOCK['POOL_MODE'][{alias!r}] = {mode!r} is not valid.",
                    hint=f"Keys are database aliases; values are one of {POOL_MODES}.",
                    id="advisory_lock.E004",
                )
            )
    for alias, direct in get_setting("DIRECT_ALIAS").items():
        if alias not in settings.DATABASES or direct not in settings.DATABASES:
            messages.append(
                Error(
                    f"ADVISORY_LOCK['DIRECT_ALIAS'] maps {alias!r} to {direct!r}, and both must "
                    f"be aliases in DATABASES.",
                    hint="Add the direct alias (same database, no pooler) to DATABASES.",
                    id="advisory_lock.E005",
                )
            )
    for alias in lock_aliases():
        messages += _check_alias(alias)
    if problem := metrics_problem():
        messages.append(
            Error(
                problem,
                hint="ADVISORY_LOCK['METRICS'] is None (off) or 'opentelemetry'.",
                id="advisory_lock.E009",
            )
        )
    jobs = get_setting("JOBS")
    if not isinstance(jobs, dict):
        messages.append(
            Error(
                f"ADVISORY_LOCK['JOBS'] must be a dict of job names to entries, not {jobs!r}.",
                id="advisory_lock.E010",
            )
        )
    else:
        for job_name, entry in jobs.items():
            messages += [
                Error(problem, hint=JOBS_HINT, id="advisory_lock.E010")
                for problem in job_problems(job_name, entry)
            ]
    messages += _check_schedule()
    messages += _check_command_graces()
    messages += _check_heartbeat()
    return messages


def _check_heartbeat() -> list[CheckMessage]:
    """A warning, not an error, as W011: every other command still runs; run_jobs refuses
    to start on it, and --check to judge by it."""
    try:
        heartbeat_interval()
    except ValueError as error:
        return [
            Warning(
                str(error),
                hint=(
                    "Seconds between two heartbeats of a run_jobs scheduler (5 by default); "
                    "a scheduler is alive while seen within 3 of them. The same on every "
                    "instance."
                ),
                id="advisory_lock.W013",
            )
        ]
    return []


def _check_command_graces() -> list[CheckMessage]:
    """The ``lock_grace`` of single-instance commands (a grace the overdue report can use),
    and their ``lock_ledger_atomic`` (a bool, and only with a ``lock_ledger``)."""
    from advisory_lock.single_instance.commands import command_label
    from advisory_lock.single_instance.commands import grace_problem
    from advisory_lock.single_instance.commands import single_instance_commands

    messages: list[CheckMessage] = []
    for command_class in single_instance_commands():
        grace = command_class.lock_grace
        if grace is not None and (problem := grace_problem(grace)):
            messages.append(
                Error(
                    f"The single-instance command {command_label(command_class)}: {problem}",
                    hint="Set lock_grace (or @single_instance(grace=...)) to the seconds after "
                    "a slot's end when a slot without a successful run is overdue.",
                    id="advisory_lock.E010",
                )
            )
        atomic = command_class.lock_ledger_atomic
        if atomic is not False and (atomic is not True or command_class.lock_ledger is None):
            messages.append(
                Error(
                    f"The single-instance command {command_label(command_class)} has "
                    f"lock_ledger_atomic = {atomic!r}"
                    + ("" if atomic is True else ", not True or False")
                    + (" without a lock_ledger" if atomic is True else "")
                    + ": an atomic run commits its success in the ledger with its writes.",
                    hint="Set lock_ledger (a period, e.g. 'daily') with lock_ledger_atomic = "
                    "True, or drop lock_ledger_atomic.",
                    id="advisory_lock.E012",
                )
            )
    return messages


def _check_schedule() -> list[CheckMessage]:
    """A bad ``SCHEDULE`` is a warning, not an error: Django runs the checks before every
    command, and an error would stop ``migrate`` and every other command for one cron typo.
    ``run_jobs``, the only command that schedules, refuses to start on it (``entries()``)."""
    return [
        Warning(problem, hint=SCHEDULE_HINT, id="advisory_lock.W011")
        for problem in schedule_problems()
    ]


def _check_alias(alias: str) -> list[CheckMessage]:
    connection = connections[alias]
    engine = connection.settings_dict["ENGINE"]
    if not is_supported(connection):
        return [
            Error(
                f"Database alias {alias!r} uses {engine!r}, which has no advisory lock support.",
                hint="Use PostgreSQL, MySQL/MariaDB or SQLite for this alias, or take locks "
                "with using= on one that is.",
                id="advisory_lock.E002",
            )
        ]
    messages: list[CheckMessage] = []
    backend = backend_class(connection)
    if backend.notifications and get_setting("SCHEDULE") and (problem := listening_problem(alias)):
        messages.append(
            Warning(
                f"The schedule's job processes on database alias {alias!r} can't run: "
                f"{problem}. A job process takes its entry's lock on a session of its own "
                f"(the DIRECT_ALIAS), as @single_instance commands do, and run_jobs listens "
                f"for operators' requests on one; neither can work through that pooler.",
                hint=f"Set ADVISORY_LOCK['DIRECT_ALIAS'][{alias!r}] to an alias that reaches "
                "the database without the pooler (or through a session-mode pooler).",
                id="advisory_lock.W002",
            )
        )
    if problem := backend.pool_problem(connection.settings_dict):
        messages.append(
            Warning(
                f"Database alias {alias!r}: {problem}",
                hint='Set OPTIONS["pool"]["reset"] = '
                "advisory_lock.reset_pooled_connection, which runs "
                "pg_advisory_unlock_all() when a connection goes back to the pool.",
                id="advisory_lock.W001",
            )
        )
    return messages


@register(deploy=True)
def check_single_host(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A deployment note (``check --deploy``): SQLite's locks don't reach other hosts."""
    return [
        Info(
            f"Database alias {alias!r} is SQLite: its advisory locks are files on this host, "
            f"so they only coordinate processes on this one machine.",
            id="advisory_lock.I001",
        )
        for alias in lock_aliases()
        if is_supported(connections[alias]) and backend_class(connections[alias]).single_host
    ]


@register()
def check_key_collisions(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Two registered lock names must not map to one database key."""
    from advisory_lock.inspection import registered_keys

    try:
        keys = registered_keys()
    except (TypeError, ValueError) as error:
        message = f"ADVISORY_LOCK['NAMES'] is not valid: {error}"
        hint = "A list of names, or a dict of names to keys."
        return [Error(message, hint=hint, id="advisory_lock.E008")]
    messages: list[CheckMessage] = []
    for alias in lock_aliases():
        if not is_supported(connections[alias]):
            continue
        backend = backend_for(connections[alias])
        by_key: dict[Any, list[str]] = defaultdict(list)
        for name, key in keys.items():
            try:
                by_key[backend.db_key(make_key(key))].append(name)
            except (TypeError, ValueError, ImproperlyConfigured) as error:
                messages.append(
                    Error(
                        f"Lock name {name!r} is not a valid key: {error}", id="advisory_lock.E008"
                    )
                )
        for db_key, colliding in by_key.items():
            if len(colliding) > 1:
                messages.append(
                    Error(
                        f"Lock names {', '.join(map(repr, colliding))} map to the same key "
                        f"{db_key!r} on database {alias!r}: they would exclude each other.",
                        hint="Rename one of them (or set a distinct NAMESPACE per app).",
                        id="advisory_lock.E001",
                    )
                )
    return messages


@register(Tags.database)
def check_clusters(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Galera (MariaDB Galera, Percona XtraDB Cluster) and MySQL Group Replication in
    multi-primary mode do not share GET_LOCK across nodes."""
    messages: list[CheckMessage] = []
    for alias in databases or []:
        if alias not in lock_aliases() or not is_supported(connections[alias]):
            continue
        if problem := inspector_for(connections[alias]).cluster_problem():
            messages.append(
                Error(
                    problem,
                    hint="Take locks on a single-node database (a DIRECT_ALIAS to one node "
                    "used by every instance), or use PostgreSQL.",
                    id="advisory_lock.E003",
                )
            )
    return messages
