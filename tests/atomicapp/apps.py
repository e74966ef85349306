from django.apps import AppConfig


class AtomicAppConfig(AppConfig):
    """Installed only by tests/test_atomic_runs.py (override_settings): its command is
    misconfigured on purpose, which the system checks of every other test would report."""

    name = "tests.atomicapp"
    label = "atomicapp"
