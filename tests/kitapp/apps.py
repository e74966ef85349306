from django.apps import AppConfig


class KitAppConfig(AppConfig):
    """What a project writes, tested with advisory_lock.testing (tests.py, and
    tests/test_testing_kit.py with pytest-django)."""

    name = "tests.kitapp"
    label = "kitapp"
    default_auto_field = "django.db.models.BigAutoField"
