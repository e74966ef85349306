"""The app's admin pages that write (a save, a delete) on a database that allows one writer
at a time: their transaction writes first, so that it waits for another writer (a scheduler's
claim) instead of failing with "database is locked" (SQLite; see
``LockInspector.writer_from_the_start``). Django's admin reads before it writes in the same
transaction (the object, the form's unique checks, the objects a delete takes along)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate
from typing import ParamSpec
from typing import TypeVar

from django.contrib import admin
from django.db import connections
from django.db import router
from django.http import HttpRequest
from django.http import HttpResponse

from advisory_lock.backends import inspector_for
from advisory_lock.backends import is_supported

P = ParamSpec("P")
A = TypeVar("A", bound=admin.ModelAdmin)  # type: ignore[type-arg]


def writes_first(
    view: Callable[Concatenate[A, HttpRequest, P], HttpResponse],
) -> Callable[Concatenate[A, HttpRequest, P], HttpResponse]:
    """The admin view ``view``, whose POST runs in a transaction on its model's database
    that writes before anything else, where the database needs it (the view's own
    ``transaction.atomic`` then nests in it). A GET only reads: it runs as it is."""

    @functools.wraps(view)
    def first_writer(
        admin_: A, request: HttpRequest, /, *args: P.args, **kwargs: P.kwargs
    ) -> HttpResponse:
        model = admin_.model
        connection = connections[router.db_for_write(model)]
        if request.method != "POST" or not is_supported(connection):
            return view(admin_, request, *args, **kwargs)
        with inspector_for(connection).writer_from_the_start(model._meta.db_table):
            return view(admin_, request, *args, **kwargs)

    return first_writer
