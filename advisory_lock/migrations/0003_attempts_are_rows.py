"""Each attempt at a slot is a row of its own (its id is the run's fencing token), and every
row names the identity of the lock that guards it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import migrations
from django.db import models

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps


def name_the_locks_of_running_rows(
    apps: StateApps, schema_editor: BaseDatabaseSchemaEditor
) -> None:
    """Rows written before held the lock's key as given (a string key only): write its
    identity, ``<namespace>:<key>``, so that an orphaned row can still be proven so."""
    from advisory_lock.conf import get_setting

    job_run = apps.get_model("advisory_lock", "JobRun")
    rows = job_run.objects.using(schema_editor.connection.alias)
    namespace = get_setting("NAMESPACE")
    for run in rows.filter(status="running").exclude(lock_key=""):
        run.lock_key = f"{namespace}:{run.lock_key}"
        run.save(update_fields=["lock_key"])


class Migration(migrations.Migration):
    dependencies = [("advisory_lock", "0002_exact_job_names")]

    operations = [
        migrations.RemoveConstraint(model_name="jobrun", name="job_runs_job_period_uniq"),
        migrations.AlterField(
            model_name="jobrun",
            name="lock_key",
            field=models.TextField(
                blank=True,
                help_text="The lock guarding the run (its key's identity); free means abandoned.",
            ),
        ),
        migrations.AddConstraint(
            model_name="jobrun",
            constraint=models.UniqueConstraint(
                fields=("job_name", "period", "attempt"), name="job_runs_job_period_attempt_uniq"
            ),
        ),
        migrations.RunPython(name_the_locks_of_running_rows, migrations.RunPython.noop),
    ]
