"""The operator's console: why an operator paused an entry or asked for a run
(job_controls.reason), and when a scheduler first loaded each scheduled entry
(job_entries_seen). A new column with a default, and a new table only."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0007_lock_fences"),
    ]

    operations = [
        migrations.AddField(
            model_name="jobcontrol",
            name="reason",
            field=models.CharField(
                blank=True, help_text="Why, in the operator's words.", max_length=500
            ),
        ),
        migrations.CreateModel(
            name="EntrySeen",
            fields=[
                (
                    "job_name",
                    models.CharField(
                        help_text="The SCHEDULE entry's name.",
                        max_length=200,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                ("first_seen", models.DateTimeField(help_text="By the database server's clock.")),
            ],
            options={
                "verbose_name": "scheduled entry first seen",
                "verbose_name_plural": "scheduled entries first seen",
                "db_table": "job_entries_seen",
            },
        ),
    ]
