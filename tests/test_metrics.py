"""OpenTelemetry metrics (ADVISORY_LOCK["METRICS"] = "opentelemetry"), read back with the SDK.

The OpenTelemetry API takes one global meter provider per process: an SDK ``MeterProvider``
with an ``InMemoryMetricReader`` is set once for the session, and each test turns the
metrics on with ``override_settings`` (the app reconfigures on ``setting_changed``). The
reader asks for delta temporality, so that each collection holds what was recorded since
the previous one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

from advisory_lock import JobRun
from advisory_lock import LockLost
from advisory_lock import LockNotAcquired
from advisory_lock import advisory_lock
from advisory_lock import metrics
from advisory_lock import run_once
from advisory_lock import single_instance
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.checks import check_settings
from advisory_lock.keys import make_key
from advisory_lock.testing import held_elsewhere
from tests.probes import in_other_connection
from tests.servers import kill_connection_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = {"default": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}


def lock_settings(**options):
    return override_settings(ADVISORY_LOCK={**settings.ADVISORY_LOCK, **options})


class Readings:
    """What the in-memory reader collected: data points by instrument name."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.points: list[tuple[str, str, dict[str, Any], Any]] = []

    def forget(self) -> None:
        """Drop what was recorded so far (a collection resets the delta)."""
        self.reader.get_metrics_data()
        self.points.clear()

    def collect(self) -> None:
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        self.points.append(
                            (metric.name, metric.unit, dict(point.attributes), point)
                        )

    def matching(self, name: str, **attributes: Any) -> list[Any]:
        self.collect()
        return [
            point
            for metric, _, seen, point in self.points
            if metric == name and attributes.items() <= seen.items()
        ]

    def total(self, name: str, **attributes: Any) -> int:
        """A counter's sum, or a histogram's count of recordings."""
        points = self.matching(name, **attributes)
        return sum(getattr(point, "count", None) or getattr(point, "value", 0) for point in points)

    def attribute_sets(self, name: str) -> list[dict[str, Any]]:
        self.collect()
        return [seen for metric, _, seen, _ in self.points if metric == name]

    def unit(self, name: str) -> str:
        self.collect()
        return next(unit for metric, unit, _, _ in self.points if metric == name)


@pytest.fixture(scope="session")
def reader():
    """The SDK's in-memory reader, on the process's global meter provider (set once)."""
    from opentelemetry import metrics as otel
    from opentelemetry.sdk.metrics import Counter
    from opentelemetry.sdk.metrics import Histogram
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import AggregationTemporality
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    delta = AggregationTemporality.DELTA
    in_memory = InMemoryMetricReader(preferred_temporality={Counter: delta, Histogram: delta})
    provider = MeterProvider(metric_readers=[in_memory])
    otel.set_meter_provider(provider)
    if otel.get_meter_provider() is not provider:
        pytest.fail("Another test set the global MeterProvider first: it can be set only once.")
    yield in_memory
    provider.shutdown()


@pytest.fixture
def recorded(reader) -> Iterator[Readings]:
    """Metrics on for the test; what it records."""
    with lock_settings(METRICS="opentelemetry"):
        assert metrics.recorder is not None, "setting METRICS must turn the metrics on"
        readings = Readings(reader)
        readings.forget()
        yield readings
    assert metrics.recorder is None, "the end of the override must turn them off"


@pytest.fixture
def ledger(using):
    rows = JobRun.objects.using(using)
    yield rows
    rows.all().delete()


# Locks: acquisitions by outcome, wait and hold durations, losses.


def test_an_acquired_lock_counts_once_with_its_wait_and_hold_times(using, recorded):
    with advisory_lock("metrics-acquired", using=using):
        time.sleep(0.05)
    backend = BACKEND[using]
    assert recorded.attribute_sets("advisory_lock.acquisitions") == [
        {"backend": backend, "using": using, "outcome": "acquired"}
    ]
    (wait,) = recorded.matching("advisory_lock.wait.duration", backend=backend, using=using)
    (hold,) = recorded.matching("advisory_lock.hold.duration", backend=backend, using=using)
    assert wait.count == 1 and 0 <= wait.sum < 1
    assert hold.count == 1 and 0.05 <= hold.sum < 5
    assert recorded.unit("advisory_lock.wait.duration") == "s"
    assert recorded.unit("advisory_lock.hold.duration") == "s"


def test_a_lock_taken_inside_atomic_records_its_hold_when_the_transaction_ends(using, recorded):
    from django.db import transaction

    with transaction.atomic(using=using):
        with advisory_lock("metrics-atomic", using=using):
            pass
        assert recorded.total("advisory_lock.hold.duration", using=using) == 0  # still held
    assert recorded.total("advisory_lock.acquisitions", outcome="acquired", using=using) == 1
    assert recorded.total("advisory_lock.hold.duration", using=using) == 1


