"""The admin of the job_runs ledger: the runs (read-only), the held locks, the schedule's
control room (live schedulers, each entry's health, pause / resume, run now, each entry's slot
timeline), and the operators' requests (read-only); the stored schedule entries' own pages are
``advisory_lock.scheduling.admin``'s, registered here.

Every time is shown one way (``advisory_lock.datetimes.shown``: the current time zone, to the
second), and each page names the zone once."""

from __future__ import annotations

import contextlib
import datetime
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

from advisory_lock.admin_writes import writes_first
from advisory_lock.backends import backend_for
from advisory_lock.backends import inspector_for
from advisory_lock.backends import is_supported
from advisory_lock.datetimes import shown
from advisory_lock.datetimes import shown_zone
from advisory_lock.exceptions import LedgerNotMigrated
from advisory_lock.inspection import find_lock_session
from advisory_lock.inspection import held_locks
from advisory_lock.keys import LockKey
from advisory_lock.ledger import first_line
from advisory_lock.migrate_pages import app_aliases
from advisory_lock.migrate_pages import ledger_checked
from advisory_lock.migrate_pages import says_to_migrate
from advisory_lock.models import JobRun
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.scheduling.admin import StoredEntryAdmin
from advisory_lock.scheduling.control import MAX_REASON_LENGTH
from advisory_lock.scheduling.control import JobControl
from advisory_lock.scheduling.control import NoSchedulerAlive
from advisory_lock.scheduling.control import check_reason
from advisory_lock.scheduling.control import latest_pauses
from advisory_lock.scheduling.control import request_run
from advisory_lock.scheduling.control import set_paused
from advisory_lock.scheduling.first_seen import first_seen
from advisory_lock.scheduling.health import health
from advisory_lock.scheduling.liveness import live_schedulers
from advisory_lock.scheduling.liveness import no_scheduler_alive
from advisory_lock.scheduling.overdue import overdue_jobs
from advisory_lock.scheduling.scheduler import Scheduler
from advisory_lock.scheduling.stored import TABLE
from advisory_lock.scheduling.stored import StoredEntry
from advisory_lock.scheduling.stored import all_entries
from advisory_lock.scheduling.timeline import MISSED
from advisory_lock.scheduling.timeline import PAUSED
from advisory_lock.scheduling.timeline import SlotOutcome
from advisory_lock.scheduling.timeline import parse_since
from advisory_lock.scheduling.timeline import timeline
from advisory_lock.validation import check_text

logger = logging.getLogger("advisory_lock")

#: The badge colour of each run status, keyed by the status as stored (a str: TextChoices
#: members equal and hash as their values). A status missing here (one that another version of
#: the app, or a ``QuerySet.update()``, stored) gets ``UNKNOWN_COLOUR`` and is shown as stored;
#: tests/test_admin_statuses.py, generated from ``JobRun.Status``, fails for a member of the
#: enum that has no colour of its own here.
STATUS_COLOURS: dict[str, str] = {
    JobRun.Status.RUNNING: "#1565c0",
    JobRun.Status.SUCCEEDED: "#2e7d32",
    JobRun.Status.FAILED: "#c62828",
    JobRun.Status.ABANDONED: "#6d4c41",
    JobRun.Status.ENQUEUED: "#6a1b9a",
}
UNKNOWN_COLOUR = "#37474f"
#: A timeline slot's outcome: its latest run's status, or ``paused`` / ``missed`` (no run).
OUTCOME_COLOURS: dict[str, str] = {**STATUS_COLOURS, PAUSED: "#757575", MISSED: "#c62828"}
#: The outcomes that need an operator's look, in bold on the timeline.
BOLD_OUTCOMES = frozenset({JobRun.Status.FAILED, MISSED})
STATUS_LABELS: dict[str, str] = dict(JobRun.Status.choices)


