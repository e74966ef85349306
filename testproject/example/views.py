"""A counter that concurrent requests increment: the read-modify-write a lock protects.

Every view answers a POST with JSON, and takes query parameters for the tests and the
benchmark: ``name`` (which counter; "demo" by default) and ``hold`` (seconds to pause between
the read and the write, under the lock where there is one: a slow holder, on demand).
"""

from __future__ import annotations

import asyncio
import time

from django.db import transaction
from django.http import HttpRequest
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from advisory_lock import advisory_lock
from testproject.example.models import Counter

# The longest ``hold`` a request may ask for, so that a request can't pin a worker for long.
MAX_HOLD = 10.0


def _params(request: HttpRequest) -> tuple[str, float]:
    name = request.GET.get("name", "demo")
    hold = min(max(float(request.GET.get("hold", 0)), 0.0), MAX_HOLD)
    return name, hold


def _increment(name: str, hold: float) -> int:
    counter, _ = Counter.objects.get_or_create(name=name)
    if hold:
        time.sleep(hold)
    counter.value += 1
    counter.save(update_fields=["value"])
    return counter.value


async def _aincrement(name: str, hold: float) -> int:
    counter, _ = await Counter.objects.aget_or_create(name=name)
    if hold:
        await asyncio.sleep(hold)
    counter.value += 1
    await counter.asave(update_fields=["value"])
    return counter.value


@csrf_exempt
@require_POST
def increment_counter(request: HttpRequest) -> JsonResponse:
    """Read-modify-write under a lock: held until the transaction commits, so no lost update."""
    name, hold = _params(request)
    with transaction.atomic(), advisory_lock(f"counter:{name}", timeout=5):
        value = _increment(name, hold)
    return JsonResponse({"name": name, "value": value})


@csrf_exempt
@require_POST
async def aincrement_counter(request: HttpRequest) -> JsonResponse:
    """The async twin of ``increment_counter``.

    Django's async ORM has no ``atomic()``: each statement commits on its own, so the lock
    is a session lock held around the whole read-modify-write, released after the write
    has committed.
    """
    name, hold = _params(request)
    async with advisory_lock(f"counter:{name}", timeout=5):
        value = await _aincrement(name, hold)
    return JsonResponse({"name": name, "value": value})


@csrf_exempt
@require_POST
def try_increment_counter(request: HttpRequest) -> JsonResponse:
    """Increment only if no other request is at it: ``timeout=0`` tries once and raises
    ``LockNotAcquired`` when the lock is busy, which ``LockBusyMiddleware`` answers with
    ``ADVISORY_LOCK["BUSY_RESPONSE"]`` (503 and ``Retry-After: 1`` by default)."""
    name, hold = _params(request)
    with transaction.atomic(), advisory_lock(f"counter:{name}", timeout=0):
        value = _increment(name, hold)
    return JsonResponse({"name": name, "value": value})


# Without the lock: what it prevents. For the tests and the benchmark, never for real use.


@csrf_exempt
@require_POST
def increment_counter_unlocked(request: HttpRequest) -> JsonResponse:
    """``increment_counter`` without the lock: concurrent requests lose updates."""
    name, hold = _params(request)
    with transaction.atomic():
        value = _increment(name, hold)
    return JsonResponse({"name": name, "value": value})


@csrf_exempt
@require_POST
async def aincrement_counter_unlocked(request: HttpRequest) -> JsonResponse:
    """``aincrement_counter`` without the lock: concurrent requests lose updates."""
    name, hold = _params(request)
    value = await _aincrement(name, hold)
    return JsonResponse({"name": name, "value": value})
