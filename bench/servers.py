"""The servers the benchmark scripts use: raw-driver parameters and Django's DATABASES for them."""

from __future__ import annotations

from typing import Any

PG = "postgresql"
MY = "mysql"
PG_PARAMS = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "test"}
MY_PARAMS = {"host": "127.0.0.1", "port": 3306, "user": "root", "database": "test"}


def create_database(server: str, name: str) -> None:
    """Drop the database ``name`` on ``server`` (PG or MY) if it exists, and create it."""
    if server == PG:
        import psycopg

        with psycopg.connect(**{**PG_PARAMS, "dbname": "postgres"}, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name}")
            conn.execute(f"CREATE DATABASE {name}")
    else:
        import MySQLdb

        conn = MySQLdb.connect(**{**MY_PARAMS, "database": "mysql"})
        cursor = conn.cursor()
        cursor.execute(f"DROP DATABASE IF EXISTS {name}")
        cursor.execute(f"CREATE DATABASE {name} CHARACTER SET utf8mb4")
        conn.close()


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


#: The settings module of the ``run_jobs`` processes the scheduler benchmarks start: the
#: database from $DATABASE_URL, the schedule from $SCHEDULE (JSON).
SCHEDULER_SETTINGS = """
import json
import os

from testproject.database_url import parse

SECRET_KEY = "bench"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "advisory_lock"]
DATABASES = {"default": parse(os.environ["DATABASE_URL"], None)}
ADVISORY_LOCK = {"NAMESPACE": "bench", "SCHEDULE": json.loads(os.environ["SCHEDULE"])}
"""