def status_badge(status: str) -> str:
    """A run status as a coloured badge: its label, or the value as stored for a status the
    enum does not have (escaped, as ``format_html`` escapes every argument)."""
    return format_html(
        '<span class="jobrun-status" data-status="{}" style="background:{};color:#fff;'
        'padding:2px 8px;border-radius:8px">{}</span>',
        status,
        STATUS_COLOURS.get(status, UNKNOWN_COLOUR),
        STATUS_LABELS.get(status, status),
    )


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

    list_display = [
        "job_name",
        "period",
        "status_badge",
        "attempt",
        "started",
        "took",
        "where",
        "error_line",
    ]
    list_filter = ["status", RecentJobFilter]
    search_fields = ["job_name"]
    date_hierarchy = "started_at"
    ordering = ["-started_at"]
    show_full_result_count = False  # one COUNT(*) per page, not two, on a large ledger
    list_per_page = 50
    # What failed first, under the status: an operator reads a failed run top down.
    fields = [
        "job_name",
        "period",
        "status_badge",
        "traceback",
        "attempt",
        "started",
        "finished",
        "duration",
        "host",
        "pid",
        "lock_key",
        "task_id",
    ]
    # Plain names: the stubs type ``fields`` as a list of field groups, which a list of names
    # is not (list is invariant).
    readonly_fields = fields  # type: ignore[assignment]

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: JobRun) -> str:
        return status_badge(run.status)

    @admin.display(description="started", ordering="started_at")
    def started(self, run: JobRun) -> str:
        return shown(run.started_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished(self, run: JobRun) -> str:
        return shown(run.finished_at)

    @admin.display(description="host · pid", ordering="host")
    def where(self, run: JobRun) -> str:
        return f"{run.host or '?'} · {run.pid}" if run.pid is not None else run.host or "—"

    @admin.display(description="error")
    def error_line(self, run: JobRun) -> str:
        """The error's first line; the whole of it in the cell's title (the page's CSS cuts
        the cell to the table's width)."""
        line = first_line(run.error)
        return format_html('<span title="{}">{}</span>', line, line) if line else "—"

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

    @says_to_migrate
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The runs, and above them the declared jobs that are overdue."""
        _ignore_unusable_filters(request)
        try:
            with ledger_checked(app_aliases()):
                overdue = overdue_jobs(router.db_for_read(JobRun))
        except DatabaseError as error:
            logger.warning("The overdue jobs could not be read: %s", error)
            overdue = []
        overdue_rows = [
            {
                "job": job,
                "ended": shown(job.slot_ended_at),
                "last_finished": shown(job.last_success.finished_at)
                if job.last_success is not None
                else "",
            }
            for job in overdue
        ]
        context = {**(extra_context or {}), "overdue": overdue_rows, "zone": shown_zone()}
        return super().changelist_view(request, context)

    # Django's other views of a run read it (or, to delete it, write it): each says to run
    # migrate, as the changelist does, when the app's tables are missing.

    @says_to_migrate
    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = {**(extra_context or {}), "zone": shown_zone()}
        return super().changeform_view(request, object_id, form_url, context)

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

    @says_to_migrate
    def schedule_view(self, request: HttpRequest) -> HttpResponse:
        """ADVISORY_LOCK["SCHEDULE"]: each entry's next slot and last run, overdue marked."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {**self.admin_site.each_context(request), "title": "Schedule"}
        context["zone"] = shown_zone()
        using = router.db_for_read(JobRun)
        try:
            # A missing table raises LedgerNotMigrated, which these excepts let through.
            with ledger_checked(app_aliases()):
                entries = all_entries(using)
                rows = Scheduler(entries, using=using).listing()
                overdue = {job.job_name: job for job in overdue_jobs(using)}
                paused = latest_pauses(using, entries)
                healths = {name: health(entry, using) for name, entry in entries.items()}
        except (ValueError, DatabaseError) as error:
            context["error"] = str(error)
            return TemplateResponse(request, "admin/advisory_lock/schedule.html", context)
        for row in rows:
            name = row["name"]
            row["overdue"] = overdue.get(name)
            row["pause"] = paused.get(name) if row["paused"] else None
            row["paused_at"] = shown(row["pause"].requested_at) if row["pause"] else ""
            row["last_started"] = (
                shown(datetime.datetime.fromisoformat(row["last_started"]))
                if row["last_started"]
                else None
            )
            state = healths[name]
            row["strip"] = [_strip_cell(name, slot) for slot in state.strip]
            row["success_rate"] = state.success_rate
            row["succeeded"], row["over"] = state.succeeded, state.over
            row["failing"] = state.failing
        try:
            with ledger_checked(app_aliases()):
                live = live_schedulers(using)
                dead_since = "" if live else no_scheduler_alive(using)
        except DatabaseError as error:
            live, dead_since = [], f"The schedulers' heartbeats could not be read: {error}"
        context.update(
            rows=rows,
            live=[{"scheduler": row, "seen": shown(row.last_seen)} for row in live],
            dead_since=dead_since,
            can_pause=request.user.has_perm("advisory_lock.pause_job"),
            max_reason=MAX_REASON_LENGTH,
            can_view_controls=request.user.has_perm("advisory_lock.view_jobcontrol"),
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

    @says_to_migrate
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
        using = router.db_for_write(JobControl)
        try:
            entries = all_entries(using)
        except ValueError as error:
            messages.error(request, str(error))
            return back
        if name not in entries:
            messages.error(
                request,
                f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}, nor has {TABLE}.",
            )
            return back
        who = f"admin user {request.user.get_username()!r}"
        reason = request.POST.get("reason", "")
        try:
            check_reason(reason)
        except ValueError as error:
            messages.error(request, f"Nothing was done: {error}")
            return back
        if action == "run_now":
            try:
                row = request_run(using, name, who, reason)
            except NoSchedulerAlive as error:
                messages.error(request, str(error))
                return back
            done = f"Requested a run of the scheduled entry {name!r} now (slot {row.slot})."
        else:
            changed = set_paused(using, name, action == "pause", who, reason)
            state = "Paused" if action == "pause" else "Resumed"
            if changed is None:
                messages.info(request, f"{name!r} was already {state.lower()}: nothing changed.")
                return back
            row = changed
            done = f"{state} the scheduled entry {name!r}."
        self.log_change(request, row, done)
        messages.success(request, done)
        return back

    @says_to_migrate
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
            using = router.db_for_read(JobRun)
            # A missing table raises LedgerNotMigrated, which the except lets through.
            with ledger_checked(app_aliases()):
                entry = all_entries(using).get(name)
            if entry is None:
                raise ValueError(
                    f"ADVISORY_LOCK['SCHEDULE'] has no entry named {name!r}, nor has {TABLE}."
                )
            since = parse_since(context["since"]) if context["since"] else None
            with ledger_checked(app_aliases()):
                slots = timeline(entry, using, since)
                seen = first_seen(using, [name]).get(name)
        except (ValueError, DatabaseError) as error:
            context["error"] = str(error)
            return TemplateResponse(request, "admin/advisory_lock/timeline.html", context)
        context["zone"] = shown_zone()
        context["first_seen"] = shown(seen) if seen else ""
        context["rows"] = [
            {
                "slot": slot,
                "started": shown(slot.started),
                "colour": OUTCOME_COLOURS.get(slot.outcome, UNKNOWN_COLOUR),
                "weight": "bold" if slot.outcome in BOLD_OUTCOMES else "normal",
                "run_url": _run_url(slot.run_id),
            }
            for slot in slots
        ]
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
        context = {
            **self.admin_site.each_context(request),
            "title": "Advisory locks",
            "zone": shown_zone(),
        }
        try:
            locks = held_locks(using)
        except DatabaseError as error:
            context.update(using=using, rows=[], error=f"The database did not answer: {error}")
            return TemplateResponse(request, "admin/advisory_lock/locks.html", context)
        try:
            # The runs are this alias's: a ledger not migrated there hides them, not the locks.
            with ledger_checked([using]):
                runs = _latest_runs(using)
        except LedgerNotMigrated as error:
            runs, context["runs_note"] = {}, f"The latest runs can't be shown: {error}"
        context.update(
            using=using,
            aliases=_lock_aliases(),
            source=locks.source,
            note=locks.note,
            rows=[
                {
                    "lock": lock,
                    "run": runs.get(lock.db_key),
                    "seconds": lock.held_for if lock.granted else lock.waited_for,
                    "connected": shown(lock.backend_start) if lock.backend_start else "",
                }
                for lock in locks
            ],
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


@admin.register(JobControl)
class JobControlAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Every pause, resume and run-now request, from the command line or the admin, with who
    asked, when and why: read-only (the rows are the entries' history)."""

    list_display = ["requested", "job_name", "action_label", "requested_by", "reason", "slot"]
    list_filter = ["action"]
    search_fields = ["job_name", "requested_by", "reason"]
    ordering = ["-requested_at", "-pk"]
    show_full_result_count = False
    list_per_page = 50
    fields = ["job_name", "action_label", "requested", "requested_by", "reason", "slot"]
    readonly_fields = fields  # type: ignore[assignment]

    @admin.display(description="requested", ordering="requested_at")
    def requested(self, control: JobControl) -> str:
        return shown(control.requested_at)

    @admin.display(description="action", ordering="action")
    def action_label(self, control: JobControl) -> str:
        """The action's label; one this version does not know (a later version's row) as
        stored, where Django's display of a choice field shows only a dash."""
        return control.get_action_display()

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @says_to_migrate
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        _ignore_unusable_filters(request)
        return super().changelist_view(request, {**(extra_context or {}), "zone": shown_zone()})

    @says_to_migrate
    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        context = {**(extra_context or {}), "zone": shown_zone()}
        return super().changeform_view(request, object_id, form_url, context)

    @says_to_migrate
    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().history_view(request, object_id, extra_context)


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


def _run_url(run_id: int | None) -> str:
    """The page of a run ("" for no run)."""
    if run_id is None:
        return ""
    return reverse("admin:advisory_lock_jobrun_change", args=[run_id])


def slot_anchor(slot: str) -> str:
    """The HTML id of a slot's row on the timeline page (a slot name has no space)."""
    return f"slot-{slot}"


def _strip_cell(name: str, slot: SlotOutcome) -> dict[str, str]:
    """A cell of an entry's health strip: its colour, what it says on hover, and where it
    links: the slot's latest run, or (no run) the slot's row on the entry's timeline."""
    url = _run_url(slot.run_id)
    if not url:
        query = QueryDict(mutable=True)
        query.update({"entry": name, "since": slot.due.isoformat()})
        url = (
            f"{reverse('admin:advisory_lock_jobrun_timeline')}?{query.urlencode()}"
            f"#{slot_anchor(slot.slot)}"
        )
    return {
        "url": url,
        "colour": OUTCOME_COLOURS.get(slot.outcome, UNKNOWN_COLOUR),
        "outcome": slot.outcome,
        "title": f"{slot.slot}: {slot.outcome}",
    }


def _lock_aliases() -> list[str]:
    return [alias for alias in connections if is_supported(connections[alias])]


def _latest_runs(using: str) -> dict[Any, JobRun]:
    """The latest run under each lock of database ``using``, by the lock's key there (the
    ledger's rows name their lock)."""
    backend = backend_for(connections[using])
    latest: dict[Any, JobRun] = {}
    for run in JobRun.objects.using(using).exclude(lock_key="").order_by("-started_at")[:500]:
        with contextlib.suppress(ValueError, TypeError, ImproperlyConfigured):
            latest.setdefault(backend.db_key(LockKey.from_identity(run.lock_key)), run)
    return latest


admin.site.register(StoredEntry, StoredEntryAdmin)
