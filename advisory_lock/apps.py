from django.apps import AppConfig


class AdvisoryLockConfig(AppConfig):
    name = "advisory_lock"
    verbose_name = "Advisory locks"
    default_auto_field = "django.db.models.BigAutoField"
