"""An app that writes down, in the process it runs in, every alert the scheduler sends: one
JSON line per signal received, and one per record of the ``advisory_lock.alerts`` logger,
with its level and ``extra`` values, appended to ``$ADVISORY_LOCK_TEST_ALERTS`` (one
``write()`` each, O_APPEND: lines of several processes never mix). Installed in the
``run_jobs`` processes of tests/test_alerts.py (tests/schedule_settings.py)."""

from __future__ import annotations

import json
import logging
import os

from django.apps import AppConfig

EXTRA = ("event", "database", "job_name", "slot", "run_id", "attempt", "error", "slots")


def _append(line: dict) -> None:
    fd = os.open(os.environ["ADVISORY_LOCK_TEST_ALERTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(line, default=str) + "\n").encode())
    finally:
        os.close(fd)


class _Written(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        fields = {name: getattr(record, name) for name in EXTRA if hasattr(record, name)}
        _append(
            {"kind": "log", "level": record.levelname, "message": record.getMessage(), **fields}
        )


def _received(signal_name: str):
    def receiver(sender, *, using, entry, slot, run, error, signal, **more):
        _append(
            {
                "kind": "signal",
                "signal": signal_name,
                "sender": sender.__name__,
                "database": using,
                "job_name": entry.name if entry is not None else None,
                "slot": slot,
                "run_id": run.pk if run is not None else None,
                "attempt": run.attempt if run is not None else None,
                "error": error,
                "pid": os.getpid(),
                **more,
            }
        )

    return receiver


class AlertAppConfig(AppConfig):
    name = "tests.alertapp"
    label = "alertapp"

    def ready(self) -> None:
        from advisory_lock import signals

        for name in ("slot_failed", "slot_missed", "entry_unhealthy", "no_scheduler_alive"):
            receiver = _received(name)
            getattr(signals, name).connect(receiver, weak=False)
        logging.getLogger("advisory_lock.alerts").addHandler(_Written())
