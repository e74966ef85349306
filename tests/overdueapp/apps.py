from django.apps import AppConfig


class OverdueAppConfig(AppConfig):
    """Installed only by tests/test_overdue.py (override_settings): its command declares a
    job, which every other test's overdue report would otherwise list."""

    name = "tests.overdueapp"
    label = "overdueapp"