def test_a_busy_try_counts_as_busy(using, recorded):
    with held_elsewhere("metrics-busy", using=using):
        recorded.forget()  # the other connection's acquisition
        with advisory_lock("metrics-busy", using=using, wait=False) as handle:
            assert not handle
    assert recorded.total("advisory_lock.acquisitions", outcome="busy", using=using) == 1
    assert recorded.total("advisory_lock.acquisitions", outcome="acquired", using=using) == 0
    assert recorded.total("advisory_lock.wait.duration", using=using) == 1


def test_a_bounded_wait_that_runs_out_counts_as_timeout(using, recorded):
    with held_elsewhere("metrics-timeout", using=using):
        recorded.forget()  # the other connection's acquisition
        with pytest.raises(LockNotAcquired):
            with advisory_lock("metrics-timeout", using=using, timeout=0.3):
                pass
        (wait,) = recorded.matching("advisory_lock.wait.duration", using=using)
        assert recorded.total("advisory_lock.hold.duration", using=using) == 0  # never held
    assert recorded.total("advisory_lock.acquisitions", outcome="timeout", using=using) == 1
    assert wait.count == 1 and wait.max >= 0.25


# SQLite's file lock does not live on the database connection: server backends only.
@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_lock_lost_with_its_killed_connection_counts_as_lost(using, recorded):
    with pytest.raises(LockLost):
        with advisory_lock("metrics-lost", using=using):
            kill_connection_of(using)
    assert recorded.attribute_sets("advisory_lock.lost") == [
        {"backend": BACKEND[using], "using": using}
    ]
    assert recorded.total("advisory_lock.hold.duration", using=using) == 0


def test_with_metrics_off_nothing_is_recorded(using, reader):
    assert metrics.recorder is None
    readings = Readings(reader)
    readings.forget()
    with advisory_lock("metrics-off", using=using):
        pass
    with run_once("metrics.off", using=using) as run:
        assert run is not None
    JobRun.objects.using(using).filter(job_name="metrics.off").delete()
    assert readings.attribute_sets("advisory_lock.acquisitions") == []
    assert readings.attribute_sets("advisory_lock.job_runs") == []


# Job runs: by status, with their duration; the job's lock carries the job's name.


def test_run_once_counts_succeeded_then_skipped(ledger, using, recorded):
    job = "metrics.nightly"
    for _ in range(2):
        with run_once(job, using=using) as run:
            if run is not None:
                time.sleep(0.02)
    backend = BACKEND[using]
    assert sorted(
        (seen["status"], seen["job"], seen["backend"], seen["using"])
        for seen in recorded.attribute_sets("advisory_lock.job_runs")
    ) == [("skipped", job, backend, using), ("succeeded", job, backend, using)]
    (duration,) = recorded.matching("advisory_lock.job_run.duration", job=job)
    assert duration.count == 1 and 0.02 <= duration.sum < 10
    assert recorded.unit("advisory_lock.job_run.duration") == "s"
    # The job's own lock: taken twice, held once (the second run found the slot done).
    assert recorded.total("advisory_lock.acquisitions", job=job, outcome="acquired") == 2
    assert recorded.total("advisory_lock.hold.duration", job=job) == 1


def test_a_failed_run_counts_as_failed_with_its_duration(ledger, using, recorded):
    with pytest.raises(RuntimeError):
        with run_once("metrics.failing", using=using):
            raise RuntimeError("boom")
    assert recorded.total("advisory_lock.job_runs", status="failed", job="metrics.failing") == 1
    assert recorded.total("advisory_lock.job_runs", status="succeeded") == 0
    assert recorded.total("advisory_lock.job_run.duration", job="metrics.failing") == 1


def test_a_run_whose_owner_died_counts_as_abandoned(ledger, using, recorded):
    # A running row whose lock nobody holds: its process died. The next claim abandons it.
    job = "metrics.orphan"
    with run_once(job, using=using):
        pass
    ledger.filter(job_name=job).update(status=JobRun.Status.RUNNING)
    recorded.forget()
    assert ledger.mark_abandoned(job_name=job) == 1
    assert recorded.attribute_sets("advisory_lock.job_runs") == [
        {"backend": BACKEND[using], "using": using, "job": job, "status": "abandoned"}
    ]


def test_a_single_instance_command_counts_its_runs_under_its_name(ledger, using, recorded):
    @single_instance(ledger="daily", using=using, heartbeat=0.5)
    class Command(BaseCommand):
        def handle(self, *args, **options):
            self.stdout.write("sent")

    Command.__module__ = "tests.test_metrics"  # its name: <module's last part>
    call_command(Command(), stdout=StringIO())
    with pytest.raises(CommandError, match="already done"):
        call_command(Command(), stdout=StringIO(), stderr=StringIO())
    job = "tests.test_metrics"
    assert ledger.get().job_name == job
    assert recorded.total("advisory_lock.job_runs", job=job, status="succeeded") == 1
    assert recorded.total("advisory_lock.job_runs", job=job, status="skipped") == 1
    assert recorded.total("advisory_lock.job_run.duration", job=job) == 1
    assert recorded.total("advisory_lock.acquisitions", job=job, outcome="acquired") == 2


