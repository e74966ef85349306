"""Views that misuse locks, for the request-end tests (``override_settings(ROOT_URLCONF=...)``).

Each view takes the database alias and the lock key from its URL, so one URLconf serves
every backend and every test its own key.
"""

from __future__ import annotations

from django.db import connections
from django.db import transaction
from django.http import HttpResponse
from django.urls import path

from advisory_lock import advisory_lock


class HookFailed(Exception):
    """Raised by an ``on_commit`` hook of the view below."""


def leaves_a_lock_held(request, using, key):
    """Enter a lock and never exit it, as a view that returns from inside the block would."""
    advisory_lock(key, using=using).__enter__()
    return HttpResponse("leaked")


def queries_then_leaves_a_lock_held(request, using, key):
    """The same, after a query: Django's connection for ``using`` is open during the request."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT 1")
    advisory_lock(key, using=using).__enter__()
    return HttpResponse("leaked")


def raise_hook_failed():
    raise HookFailed("an on_commit hook registered before the lock failed")


def locks_in_a_transaction_whose_earlier_hook_raises(request, using, key):
    """Take a transaction-scoped lock in a transaction whose commit runs a failing hook first
    (not robust: Django runs none of the later hooks, and the error leaves the view)."""
    with transaction.atomic(using=using):
        transaction.on_commit(raise_hook_failed, using=using)
        with advisory_lock(key, using=using):
            pass
    return HttpResponse("unreachable: the commit raises")


urlpatterns = [
    path("leak/<str:using>/<str:key>/", leaves_a_lock_held),
    path("leak-after-a-query/<str:using>/<str:key>/", queries_then_leaves_a_lock_held),
    path(
        "on-commit-raises/<str:using>/<str:key>/",
        locks_in_a_transaction_whose_earlier_hook_raises,
    ),
]
