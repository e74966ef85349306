"""Turn ``DATABASE_URL`` (postgres://, mysql://, sqlite://) into a Django DATABASES entry."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote
from urllib.parse import urlsplit

ENGINES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
    "mariadb": "django.db.backends.mysql",
    "sqlite": "django.db.backends.sqlite3",
}


def parse(url: str, default_sqlite: Path) -> dict:
    """Parse a database URL; ``sqlite://`` alone means the default SQLite file."""
    parts = urlsplit(url)
    if parts.scheme not in ENGINES:
        raise ValueError(f"DATABASE_URL scheme must be one of {sorted(ENGINES)}: {url!r}")
    engine = ENGINES[parts.scheme]
    if parts.scheme == "sqlite":
        path = parts.path.removeprefix("/") if parts.netloc == "" else parts.netloc + parts.path
        return {"ENGINE": engine, "NAME": path or str(default_sqlite)}
    return {
        "ENGINE": engine,
        "NAME": unquote(parts.path.lstrip("/")),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
