"""The app's jobs: a nightly report (run once a day, fleet-wide) and an index rebuild that
must never run twice at the same time."""

from __future__ import annotations

from collections.abc import Callable

from advisory_lock import advisory_lock
from advisory_lock import run_once
from tests.kitapp.conf import database
from tests.kitapp.models import Report

INDEX_LOCK = "kitapp:search-index"


def nightly_report() -> Report | None:
    """Write today's report, once a day whoever calls it; None when it is already done."""
    using = database()
    with run_once("kitapp.nightly_report", period="daily", using=using) as run:
        if run is None:
            return None
        return Report.objects.using(using).create(day=run.period)


def rebuild_search_index(progress: Callable[[str], None] = lambda step: None) -> None:
    """Rebuild the index under its lock: at most one rebuild at a time, and the lock goes
    when the function returns (``scope="session"``: even inside a transaction)."""
    with advisory_lock(INDEX_LOCK, using=database(), scope="session"):
        for step in ("drop", "fill", "swap"):
            progress(step)
