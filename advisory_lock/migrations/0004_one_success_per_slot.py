"""At most one success per slot, enforced by the database: a generated column, 1 on a
succeeded row and NULL on any other, in a unique index with the job and the slot.

A ledger that already has two successes in a slot (written by hand: the ledger's claims refuse
a slot that has one) can't get the index. The migration then stops with the list of those
slots before it changes anything, and runs once they are resolved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS
from django.db import migrations
from django.db import models

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps

#: The slots named in the error, at most; a query that lists them all follows.
LISTED = 20


def refuse_slots_with_several_successes(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor
) -> None:
    """Raise ``CommandError`` naming each job and slot with more than one succeeded run.

    The first operation of the migration: on MariaDB/MySQL, whose DDL commits at once (the
    migration runs in no transaction there), nothing has been changed when it raises; on
    PostgreSQL and SQLite the migration's transaction is rolled back as well.
    """
    job_run = apps.get_model("advisory_lock", "JobRun")
    using = schema_editor.connection.alias
    succeeded = job_run.objects.using(using).filter(status="succeeded")
    slots = list(
        succeeded.values_list("job_name", "period")
        .annotate(runs=models.Count("pk"))
        .filter(runs__gt=1)
        .order_by("job_name", "period")
    )
    if not slots:
        return
    lines = []
    for job_name, period, _ in slots[:LISTED]:
        ids = succeeded.filter(job_name=job_name, period=period).order_by("pk")
        listed = ", ".join(str(pk) for pk in ids.values_list("pk", flat=True))
        lines.append(f"  job {job_name!r}, slot {period!r}: succeeded runs (id) {listed}")
    if len(slots) > LISTED:
        lines.append(
            f"  and {len(slots) - LISTED} more slot(s): SELECT job_name, period FROM job_runs "
            f"WHERE status = 'succeeded' GROUP BY job_name, period HAVING COUNT(*) > 1"
        )
    database = "" if using == DEFAULT_DB_ALIAS else f" --database {using}"
    raise CommandError(
        f"Migration advisory_lock.0004_one_success_per_slot makes the database allow one "
        f"succeeded run per job and slot (a unique index), but {len(slots)} slot(s) of the "
        f"job_runs table on database {using!r} have more than one. Nothing was changed.\n"
        + "\n".join(lines)
        + f"\nKeep one success in each of these slots: mark the others abandoned (UPDATE "
        f"job_runs SET status = 'abandoned' WHERE id IN (...)) or delete them, then run "
        f"'manage.py migrate{database}' again."
    )


class Migration(migrations.Migration):
    dependencies = [("advisory_lock", "0003_attempts_are_rows")]

    operations = [
        # First: it must stop the migration before the column or the index is added. On
        # MariaDB/MySQL the check and the index are not one transaction: a second success
        # written by hand between them would make AddConstraint fail after AddField; the
        # ledger never writes one (its claims refuse a slot that has a success).
        migrations.RunPython(refuse_slots_with_several_successes, migrations.RunPython.noop),
        migrations.AddField(
            model_name="jobrun",
            name="succeeded",
            field=models.GeneratedField(
                db_persist=True,
                expression=models.Case(models.When(status="succeeded", then=models.Value(1))),
                help_text="1 on a succeeded run, else NULL: a unique index allows one per slot.",
                output_field=models.SmallIntegerField(),
            ),
        ),
        migrations.AddConstraint(
            model_name="jobrun",
            constraint=models.UniqueConstraint(
                fields=("job_name", "period", "succeeded"), name="job_runs_one_success_per_slot"
            ),
        ),
    ]
