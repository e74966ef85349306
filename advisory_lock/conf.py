"""The ``ADVISORY_LOCK`` setting, read lazily (and again when a test overrides it)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

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
    # Ledger writes in the caller's transaction (a savepoint) instead of on a connection of
    # their own: for tests, so that TestCase's rollback takes the rows with it.
    "LEDGER_IN_CALLERS_TRANSACTION": False,
    # {job name: {"period": "daily", "grace": seconds}}: jobs watched for overdue slots.
    "JOBS": {},
    # {entry name: {"command" or "callable", "cron" or "every", ...}}: see manage.py run_jobs.
    "SCHEDULE": {},
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
