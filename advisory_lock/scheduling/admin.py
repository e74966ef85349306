"""The admin of the stored schedule entries (``StoredEntry``): add, change, pause, resume and
delete entries at run time, each with its own permission and in the admin's history
(``LogEntry``); the entries of ``ADVISORY_LOCK["SCHEDULE"]`` shown read-only beside them.

Registered by ``advisory_lock.admin``. A form's errors are the entry's problems, in the words
of the ``SCHEDULE`` entries' (``StoredEntry.clean``); a save or a delete reaches the live
schedulers within a second on PostgreSQL, and within their poll interval elsewhere
(``scheduling.stored``).
"""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib import messages
from django.db import router
from django.db.models import QuerySet
from django.http import HttpRequest
from django.http import HttpResponse

from advisory_lock.admin_writes import writes_first
from advisory_lock.conf import get_setting
from advisory_lock.migrate_pages import says_to_migrate
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import is_paused
from advisory_lock.scheduling.control import set_paused
from advisory_lock.scheduling.stored import StoredEntry


# ModelAdmin is generic in django-stubs only: Django's class can't be subscripted at run time.
class StoredEntryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "what", "when", "state", "updated_at")
    search_fields = ("name", "command", "callable", "task")
    readonly_fields = ("created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("name",)}),
        ("What it runs: exactly one of", {"fields": ("command", "callable", "task")}),
        ("Its arguments", {"fields": ("args", "kwargs")}),
        ("When: exactly one of", {"fields": ("cron", "every")}),
        (
            "Options",
            {"fields": ("catch_up", "retries", "timeout", "grace", "atomic", "alert_after")},
        ),
        ("Changes", {"fields": ("created_at", "updated_at")}),
    )
    actions = ("pause", "resume")
    change_list_template = "admin/advisory_lock/storedentry/change_list.html"

    @admin.display(description="runs")
    def what(self, entry: StoredEntry) -> str:
        return entry.command or entry.callable or entry.task

    @admin.display(description="schedule")
    def when(self, entry: StoredEntry) -> str:
        return entry.cron or (f"every {entry.every:g}s" if entry.every is not None else "")

    @admin.display(description="state")
    def state(self, entry: StoredEntry) -> str:
        using = router.db_for_read(JobControl)
        return "paused" if is_paused(using, entry.name) else "active"

    def has_pause_permission(self, request: HttpRequest) -> bool:
        """Pausing a stored entry needs what pausing any entry needs (``JobControl``'s)."""
        return request.user.has_perm("advisory_lock.pause_job")

    @admin.action(description="Pause the selected entries", permissions=["pause"])
    def pause(self, request: HttpRequest, queryset: QuerySet[StoredEntry]) -> None:
        self._switch(request, queryset, paused=True)

    @admin.action(description="Resume the selected entries", permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[StoredEntry]) -> None:
        self._switch(request, queryset, paused=False)

    def _switch(
        self, request: HttpRequest, queryset: QuerySet[StoredEntry], *, paused: bool
    ) -> None:
        """Pause or resume each entry as the Schedule page's buttons do (a ``JobControl``
        row, heard by the schedulers), logged on the entry."""
        using = router.db_for_write(JobControl)
        who = f"admin user {request.user.get_username()!r}"
        state = "Paused" if paused else "Resumed"
        for entry in queryset:
            if set_paused(using, entry.name, paused, who) is None:
                messages.info(
                    request, f"{entry.name!r} was already {state.lower()}: nothing changed."
                )
                continue
            done = f"{state} the scheduled entry {entry.name!r}."
            self.log_change(request, entry, done)
            messages.success(request, done)

    # Each page says to run migrate where the table is missing, as the app's other pages do;
    # a save or a delete writes first (where a transaction that read first can't wait).

    @says_to_migrate
    @writes_first
    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        return super().changeform_view(request, object_id, form_url, extra_context)

    @says_to_migrate
    @writes_first
    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().delete_view(request, object_id, extra_context)

    @says_to_migrate
    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().history_view(request, object_id, extra_context)

    @says_to_migrate
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The stored entries, and the settings' beside them, read-only."""
        setting = get_setting("SCHEDULE")
        configured = [
            {"name": name, "options": json.dumps(options, default=str)}
            for name, options in (setting.items() if isinstance(setting, dict) else ())
        ]
        return super().changelist_view(
            request, {**(extra_context or {}), "configured": configured}
        )
