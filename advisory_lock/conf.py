"""The ``ADVISORY_LOCK`` setting, read lazily so that tests can override it."""

from __future__ import annotations

from typing import Any

from django.conf import settings

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
    # Lock names to show in inspection and check for collisions (besides those in use).
    "NAMES": [],
}


def get_setting(name: str) -> Any:
    """Return ``settings.ADVISORY_LOCK[name]``, or its documented default."""
    return getattr(settings, "ADVISORY_LOCK", {}).get(name, DEFAULTS[name])
