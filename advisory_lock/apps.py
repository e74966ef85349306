"""The app: the ledger's models and migrations, the admin, the commands and the system checks.

Locks and ``@single_instance`` without a ledger work without it in INSTALLED_APPS: what they
need connects when they load (``advisory_lock.holds``), not in ``ready()``.
"""

from django.apps import AppConfig
from django.core.signals import setting_changed


class AdvisoryLockConfig(AppConfig):
    name = "advisory_lock"
    verbose_name = "Advisory locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from advisory_lock import checks  # noqa: F401  (registers the system checks)
        from advisory_lock import metrics
        from advisory_lock.tasks import connect_start_signals

        metrics.configure()
        setting_changed.connect(metrics.configure, dispatch_uid="advisory_lock.metrics")
        # A worker clears the pending marks of enqueue_unique() as it starts their tasks.
        connect_start_signals()
