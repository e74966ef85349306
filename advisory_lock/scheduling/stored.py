"""Schedule entries stored in the database (``job_schedule_entries``, model ``StoredEntry``):
added, changed, paused and deleted at run time (in the admin, or with the ORM) instead of by
a deploy, beside the entries of ``ADVISORY_LOCK["SCHEDULE"]``.

A row holds the keys of a ``SCHEDULE`` entry (``advisory_lock.schedule.OPTIONS``), one
column each, and is validated by the same ``entry_problems`` as the setting's entries, with
the same messages (naming the table instead of the setting): in the admin's form, and by
``save()``. A name is in one schedule only: a row can't take the name of a ``SCHEDULE`` entry.
A stored entry is paused and run now as any entry (``scheduling.control``), on the ledger's
database, where its rows are.

How a live scheduler follows the rows: every ``save()`` and ``delete()`` (a queryset's
``delete()`` too: Django sends ``post_delete`` for each row when a receiver listens) writes a
row of ``job_controls`` (``control.record_change``) and sends a notification, both in the
writing transaction. On PostgreSQL the schedulers hear it when that transaction commits (never
if it rolls back) and read the rows again at once; elsewhere their look for run-now requests,
every poll interval, finds the change's row in the same statement, and they read the rows
again (one statement, on a change only). ``QuerySet.update()`` and raw SQL record nothing: a
scheduler sees such a change at the next change of an entry, or when it restarts.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS
from django.core.exceptions import ValidationError
from django.db import connections
from django.db import models
from django.db import router
from django.db.models.signals import post_delete
from django.db.models.signals import post_save
from django.dispatch import receiver

from advisory_lock.backends import inspector_for
from advisory_lock.conf import get_setting
from advisory_lock.conf import require_app
from advisory_lock.datetimes import to_field
from advisory_lock.periods import MAX_JOB_NAME_LENGTH
from advisory_lock.schedule import CATCH_UP
from advisory_lock.schedule import OPTIONS
from advisory_lock.schedule import SETTING
from advisory_lock.schedule import Entry
from advisory_lock.schedule import entries
from advisory_lock.schedule import entry_from
from advisory_lock.schedule import entry_problems
from advisory_lock.scheduling.control import record_change

#: The table of the stored entries: what their problems name them by, as ``SETTING`` does
#: the setting's (``job_schedule_entries['poll']['every'] must be ...``).
TABLE = "job_schedule_entries"

require_app()  # before the model: Django can only define a model of an installed app


class StoredEntry(models.Model):
    """One scheduled job stored in the database: a ``SCHEDULE`` entry, one column per key."""

    name = models.CharField(
        max_length=MAX_JOB_NAME_LENGTH,
        unique=True,
        help_text="The job name of its runs; not a name of ADVISORY_LOCK['SCHEDULE'].",
    )
    command = models.CharField(
        max_length=200, blank=True, help_text="A management command (or callable, or task)."
    )
    args = models.JSONField(
        null=True, blank=True, help_text="A command's or task's arguments: a JSON list."
    )
    callable = models.CharField(
        max_length=255, blank=True, help_text="The dotted path of a function taking no argument."
    )
    task = models.CharField(
        max_length=255,
        blank=True,
        help_text="A django.tasks or Celery task's dotted path: each slot enqueues it.",
    )
    kwargs = models.JSONField(
        null=True, blank=True, help_text="A task's keyword arguments: a JSON object."
    )
    cron = models.CharField(
        max_length=100,
        blank=True,
        help_text="Five cron fields, or an alias such as @daily; in the ledger's time zone.",
    )
    every = models.FloatField(null=True, blank=True, help_text="Seconds between two slots.")
    catch_up = models.CharField(
        max_length=16, choices=[(how, how) for how in CATCH_UP], default="latest"
    )
    retries = models.BigIntegerField(default=1)
    timeout = models.FloatField(null=True, blank=True, help_text="Seconds.")
    grace = models.FloatField(
        null=True, blank=True, help_text="Seconds: watched by the overdue report."
    )
    atomic = models.BooleanField(default=False)
    alert_after = models.BigIntegerField(
        default=3, help_text="Slots that must all have failed to flag the entry as failing."
    )
    created_at = models.DateTimeField(editable=False, help_text="By the database server's clock.")
    updated_at = models.DateTimeField(editable=False, help_text="By the database server's clock.")

    class Meta:
        db_table = TABLE
        verbose_name = "stored schedule entry"
        verbose_name_plural = "stored schedule entries"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def options(self) -> dict[str, Any]:
        """The entry as ``SCHEDULE`` would hold it: each key whose column has a value."""
        return {
            key: value
            for key in OPTIONS
            if (value := getattr(self, key)) is not None and value != ""
        }

    def entry(self) -> Entry:
        """The ``Entry`` of a valid row (see ``problems``)."""
        return entry_from(self.name, self.options())

    def problems(self) -> list[str]:
        """What is wrong with the row, in the words of a ``SCHEDULE`` entry's problems, and
        a name that ``SCHEDULE`` has too; empty if it can be scheduled."""
        problems = entry_problems(self.name, self.options(), schedule=TABLE)
        if _in_settings(self.name):
            problems.append(
                f"{SETTING} has an entry named {self.name!r} too: a name is in one schedule "
                f"only (rename this one, or remove that one from the settings)."
            )
        return problems

    def clean(self) -> None:
        """The problems as a ``ValidationError``, each on the field it names (a ModelForm's
        errors, the admin's): ``...['every'] must be ...`` on ``every``."""
        errors: dict[str, list[str]] = {}
        for problem in self.problems():
            errors.setdefault(_field_of(self.name, problem), []).append(problem)
        if errors:
            raise ValidationError(errors)

    def save(self, *args: Any, **kwargs: Any) -> None:
        """Save a valid row (else ``ValidationError``, as ``clean``), stamped with the
        database server's clock."""
        self.clean()
        using = kwargs.get("using") or router.db_for_write(type(self), instance=self)
        now = to_field(inspector_for(connections[using]).database_now())
        if self.created_at is None:
            self.created_at = now
        self.updated_at = now
        super().save(*args, **kwargs)


@receiver(post_save, sender=StoredEntry)
@receiver(post_delete, sender=StoredEntry)
def _announce(sender: type[StoredEntry], instance: StoredEntry, using: str, **kwargs: Any) -> None:
    """Tell the live schedulers, with the writing transaction (``control.record_change``)."""
    record_change(using, instance.name)


def _in_settings(name: str) -> bool:
    setting = get_setting("SCHEDULE")
    return isinstance(setting, dict) and name in setting


def _field_of(name: str, problem: str) -> str:
    """The field a problem is about: the name's, or the key it names right after the entry
    (``job_schedule_entries['poll']['every'] must be ...``, as ``entry_problems`` shows it),
    if any."""
    if (
        problem.startswith((f"{TABLE} has an entry name", SETTING))
        or "the entry's name" in problem
    ):
        return "name"
    shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}..."
    after = problem.removeprefix(f"{TABLE}[{shown}]")
    return next((key for key in OPTIONS if after.startswith(f"[{key!r}]")), NON_FIELD_ERRORS)


def stored_entries(using: str) -> tuple[dict[str, Entry], list[str]]:
    """The stored entries of ``using`` that can be scheduled (one statement), and the
    problems of those that can't (a callable gone in a deploy, a name now in ``SCHEDULE``):
    those are left out, whatever their problem, and the others scheduled."""
    valid: dict[str, Entry] = {}
    problems: list[str] = []
    for row in StoredEntry.objects.using(using):
        if found := row.problems():
            problems += found
        else:
            valid[row.name] = row.entry()
    return valid, problems


def all_entries(using: str) -> dict[str, Entry]:
    """The whole schedule: ``SCHEDULE``'s entries (``ValueError`` if it has a problem) and
    the stored entries of ``using`` that can be scheduled."""
    configured = entries()
    stored, _ = stored_entries(using)
    return {**stored, **configured}
