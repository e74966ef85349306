"""The admin of the job_runs ledger: the runs (read-only), the held locks, and the schedule's
control room (live schedulers, pause / resume, run now, each entry's slot timeline)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from django.contrib import admin
from django.contrib import messages
from django.core.exceptions import ImproperlyConfigured
from django.core.exceptions import PermissionDenied
from django.db import DEFAULT_DB_ALIAS
from django.db import DatabaseError
from django.db import connections
from django.db import router
from django.http import HttpRequest
from django.http import HttpResponse
from django.http import HttpResponseNotAllowed
from django.http import HttpResponseRedirect
from django.http import QueryDict
from django.template.response import TemplateResponse
from django.urls import path
from django.urls import reverse
from django.utils.html import format_html

from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.backends import is_supported
from advisory_lock.control import JobControl
from advisory_lock.control import NoSchedulerAlive
from advisory_lock.control import request_run
from advisory_lock.control import set_paused
from advisory_lock.inspection import HeldLock
from advisory_lock.inspection import find_lock_session
from advisory_lock.inspection import held_locks
from advisory_lock.keys import LockKey
from advisory_lock.liveness import live_schedulers
from advisory_lock.liveness import no_scheduler_alive
from advisory_lock.models import JobRun
from advisory_lock.overdue import overdue_jobs
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.schedule import entries as schedule_entries
from advisory_lock.scheduler import Scheduler
from advisory_lock.timeline import parse_since
from advisory_lock.timeline import timeline
from advisory_lock.validation import check_text

logger = logging.getLogger("advisory_lock")

# Keyed by the status as stored (a str): TextChoices members equal and hash as their values.
STATUS_COLOURS: dict[str, str] = {
    JobRun.Status.RUNNING: "#1565c0",
    JobRun.Status.SUCCEEDED: "#2e7d32",
    JobRun.Status.FAILED: "#c62828",
    JobRun.Status.ABANDONED: "#6d4c41",
}


class RecentJobFilter(admin.SimpleListFilter):
    """Filter by job name, offering the jobs of the latest runs.

    Django's default for a CharField lists SELECT DISTINCT over the whole table, a full scan
    on a large ledger; the latest runs come from the started_at index. A job that did not
    run lately can still be filtered on with ?job_name=... in the URL.
    """

    title = "job name"
    parameter_name = "job_name"
    recent_runs = 2000

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        recent = model_admin.get_queryset(request).order_by("-started_at")[: self.recent_runs]
        names = sorted(set(recent.values_list("job_name", flat=True)))
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        return queryset.filter(job_name=self.value()) if self.value() else queryset


@admin.register(JobRun)
# ModelAdmin is generic in django-stubs only: Django's class can't be subscripted at run time.
class JobRunAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """The audit trail: who ran which job in which slot. Nothing to add or edit."""

    list_display = ["job_name", "period", "status_badge", "started_at", "took", "host", "pid"]
    list_filter = ["status", RecentJobFilter]
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
    # Plain names: the stubs type ``fields`` as a list of field groups, which a list of names
    # is not (list is invariant).
    readonly_fields = fields  # type: ignore[assignment]

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: JobRun) -> str:
        return format_html(
            '<span style="background:{};color:#fff;padding:2px 8px;border-radius:8px">{}</span>',
            STATUS_COLOURS[run.status],
            run.status,
        )

    @admin.display(description="duration", ordering="duration")
    def took(self, run: JobRun) -> str:
        if run.duration is None:
            return "-"
        seconds = run.duration.total_seconds()
        return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"

    @admin.display(description="traceback")
    def traceback(self, run: JobRun) -> str:
        return format_html('<pre style="white-space:pre-wrap">{}</pre>', run.error or "-")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    # The "Advisory locks" page: the live table of held and awaited locks.

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The runs, and above them the declared jobs that are overdue."""
        _ignore_unusable_filters(request)
        try:
            overdue = overdue_jobs(router.db_for_read(JobRun))
        except DatabaseError as error:
            logger.warning("The overdue jobs could not be read: %s", error)
            overdue = []
        return super().changelist_view(request, {**(extra_context or {}), "overdue": overdue})

    def get_urls(self) -> list[Any]:
        view = self.admin_site.admin_view
        return [
            path("locks/", view(self.locks_view), name="advisory_lock_jobrun_locks"),
            path("schedule/", view(self.schedule_view), name="advisory_lock_jobrun_schedule"),
            path(
                "schedule/control/",
                view(self.schedule_control_view),
                name="advisory_lock_jobrun_schedule_control",
            ),
            path(
                "schedule/timeline/",
                view(self.timeline_view),
                name="advisory_lock_jobrun_timeline",
            ),
            path(
                "locks/terminate/<int:holder_id>/",
                view(self.terminate_view),
                name="advisory_lock_jobrun_terminate",
            ),
            *super().get_urls(),
        ]

    def schedule_view(self, request: HttpRequest) -> HttpResponse:
        """ADVISORY_LOCK["SCHEDULE"]: each entry's next slot and last run, overdue marked."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {**self.admin_site.each_context(request), "title": "Schedule"}
        using = router.db_for_read(JobRun)
        try:
            rows = Scheduler(schedule_entries(), using=using).listing()
            overdue = {job.job_name: job for job in overdue_jobs(using)}
        except (ValueError, DatabaseError) as error:
            context["error"] = str(error)
            return TemplateResponse(request, "admin/advisory_lock/schedule.html", context)
        for row in rows:
            row["overdue"] = overdue.get(row["name"])
        try:
            live = live_schedulers(using)
            dead_since = "" if live else no_scheduler_alive(using)
        except DatabaseError as error:  # the control room's tables not migrated yet
            live, dead_since = [], f"The schedulers' heartbeats could not be read: {error}"
        context.update(
            rows=rows,
            live=live,
            dead_since=dead_since,
            can_pause=request.user.has_perm("advisory_lock.pause_job"),
            can_run_now=request.user.has_perm("advisory_lock.run_job_now"),
            opts=self.model._meta,
        )
        return TemplateResponse(request, "admin/advisory_lock/schedule.html", context)

    # Permission each control needs (custom permissions of JobControl).
    CONTROLS = {
        "pause": "advisory_lock.pause_job",
        "resume": "advisory_lock.pause_job",
        "run_now": "advisory_lock.run_job_now",
    }

    def schedule_control_view(self, request: HttpRequest) -> HttpResponse:
        """Pause, resume or run now an entry: a POST (with Django's CSRF check, as every
        admin view), by staff with the control's permission, logged in the admin's history."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        action = request.POST.get("action", "")
        permission = self.CONTROLS.get(action)
        if permission is None or not request.user.has_perm(permission):
            raise PermissionDenied
        name = request.POST.get("entry", "")
        back = HttpResponseRedirect(reverse("admin:advisory_lock_jobrun_schedule"))
        try:
            entries = schedule_entries()
        except ValueError as error:
            messages.error(request, str(error))
            return back
        if name not in entries:
            messages.error(request, f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}.")
            return back
        using = router.db_for_write(JobControl)
        who = f"admin user {request.user.get_username()!r}"
        if action == "run_now":
            try:
                row = request_run(using, name, who)
            except NoSchedulerAlive as error:
                messages.error(request, str(error))
                return back
            done = f"Requested a run of the scheduled entry {name!r} now (slot {row.slot})."
        else:
            changed = set_paused(using, name, action == "pause", who)
            state = "Paused" if action == "pause" else "Resumed"
            if changed is None:
                messages.info(request, f"{name!r} was already {state.lower()}: nothing changed.")
                return back
            row = changed
            done = f"{state} the scheduled entry {name!r}."
        self.log_change(request, row, done)
        messages.success(request, done)
        return back

    def timeline_view(self, request: HttpRequest) -> HttpResponse:
        """One entry's slots since ``?since=`` (default: 7 days), with their outcomes."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        name = request.GET.get("entry", "")
        context = {
            **self.admin_site.each_context(request),
            "title": f"Timeline of {name}",
            "entry": name,
            "since": request.GET.get("since", ""),
            "opts": self.model._meta,
        }
        try:
            entry = schedule_entries().get(name)
            if entry is None:
                raise ValueError(f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}.")
            since = parse_since(context["since"]) if context["since"] else None
            slots = timeline(entry, router.db_for_read(JobRun), since)
        except (ValueError, DatabaseError) as error:
            context["error"] = str(error)
            return TemplateResponse(request, "admin/advisory_lock/timeline.html", context)
        context["slots"] = slots
        context["counts"] = {
            outcome: sum(1 for slot in slots if slot.outcome == outcome)
            for outcome in sorted({slot.outcome for slot in slots})
        }
        return TemplateResponse(request, "admin/advisory_lock/timeline.html", context)

    def locks_view(self, request: HttpRequest) -> HttpResponse:
        """Who holds which lock: for staff with the view permission on job runs."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        using = self._alias(request)
        context = {**self.admin_site.each_context(request), "title": "Advisory locks"}
        try:
            locks = held_locks(using)
        except DatabaseError as error:
            context.update(using=using, rows=[], error=f"The database did not answer: {error}")
            return TemplateResponse(request, "admin/advisory_lock/locks.html", context)
        context.update(
            using=using,
            aliases=_lock_aliases(),
            source=locks.source,
            note=locks.note,
            rows=_rows_with_runs(locks, using),
            is_superuser=request.user.is_superuser,
            opts=self.model._meta,
        )
        return TemplateResponse(request, "admin/advisory_lock/locks.html", context)

    def terminate_view(self, request: HttpRequest, holder_id: int) -> HttpResponse:
        """End a lock holder's session, after a confirmation: superusers only, logged, and
        only a session that holds or waits for an advisory lock at that moment."""
        if not request.user.is_superuser:
            raise PermissionDenied
        using = self._alias(request)
        back = HttpResponseRedirect(f"{reverse('admin:advisory_lock_jobrun_locks')}?using={using}")
        lock = find_lock_session(using, holder_id)
        if lock is None:
            messages.error(
                request,
                f"{holder_id} holds no advisory lock on database {using!r} now (it may have "
                f"let go): nothing was terminated.",
            )
            return back
        if request.method != "POST":
            context = {
                **self.admin_site.each_context(request),
                "title": "Terminate a lock holder?",
                "holder_id": holder_id,
                "lock": lock,
                "using": using,
                "how": connections[using].vendor,
            }
            return TemplateResponse(request, "admin/advisory_lock/terminate.html", context)
        inspector_for(connections[using]).terminate(holder_id)
        logger.warning(
            "Admin user %r terminated lock holder %s (lock %s) on database %r.",
            request.user.get_username(),
            holder_id,
            lock.name or lock.key_text,
            using,
        )
        messages.success(request, f"Terminated holder {holder_id} on database {using!r}.")
        return back

    @staticmethod
    def _alias(request: HttpRequest) -> str:
        using = request.POST.get("using") or request.GET.get("using") or DEFAULT_DB_ALIAS
        if using not in _lock_aliases():
            raise PermissionDenied  # not an alias with locks: nothing to show
        return using


