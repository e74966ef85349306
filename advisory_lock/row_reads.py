"""The reads that every scheduler makes at every batch of due slots and at every look for
requests, written without the ORM's query compiler.

Built through ``QuerySet.filter()``, these reads were most of a scheduler's own Python at a
boundary, and the look for requests most of it while idle: the ``__in`` lookup prepares each
of up to 500 job names, and the compiler builds the same statement several times a second
(``bench/scheduler_reads.py`` sets them against the driver). The SQL here is the one the ORM
sends, named from the models' documented metadata (``Meta.db_table``; a field's name, unless
it sets ``db_column``), quoted by the connection, each parameter converted by its field
(``Field.get_db_prep_value()``, as a lookup's is). Only columns whose values the drivers
return as Django would are read back: text, integers, and whether a value is NULL.
"""

from __future__ import annotations

from collections.abc import Collection
from collections.abc import Sequence
from typing import Any

from django.db import connections
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.row_writes import column_of


class Names:
    """The quoted names of ``model``'s table and columns on ``connection``."""

    def __init__(self, model: type[models.Model], connection: BaseDatabaseWrapper) -> None:
        self.model, self.connection = model, connection
        self.table = connection.ops.quote_name(model._meta.db_table)

    def __getitem__(self, field: str) -> str:
        """The quoted column of the field named ``field`` (``pk``: the primary key's)."""
        meta = self.model._meta
        return self.connection.ops.quote_name(
            column_of(meta.pk if field == "pk" else meta.get_field(field))
        )

    def param(self, field: str, value: Any) -> Any:
        """``value`` as a parameter compared with the field named ``field``."""
        return self.model._meta.get_field(field).get_db_prep_value(  # type: ignore[union-attr]
            value, self.connection
        )


def placeholders(count: int) -> str:
    """``count`` parameters' placeholders, for ``IN (...)``."""
    return ", ".join(["%s"] * count)


def rows_in(
    model: type[models.Model], using: str, columns: Sequence[str], **lists: Collection[str]
) -> list[tuple[Any, ...]]:
    """The ``columns`` (field names) of ``model``'s rows on ``using`` whose text field
    ``name`` is one of ``lists[name]``, for each name: one statement, none if a list is
    empty. The values as the driver returns them."""
    if not all(lists.values()):
        return []
    names = Names(model, connections[using])
    where = " AND ".join(
        f"{names[field]} IN ({placeholders(len(values))})" for field, values in lists.items()
    )
    sql = f"SELECT {', '.join(names[field] for field in columns)} FROM {names.table} WHERE {where}"
    params = [value for values in lists.values() for value in values]
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())
