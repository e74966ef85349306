"""The ``ADVISORY_LOCK`` setting, read lazily (and again when a test overrides it), and
whether the app is in ``INSTALLED_APPS``, which the ledger needs."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
from django.core.signals import setting_changed

from advisory_lock.exceptions import LedgerNotMigrated

DEFAULTS: dict[str, Any] = {
    # Prefix of every string key, so that two apps sharing a database don't collide.
    "NAMESPACE": "django",
    # Folder for SQLite's lock files; None means "<database file>.locks" beside it.
    "LOCK_DIR": None,
    # Time zone of the ledger's periods (daily, hourly...); None means settings.TIME_ZONE.
    "LEDGER_TIME_ZONE": None,
    # {alias: "transaction" | "session"}: declare a pooler in front of an alias.
    "POOL_MODE": {},
    # {alias: direct alias}: where commands and the ledger take session locks instead.
    "DIRECT_ALIAS": {},
    # Lock names to show in inspection and check for collisions: a list, or {name: key}.
    "NAMES": [],
    # Holders write each lock's name and their host and pid into the lock directory's tables
    # (lock_names, lock_clients), for the Locks page and manage.py advisory_locks.
    "RECORD_HOLDERS": True,
    # Ledger writes in the caller's transaction (a savepoint) instead of on a connection of
    # their own: for tests, so that TestCase's rollback takes the rows with it.
    "LEDGER_IN_CALLERS_TRANSACTION": False,
    # {job name: {"period": "daily", "grace": seconds}}: jobs watched for overdue slots.
    "JOBS": {},
    # {entry name: {"command" or "callable", "cron" or "every", ...}}: see manage.py run_jobs.
    "SCHEDULE": {},
    # Seconds between two heartbeats of a run_jobs scheduler; alive while seen within 3.
    "SCHEDULER_HEARTBEAT": 5.0,
    # None, or "opentelemetry": record metrics through the OpenTelemetry API.
    "METRICS": None,
    # LockBusyMiddleware's answer to a view that raised LockNotAcquired.
    "BUSY_RESPONSE": {"status": 503, "retry_after": 1},
}
_cache: dict[str, Any] = {}


def get_setting(name: str) -> Any:
    """Return ``settings.ADVISORY_LOCK[name]``, or its documented default.

    Cached: a lock is taken on a hot path, and a missing ADVISORY_LOCK setting would
    otherwise raise (and catch) an AttributeError on every read.
    """
    try:
        return _cache[name]
    except KeyError:
        value = _cache[name] = getattr(settings, "ADVISORY_LOCK", {}).get(name, DEFAULTS[name])
        return value


def _clear_cache(*, setting: str, **kwargs: Any) -> None:
    if setting == "ADVISORY_LOCK":
        _cache.clear()


setting_changed.connect(_clear_cache, dispatch_uid="advisory_lock.conf")

#: What the ledger's features say when the app is not in INSTALLED_APPS.
APP_NOT_INSTALLED = (
    'The ledger needs the app: add "advisory_lock" to INSTALLED_APPS, then run manage.py '
    "migrate. Its tables keep the runs of ledger=..., run_once, run_jobs and job_runs, and the "
    "marks of enqueue_unique; locks, and @single_instance without a ledger, work without it."
)


def require_app() -> None:
    """Raise ``LedgerNotMigrated`` (an ``ImproperlyConfigured``) saying to install the app
    and migrate, unless ``advisory_lock`` is in ``INSTALLED_APPS``.

    Called by each module that defines one of the app's models, before it does: Django can
    only define a model of an installed app, and would otherwise raise its generic
    ``RuntimeError`` ("doesn't declare an explicit app_label"). So every way into the ledger
    (``ledger=``, ``run_once``, ``JobRun``, ``enqueue_unique``) says what to do, and the lock
    path, which imports none of those modules, works without the app.
    """
    if not apps.is_installed("advisory_lock"):
        raise LedgerNotMigrated(APP_NOT_INSTALLED)
