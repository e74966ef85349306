from django.db import models


class Report(models.Model):
    """What the nightly job writes: one report a day."""

    day = models.CharField(max_length=10)
    created_at = models.DateTimeField(auto_now_add=True)
