"""A view that refreshes the prices unless another request or worker is already at it."""

from django.http import HttpRequest
from django.http import HttpResponse

from advisory_lock import advisory_lock
from tests.kitapp.conf import database

PRICES_LOCK = "kitapp:prices"


def refresh_prices(request: HttpRequest) -> HttpResponse:
    # scope="session": the lock goes when the block ends, even inside a transaction (the
    # default scope holds it until the commit, and a TestCase's transaction never commits).
    with advisory_lock(PRICES_LOCK, using=database(), wait=False, scope="session") as lock:
        if not lock:
            return HttpResponse("A refresh is already running.", status=409)
        return HttpResponse("Prices refreshed.")
