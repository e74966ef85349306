"""Read-only admin for the job_runs ledger."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest
from django.utils.html import format_html

from advisory_lock.models import JobRun

STATUS_COLOURS = {
    JobRun.Status.RUNNING: "#1565c0",
    JobRun.Status.SUCCEEDED: "#2e7d32",
    JobRun.Status.FAILED: "#c62828",
    JobRun.Status.ABANDONED: "#6d4c41",
}


@admin.register(JobRun)
class JobRunAdmin(admin.ModelAdmin):
    """The audit trail: who ran which job in which slot. Nothing to add or edit."""

    list_display = ["job_name", "period", "status_badge", "started_at", "duration", "host", "pid"]
    list_filter = ["status", "job_name"]
    search_fields = ["job_name"]
    date_hierarchy = "started_at"
    ordering = ["-started_at"]
    show_full_result_count = False  # one COUNT(*) per page, not two, on a large ledger
    list_per_page = 50
    fields = [
        "job_name",
        "period",
        "status",
        "attempt",
        "started_at",
        "finished_at",
        "duration",
        "host",
        "pid",
        "lock_key",
        "traceback",
    ]
    readonly_fields = fields

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: JobRun) -> str:
        return format_html(
            '<span style="background:{};color:#fff;padding:2px 8px;border-radius:8px">{}</span>',
            STATUS_COLOURS[run.status],
            run.status,
        )

    @admin.display(description="traceback")
    def traceback(self, run: JobRun) -> str:
        return format_html('<pre style="white-space:pre-wrap">{}</pre>', run.error or "-")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
