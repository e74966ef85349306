"""The control room of the scheduled jobs: operators' requests (pause, resume, run now;
``job_controls``, with the permissions that allow them) and the schedulers' heartbeats
(``job_schedulers``). New tables only: nothing existing changes."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0004_one_success_per_slot"),
    ]

    operations = [
        migrations.CreateModel(
            name="JobControl",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "job_name",
                    models.CharField(help_text="The SCHEDULE entry's name.", max_length=200),
                ),
                (
                    "action",
                    models.CharField(
                        choices=[("pause", "pause"), ("resume", "resume"), ("run_now", "run now")],
                        max_length=16,
                    ),
                ),
                (
                    "requested_at",
                    models.DateTimeField(help_text="By the database server's clock."),
                ),
                ("requested_by", models.CharField(blank=True, max_length=255)),
                (
                    "slot",
                    models.CharField(
                        blank=True, help_text="Run now: the ledger slot of the run.", max_length=64
                    ),
                ),
            ],
            options={
                "verbose_name": "job control",
                "db_table": "job_controls",
                "ordering": ["-requested_at", "-pk"],
                "permissions": [
                    ("pause_job", "Can pause and resume scheduled jobs"),
                    ("run_job_now", "Can run a scheduled job now"),
                ],
                "indexes": [
                    models.Index(
                        fields=["job_name", "action", "-requested_at"], name="job_controls_idx"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="SchedulerHeartbeat",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("host", models.CharField(max_length=255)),
                ("pid", models.IntegerField()),
                ("started_at", models.DateTimeField(help_text="By the database server's clock.")),
                ("last_seen", models.DateTimeField(help_text="By the database server's clock.")),
                ("version", models.CharField(blank=True, max_length=64)),
            ],
            options={
                "verbose_name": "scheduler heartbeat",
                "db_table": "job_schedulers",
                "ordering": ["-last_seen"],
                "indexes": [models.Index(fields=["-last_seen"], name="job_schedulers_seen_idx")],
            },
        ),
    ]
