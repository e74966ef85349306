from django.apps import AppConfig
from django.core.signals import request_finished


class AdvisoryLockConfig(AppConfig):
    name = "advisory_lock"
    verbose_name = "Advisory locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from advisory_lock import checks  # noqa: F401  (registers the system checks)
        from advisory_lock.locks import release_leftover_session_locks

        request_finished.connect(
            release_leftover_session_locks, dispatch_uid="advisory_lock.release_leftovers"
        )
