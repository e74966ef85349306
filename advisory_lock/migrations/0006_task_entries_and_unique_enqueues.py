"""Task entries and unique enqueues: job_runs gets the "enqueued" status and the task_id of an
enqueued slot's task; task_pending holds the pending marks of enqueue_unique(). A new table, a
new column with a default (''), and a new choice (no change in the database)."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0005_control_room"),
    ]

    operations = [
        migrations.CreateModel(
            name="PendingTask",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "key_hash",
                    models.CharField(help_text="SHA-256 of the key.", max_length=64, unique=True),
                ),
                (
                    "key",
                    models.TextField(
                        help_text="The uniqueness key (by default the task and its arguments)."
                    ),
                ),
                ("task_name", models.CharField(max_length=255)),
                ("task_id", models.CharField(db_index=True, max_length=255)),
                ("enqueued_at", models.DateTimeField(help_text="By the database server's clock.")),
                ("expires_at", models.DateTimeField(help_text="By the database server's clock.")),
            ],
            options={
                "verbose_name": "pending task",
                "db_table": "task_pending",
            },
        ),
        migrations.AddField(
            model_name="jobrun",
            name="task_id",
            field=models.CharField(
                blank=True,
                help_text="An enqueued slot's task, as its queue names it.",
                max_length=255,
            ),
        ),
        migrations.AlterField(
            model_name="jobrun",
            name="status",
            field=models.CharField(
                choices=[
                    ("running", "running"),
                    ("succeeded", "succeeded"),
                    ("failed", "failed"),
                    ("abandoned", "abandoned"),
                    ("enqueued", "enqueued"),
                ],
                default="running",
                max_length=16,
            ),
        ),
    ]
