"""The admin's pages on a database where the app's tables are missing: a page that says to
run ``migrate`` (status 503), not a 500. Every view of the app's admin pages is wrapped in
``says_to_migrate``: the ledger's, the control room's and the stored entries' alike."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from collections.abc import Iterator
from typing import Concatenate
from typing import ParamSpec
from typing import TypeVar

from django.apps import apps
from django.contrib import admin
from django.db import connections
from django.db import router
from django.db import transaction
from django.http import HttpRequest
from django.http import HttpResponse
from django.template.response import SimpleTemplateResponse
from django.template.response import TemplateResponse

from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.own_connection import table_checked

logger = logging.getLogger("advisory_lock")


def app_aliases() -> list[str]:
    """The databases of the app's tables: where the router reads and writes its models (one
    alias, unless a router splits them)."""
    models = list(apps.get_app_config("advisory_lock").get_models())
    return sorted(
        {router.db_for_read(model) for model in models}
        | {router.db_for_write(model) for model in models}
    )


@contextlib.contextmanager
def ledger_checked(aliases: list[str]) -> Iterator[None]:
    """Raise ``LedgerNotMigrated`` (which says to run ``migrate``) instead of the database's
    error when a statement of the block fails because a table of the app is missing on one of
    ``aliases`` (``ledger.table_checked``: the tables are looked for after a failure only).

    On an alias already in a transaction (``ATOMIC_REQUESTS``, a caller's ``atomic``), the
    block runs in a savepoint, rolled back when the block fails and before the tables are
    looked for: PostgreSQL refuses every statement of a transaction after a failed one ("current
    transaction is aborted") until the transaction or a savepoint is rolled back, the look for
    the tables and the rest of the request's statements included.
    """
    with contextlib.ExitStack() as stack:
        for alias in aliases:
            stack.enter_context(table_checked(alias))
        for alias in aliases:
            if connections[alias].in_atomic_block:
                stack.enter_context(transaction.atomic(using=alias))
        yield


P = ParamSpec("P")
A = TypeVar("A", bound=admin.ModelAdmin)  # type: ignore[type-arg]


def says_to_migrate(
    view: Callable[Concatenate[A, HttpRequest, P], HttpResponse],
) -> Callable[Concatenate[A, HttpRequest, P], HttpResponse]:
    """The admin view ``view``, answering a page that says to run ``migrate`` (status 503)
    when it fails on a missing table of the app, instead of a 500.

    Django renders a ``TemplateResponse`` after the view has returned, and the admin's pages
    read rows while rendering (the changelist's results and date hierarchy): the response is
    rendered here, inside the check. ``render()`` is what Django's handler calls next; it does
    nothing to a response already rendered.
    """

    @functools.wraps(view)
    def checked(
        admin_: A, request: HttpRequest, /, *args: P.args, **kwargs: P.kwargs
    ) -> HttpResponse:
        try:
            with ledger_checked(app_aliases()):
                response = view(admin_, request, *args, **kwargs)
                if isinstance(response, SimpleTemplateResponse):
                    response.render()
                return response
        except LedgerNotMigrated as error:
            logger.warning("The admin page %s can't be shown: %s", request.path, error)
            context = {
                **admin_.admin_site.each_context(request),
                "title": "Run migrate",
                "error": str(error),
                "opts": admin_.model._meta,
            }
            return TemplateResponse(
                request, "admin/advisory_lock/not_migrated.html", context, status=503
            )

    return checked
