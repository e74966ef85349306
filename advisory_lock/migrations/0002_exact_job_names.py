"""Compare job names and periods exactly on MySQL/MariaDB, as on PostgreSQL and SQLite."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import migrations

if TYPE_CHECKING:
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor
    from django.db.migrations.state import StateApps


def use_exact_collation(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    from advisory_lock.backends import inspector_for

    collation = inspector_for(schema_editor.connection).exact_collation()
    if collation is None:
        return
    job_run = apps.get_model("advisory_lock", "JobRun")
    for name in ("job_name", "period"):
        old = job_run._meta.get_field(name)
        new = old.clone()
        new.set_attributes_from_name(name)
        new.model = job_run
        new.db_collation = collation
        schema_editor.alter_field(job_run, old, new)


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot roll DDL back, and Django refuses DDL in a transaction there
    dependencies = [("advisory_lock", "0001_initial")]
    operations = [migrations.RunPython(use_exact_collation, migrations.RunPython.noop)]
