from django.apps import AppConfig


class LockAppConfig(AppConfig):
    name = "tests.lockapp"
    label = "lockapp"