def _ignore_unusable_filters(request: HttpRequest) -> None:
    """Drop the changelist's query parameters whose value no job run can hold, saying so.

    A NUL (``?job_name=%00``) would reach the database, which PostgreSQL refuses with an
    error (a 500), and a job name longer than its column matches nothing anyway.
    """
    ignored: dict[str, str] = {}
    for name, values in request.GET.lists():
        limit = MAX_JOB_NAME_LENGTH if name == RecentJobFilter.parameter_name else None
        for value in values:
            try:
                check_text(name, value, max_length=limit)
            except ValueError as error:
                ignored.setdefault(name, str(error))
    if not ignored:
        return
    kept = request.GET.copy()
    for name, reason in ignored.items():
        del kept[name]
        messages.warning(request, f"The filter {name}= was ignored: {reason}")
    request.GET = QueryDict(kept.urlencode())  # immutable, as Django makes it


def _lock_aliases() -> list[str]:
    return [alias for alias in connections if is_supported(connections[alias])]


def _rows_with_runs(locks: list[HeldLock], using: str) -> list[dict[str, Any]]:
    """Each lock with the latest run guarded by it (the ledger's rows name their lock)."""
    backend = backend_for(connections[using])
    latest: dict[Any, JobRun] = {}
    for run in JobRun.objects.using(using).exclude(lock_key="").order_by("-started_at")[:500]:
        with contextlib.suppress(ValueError, TypeError, ImproperlyConfigured):
            latest.setdefault(backend.db_key(LockKey.from_identity(run.lock_key)), run)
    return [
        {
            "lock": lock,
            "run": latest.get(lock.db_key),
            "seconds": lock.held_for if lock.granted else lock.waited_for,
        }
        for lock in locks
    ]
