"""The lock directory: lock_names (the name behind each database key) and lock_clients (the
client process behind each server session), written by the holders for the inspector. New
tables only."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0008_operator_console_runs"),
    ]

    operations = [
        migrations.CreateModel(
            name="LockName",
            fields=[
                ("key", models.CharField(max_length=255, primary_key=True, serialize=False)),
                ("name", models.TextField()),
                ("namespace", models.CharField(max_length=64)),
            ],
            options={
                "verbose_name": "lock name",
                "db_table": "lock_names",
            },
        ),
        migrations.CreateModel(
            name="LockClient",
            fields=[
                ("session", models.BigIntegerField(primary_key=True, serialize=False)),
                ("started", models.BigIntegerField()),
                ("host", models.CharField(max_length=255)),
                ("pid", models.BigIntegerField()),
            ],
            options={
                "verbose_name": "lock client",
                "db_table": "lock_clients",
            },
        ),
    ]
