from django.apps import AppConfig
from django.core.signals import request_finished
from django.core.signals import setting_changed
from django.db.backends.signals import connection_created


class AdvisoryLockConfig(AppConfig):
    name = "advisory_lock"
    verbose_name = "Advisory locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from advisory_lock import checks  # noqa: F401  (registers the system checks)
        from advisory_lock import metrics
        from advisory_lock.holds import connection_reopened
        from advisory_lock.holds import release_leftovers
        from advisory_lock.tasks import connect_start_signals

        request_finished.connect(release_leftovers, dispatch_uid="advisory_lock.leftovers")
        metrics.configure()
        setting_changed.connect(metrics.configure, dispatch_uid="advisory_lock.metrics")
        connection_created.connect(connection_reopened, dispatch_uid="advisory_lock.reopened")
        # A worker clears the pending marks of enqueue_unique() as it starts their tasks.
        connect_start_signals()
