"""Schedule entries stored in the database: job_schedule_entries holds the entries added,
changed and deleted at run time (the admin, the ORM), beside ADVISORY_LOCK["SCHEDULE"]; each
change is a row of job_controls too (a new action, "change": no column changes)."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0009_lock_names"),
    ]

    operations = [
        migrations.CreateModel(
            name="StoredEntry",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        help_text=(
                            "The job name of its runs; not a name of ADVISORY_LOCK['SCHEDULE']."
                        ),
                        max_length=200,
                        unique=True,
                    ),
                ),
                (
                    "command",
                    models.CharField(
                        blank=True,
                        help_text="A management command (or callable, or task).",
                        max_length=200,
                    ),
                ),
                (
                    "args",
                    models.JSONField(
                        blank=True,
                        help_text="A command's or task's arguments: a JSON list.",
                        null=True,
                    ),
                ),
                (
                    "callable",
                    models.CharField(
                        blank=True,
                        help_text="The dotted path of a function taking no argument.",
                        max_length=255,
                    ),
                ),
                (
                    "task",
                    models.CharField(
                        blank=True,
                        help_text=(
                            "A django.tasks or Celery task's dotted path: each slot enqueues it."
                        ),
                        max_length=255,
                    ),
                ),
                (
                    "kwargs",
                    models.JSONField(
                        blank=True,
                        help_text="A task's keyword arguments: a JSON object.",
                        null=True,
                    ),
                ),
                (
                    "cron",
                    models.CharField(
                        blank=True,
                        help_text=(
                            "Five cron fields, or an alias such as @daily; "
                            "in the ledger's time zone."
                        ),
                        max_length=100,
                    ),
                ),
                (
                    "every",
                    models.FloatField(
                        blank=True, help_text="Seconds between two slots.", null=True
                    ),
                ),
                (
                    "catch_up",
                    models.CharField(
                        choices=[("latest", "latest"), ("all", "all"), ("none", "none")],
                        default="latest",
                        max_length=16,
                    ),
                ),
                ("retries", models.BigIntegerField(default=1)),
                ("timeout", models.FloatField(blank=True, help_text="Seconds.", null=True)),
                (
                    "grace",
                    models.FloatField(
                        blank=True, help_text="Seconds: watched by the overdue report.", null=True
                    ),
                ),
                ("atomic", models.BooleanField(default=False)),
                (
                    "alert_after",
                    models.BigIntegerField(
                        default=3,
                        help_text="Slots that must all have failed to flag the entry as failing.",
                    ),
                ),
                (
                    "created_at",
                    models.DateTimeField(
                        editable=False, help_text="By the database server's clock."
                    ),
                ),
                (
                    "updated_at",
                    models.DateTimeField(
                        editable=False, help_text="By the database server's clock."
                    ),
                ),
            ],
            options={
                "verbose_name": "stored schedule entry",
                "verbose_name_plural": "stored schedule entries",
                "db_table": "job_schedule_entries",
                "ordering": ["name"],
            },
        ),
        migrations.AlterField(
            model_name="jobcontrol",
            name="action",
            field=models.CharField(
                choices=[
                    ("pause", "pause"),
                    ("resume", "resume"),
                    ("run_now", "run now"),
                    ("change", "change of a stored entry"),
                ],
                max_length=16,
            ),
        ),
    ]
