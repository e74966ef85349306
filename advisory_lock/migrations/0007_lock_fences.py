"""Fencing tokens: lock_fences holds the last token issued for each key that was taken with
advisory_lock(..., fencing=True). A new table only."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0006_task_entries_and_unique_enqueues"),
    ]

    operations = [
        migrations.CreateModel(
            name="LockFence",
            fields=[
                ("key", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("name", models.CharField(max_length=200)),
                ("token", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "lock fence",
                "db_table": "lock_fences",
            },
        ),
    ]
