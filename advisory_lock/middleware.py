"""``LockBusyMiddleware``: a view that finds its lock busy answers "busy, retry later".

A view that raises ``LockNotAcquired`` (``@advisory_lock(key, timeout=0)`` as a decorator,
``with advisory_lock(key, timeout=...)`` that gave up) gets a response with the status of
``ADVISORY_LOCK["BUSY_RESPONSE"]["status"]`` (503 by default; 409 suits a resource that
another request is changing) and a ``Retry-After`` header of its ``retry_after`` seconds.
"""

from __future__ import annotations

from django.http import HttpRequest
from django.http import HttpResponse
from django.utils.deprecation import MiddlewareMixin

from advisory_lock.conf import get_setting
from advisory_lock.exceptions import LockNotAcquired


class LockBusyMiddleware(MiddlewareMixin):
    """Turn ``LockNotAcquired`` raised by a view into a "busy, retry later" response."""

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, LockNotAcquired):
            return None
        busy = get_setting("BUSY_RESPONSE")
        return HttpResponse(
            "Busy: another request holds the lock this one needs. Retry later.\n",
            status=busy["status"],
            content_type="text/plain",
            headers={"Retry-After": str(busy["retry_after"])},
        )
