"""The servers the benchmark scripts use: raw-driver parameters and Django's DATABASES for them."""

from __future__ import annotations

from typing import Any

PG = "postgresql"
MY = "mysql"
PG_PARAMS = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
MY_PARAMS = {"host": "127.0.0.1", "port": 3306, "user": "root", "database": "test"}


def databases(default: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """DATABASES with the aliases PG and MY on the same servers and databases as the raw
    drivers (Django connects lazily: an alias a script does not use costs nothing)."""
    return {
        "default": default or {},
        PG: {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": PG_PARAMS["dbname"],
            "USER": PG_PARAMS["user"],
            "HOST": PG_PARAMS["host"],
            "PORT": str(PG_PARAMS["port"]),
        },
        MY: {
            "ENGINE": "django.db.backends.mysql",
            "NAME": MY_PARAMS["database"],
            "USER": MY_PARAMS["user"],
            "HOST": MY_PARAMS["host"],
            "PORT": str(MY_PARAMS["port"]),
            "OPTIONS": {"charset": "utf8mb4"},
        },
    }