def test_a_busy_single_instance_command_counts_a_busy_acquisition_of_its_job(using, recorded):
    @single_instance(using=using)
    class Command(BaseCommand):
        def handle(self, *args, **options):
            raise AssertionError("must not run")

    Command.__module__ = "tests.test_metrics"
    with held_elsewhere("command:tests.test_metrics", using=using):
        with pytest.raises(CommandError, match="skipped"):
            call_command(Command(), stdout=StringIO(), stderr=StringIO())
    assert (
        recorded.total(
            "advisory_lock.acquisitions", job="tests.test_metrics", outcome="busy", using=using
        )
        == 1
    )


def test_claim_and_finish_count_like_run_once(ledger, using, recorded):
    """Regression: runs recorded with ``claim_slot()``/``finish()`` (task queues, own loops)
    were not counted; only ``@single_instance`` and ``run_once`` counted theirs."""
    job = "metrics.claimed"
    run, _ = ledger.claim_slot(job, "daily")
    assert run is not None
    assert ledger.claim_slot(job, "daily") == (None, None)  # its lock is busy: running
    ledger.finish(run)
    assert ledger.claim_slot(job, "daily")[0] is None  # done for the day
    assert recorded.total("advisory_lock.job_runs", job=job, status="succeeded") == 1
    assert recorded.total("advisory_lock.job_runs", job=job, status="skipped") == 2
    assert recorded.total("advisory_lock.job_run.duration", job=job) == 1


def test_a_ledger_command_whose_lock_is_busy_counts_as_skipped(ledger, using, recorded):
    """Regression: a ledger job skipped because another instance held its lock was not
    counted as skipped (only one skipped for a slot already done was)."""

    @single_instance(ledger="daily", using=using)
    class Command(BaseCommand):
        def handle(self, *args, **options):
            raise AssertionError("must not run")

    Command.__module__ = "tests.test_metrics"
    with held_elsewhere("command:tests.test_metrics", using=using):
        with pytest.raises(CommandError, match="skipped"):
            call_command(Command(), stdout=StringIO(), stderr=StringIO())
    job = "tests.test_metrics"
    assert recorded.total("advisory_lock.job_runs", job=job, status="skipped") == 1


@pytest.mark.parametrize("using", ["postgresql", "mysql"], indirect=True)
def test_a_job_whose_lock_connection_is_killed_counts_as_lost(ledger, using, recorded):
    job = "metrics.killed"
    with pytest.raises(LockLost):
        with run_once(job, using=using, heartbeat=0.2) as run:
            connection = connections[using]
            db_key = backend_for(connection).db_key(make_key(f"job:{job}"))
            holder = in_other_connection(lambda: inspector_for(connections[using]).holder(db_key))
            kill_connection_of(using, holder.id)
            deadline = time.monotonic() + 10
            while not run.lock.lost and time.monotonic() < deadline:
                time.sleep(0.05)
    assert recorded.attribute_sets("advisory_lock.lost") == [
        {"backend": BACKEND[using], "using": using, "job": job}
    ]


# Configuration: on and off with the setting; a bad value is a system check error.


def test_the_recorder_follows_the_setting(reader):
    assert metrics.recorder is None
    with lock_settings(METRICS="opentelemetry"):
        assert isinstance(metrics.recorder, metrics.Recorder)
        with lock_settings(METRICS=None):
            assert metrics.recorder is None
        assert metrics.recorder is not None
    assert metrics.recorder is None


def test_an_unknown_metrics_value_is_a_check_error_naming_metrics_and_turns_metrics_off():
    with lock_settings(METRICS="prometheus"):
        (error,) = [m for m in check_settings() if m.id == "advisory_lock.E009"]
        assert metrics.recorder is None
    assert "ADVISORY_LOCK['METRICS']" in error.msg and "'prometheus'" in error.msg
    assert "'opentelemetry'" in error.hint


def test_metrics_on_without_opentelemetry_installed_is_a_check_error_saying_what_to_install():
    # A fresh process in which the opentelemetry package can't be found (None in
    # sys.modules: find_spec() says "not installed", import raises ImportError), configured
    # with METRICS on: start-up must not crash, and `manage.py check` must say what to do.
    script = """
import sys
sys.modules["opentelemetry"] = None
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    ADVISORY_LOCK={"METRICS": "opentelemetry"},
)
django.setup()
from advisory_lock import metrics
print("recorder:", metrics.recorder)
from django.core.management import call_command
call_command("check")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "recorder: None" in result.stdout
    assert "advisory_lock.E009" in result.stderr
    assert "ADVISORY_LOCK['METRICS'] is 'opentelemetry'" in result.stderr
    assert "pip install 'django-advisory-lock[opentelemetry]'" in result.stderr
