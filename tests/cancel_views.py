"""Views for ``tests/test_cancel_under_uvicorn.py``: async views that run async
``@single_instance`` functions, whose clients hang up before the answer (Django cancels the
view's task when its client disconnects), and a view that says what the worker still holds.
"""

from __future__ import annotations

import asyncio
import gc
import threading

from django.http import HttpRequest
from django.http import JsonResponse
from django.urls import path

from advisory_lock import directory
from advisory_lock import single_instance
from advisory_lock.dedicated import DedicatedLock
from testproject.urls import urlpatterns as project_urlpatterns


@single_instance(key=lambda name, hold: f"web-cancel:{name}")
async def lock_only(name: str, hold: float) -> str:
    await asyncio.sleep(hold)
    return "ran"


@single_instance(key=lambda name, hold: f"web-cancel-ledger:{name}", ledger="once")
async def with_ledger(name: str, hold: float) -> str:
    await asyncio.sleep(hold)
    return "ran"


JOBS = {"lock": lock_only, "ledger": with_ledger}


async def run_job(request: HttpRequest, job: str, name: str) -> JsonResponse:
    result = await JOBS[job](name, float(request.GET.get("hold", "0")))
    return JsonResponse({"ran": result == "ran"})


def held(request: HttpRequest) -> JsonResponse:
    """The run threads alive in this worker, and its lock connections still open, once the
    lock directory's writer (which ends by itself a moment after its last note) has ended."""
    if directory.recorder is not None:
        assert directory.recorder.settle(120), "the lock directory's writer did not end"
    threads = [t.name for t in threading.enumerate() if t.name.startswith("advisory_lock")]
    locks = [
        obj.label
        for obj in gc.get_objects()
        if isinstance(obj, DedicatedLock) and obj.connection.connection is not None
    ]
    return JsonResponse({"threads": threads, "lock_connections": locks})


urlpatterns = [
    *project_urlpatterns,
    path("cancel/held/", held),
    path("cancel/<str:job>/<str:name>/", run_job),
]
