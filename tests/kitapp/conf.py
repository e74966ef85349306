"""The app's database: ``KITAPP_DATABASE`` (default "default"), read when used."""

from django.conf import settings


def database() -> str:
    return getattr(settings, "KITAPP_DATABASE", "default")
