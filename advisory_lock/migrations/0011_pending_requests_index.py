"""An index for the schedulers' look for run-now requests and changes of stored entries: the
recent rows of two actions, of every job (job_controls keeps every request)."""

from django.db import migrations
from django.db import models


class Migration(migrations.Migration):
    dependencies = [
        ("advisory_lock", "0010_stored_schedule_entries"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="jobcontrol",
            index=models.Index(fields=["action", "requested_at"], name="job_controls_pending_idx"),
        ),
    ]
