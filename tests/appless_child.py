"""One step of a project without ``advisory_lock`` in INSTALLED_APPS, in a process of its own:
``python -m tests.appless_child STEP`` (DJANGO_SETTINGS_MODULE=tests.appless_settings, as a
worker on the test database of the alias ADVISORY_LOCK_TEST_DEFAULT). It prints one JSON
object on its last line of stdout: what the step saw.

Steps (``STEPS``): the lock path (``lock``, ``function``, ``request``) must work as with the
app; each ledger feature (``LEDGER_FEATURES``) must raise ``ImproperlyConfigured`` saying to
add the app, and nothing else.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import django

KEY = "appless:plain"


def lock() -> dict[str, Any]:
    """A plain lock, blocking and tried, excludes another connection and is released."""
    from advisory_lock import advisory_lock
    from tests.probes import is_free

    with advisory_lock(KEY) as held:
        free_inside = is_free(KEY, "default")
    with advisory_lock(KEY, wait=False) as tried:
        tried_inside = bool(tried)
    return {
        "held": bool(held),
        "free_inside": free_inside,
        "tried": tried_inside,
        "free_after": is_free(KEY, "default"),
    }


def function() -> dict[str, Any]:
    """A ``@single_instance`` function (no ledger): its call holds its lock, then frees it."""
    from advisory_lock import single_instance
    from tests.probes import is_free

    @single_instance(key=KEY)
    def job(value: int) -> dict[str, Any]:
        return {"value": value, "free_inside": is_free(KEY, "default")}

    return {**job(42), "free_after": is_free(KEY, "default")}


def request() -> dict[str, Any]:
    """A view that leaves a session lock held: the request's end releases it, as with the
    app (``request_finished``)."""
    from django.test import Client

    from tests.probes import is_free

    response = Client().get(f"/leak/default/{KEY}/")
    return {"status": response.status_code, "free_after": is_free(KEY, "default")}


def _import_run_once() -> None:
    from advisory_lock import run_once

    with run_once("appless-report"):
        pass


def _import_job_run() -> None:
    from advisory_lock import JobRun

    JobRun.objects.count()


def _import_models() -> None:
    from advisory_lock.models import JobRun

    JobRun.objects.count()


def _import_enqueue_unique() -> None:
    from advisory_lock.tasks import enqueue_unique

    enqueue_unique(_import_enqueue_unique, key="appless")


def _ledger_function() -> None:
    from advisory_lock import single_instance

    @single_instance(key=KEY, ledger="daily")
    def job() -> None:
        raise AssertionError("the body of a ledger run without the app ran")

    job()


#: Each way into the ledger, as a project writes it.
LEDGER_FEATURES: dict[str, Callable[[], None]] = {
    "run_once": _import_run_once,
    "advisory_lock.JobRun": _import_job_run,
    "advisory_lock.models": _import_models,
    "enqueue_unique": _import_enqueue_unique,
    "single_instance(ledger=)": _ledger_function,
}


def ledger_feature(name: str) -> dict[str, Any]:
    from tests.probes import is_free

    try:
        LEDGER_FEATURES[name]()
    except Exception as error:  # reported to the test, which says what it must be
        from django.core.exceptions import ImproperlyConfigured

        return {
            "error": type(error).__name__,
            "improperly_configured": isinstance(error, ImproperlyConfigured),
            "message": str(error),
            "free_after": is_free(KEY, "default"),
        }
    return {"error": None}


STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "lock": lock,
    "function": function,
    "request": request,
}


def main(step: str) -> None:
    django.setup()
    seen = STEPS[step]() if step in STEPS else ledger_feature(step)
    modules = sorted(name for name in sys.modules if name.startswith("advisory_lock"))
    print(json.dumps({**seen, "modules": modules}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
