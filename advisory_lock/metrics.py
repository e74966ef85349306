"""Optional OpenTelemetry metrics: ``ADVISORY_LOCK["METRICS"] = "opentelemetry"``.

The instruments come from the OpenTelemetry API's global meter provider, so whatever exporter
the project configures (Prometheus, OTLP) exports them. With metrics off, ``recorder`` is
None and the lock's path pays one attribute lookup per operation.

Instruments (attributes ``backend``, ``using``, and ``job`` where there is one):

- ``advisory_lock.acquisitions``: counter, attribute ``outcome``: acquired, busy, timeout;
- ``advisory_lock.wait.duration``, ``advisory_lock.hold.duration``: histograms, seconds;
- ``advisory_lock.lost``: counter;
- ``advisory_lock.job_runs``: counter, attribute ``status``: succeeded, failed, abandoned,
  skipped;
- ``advisory_lock.job_run.duration``: histogram, seconds.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from advisory_lock.conf import get_setting

METRICS = (None, "opentelemetry")


class Recorder:
    """Records what the locks and the ledger do on the OpenTelemetry instruments."""

    def __init__(self) -> None:
        from opentelemetry import metrics

        meter = metrics.get_meter("advisory_lock")
        self._acquisitions = meter.create_counter(
            "advisory_lock.acquisitions",
            description="Attempts to take an advisory lock, by outcome.",
        )
        self._wait = meter.create_histogram(
            "advisory_lock.wait.duration", unit="s", description="Time spent taking a lock."
        )
        self._hold = meter.create_histogram(
            "advisory_lock.hold.duration", unit="s", description="Time a lock was held."
        )
        self._lost = meter.create_counter(
            "advisory_lock.lost", description="Held locks found lost."
        )
        self._job_runs = meter.create_counter(
            "advisory_lock.job_runs", description="Job runs, by how they ended."
        )
        self._job_duration = meter.create_histogram(
            "advisory_lock.job_run.duration", unit="s", description="Duration of job runs."
        )

    def acquisition(
        self, outcome: str, backend: str, using: str, wait_time: float, job: str | None = None
    ) -> None:
        attributes = _attributes(backend, using, job)
        self._acquisitions.add(1, {**attributes, "outcome": outcome})
        self._wait.record(wait_time, attributes)

    def held(self, seconds: float, backend: str, using: str, job: str | None = None) -> None:
        self._hold.record(seconds, _attributes(backend, using, job))

    def lost(self, backend: str, using: str, job: str | None = None) -> None:
        self._lost.add(1, _attributes(backend, using, job))

    def job_run(
        self, status: str, job: str, backend: str, using: str, duration: float | None = None
    ) -> None:
        attributes = _attributes(backend, using, job)
        self._job_runs.add(1, {**attributes, "status": status})
        if duration is not None:
            self._job_duration.record(duration, attributes)


def _attributes(backend: str, using: str, job: str | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {"backend": backend, "using": using}
    if job is not None:
        attributes["job"] = job
    return attributes


#: The recorder when metrics are on, else None.
recorder: Recorder | None = None


def configure(**kwargs: Any) -> None:
    """(Re)read ``ADVISORY_LOCK["METRICS"]``: at start-up and when a test overrides it. A
    value the system checks refuse turns metrics off (the check says why)."""
    global recorder
    recorder = Recorder() if metrics_problem() is None and get_setting("METRICS") else None


def metrics_problem() -> str | None:
    """Why ``METRICS`` can't work, or None (for the system checks)."""
    value = get_setting("METRICS")
    if value not in METRICS:
        return f"ADVISORY_LOCK['METRICS'] must be None or 'opentelemetry', not {value!r}."
    if value == "opentelemetry" and importlib.util.find_spec("opentelemetry") is None:
        return (
            "ADVISORY_LOCK['METRICS'] is 'opentelemetry', but the OpenTelemetry API is not "
            "installed: pip install 'django-advisory-lock[opentelemetry]'."
        )
    return None
