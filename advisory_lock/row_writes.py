"""The ledger's two writes per run, each one statement built without the ORM's query
compiler: the INSERT of a claim and the fenced UPDATE of an end.

A scheduler's workers claim and end hundreds of slots a second; building the same two
statements through ``QuerySet.create()`` and ``QuerySet.update()`` each time was most of a
run's Python (``bench/run_path.py``). The statements are the ones the ORM sends, written from
the model's documented metadata: its table (``Meta.db_table``), its fields' columns (a field's
name, unless it sets ``db_column``), each value converted for the database by the field itself
(``Field.get_db_prep_save()``, as ``save()`` and ``update()`` do). Like ``update()``, neither
sends ``pre_save`` or ``post_save``.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import TypeVar

from django.db import connections
from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

from advisory_lock.backends import inspector_for

M = TypeVar("M", bound=models.Model)


def column_of(field: Any) -> str:
    """The column of a concrete, non-relational ``field``: Django names it after the field
    unless ``db_column`` says otherwise."""
    return str(field.db_column or field.name)


@functools.cache
def _columns(model: type[models.Model]) -> tuple[list[Any], list[Any], Any]:
    """``model``'s fields with a column, those an INSERT writes (all but its key and its
    generated columns, which the database fills), and its key."""
    concrete: list[Any] = [field for field in model._meta.get_fields() if field.concrete]
    written = [field for field in concrete if not field.primary_key and not field.generated]
    (key,) = [field for field in concrete if field.primary_key]
    return concrete, written, key


#: The statements built, by model, database vendor (whose quoting they use: the same for
#: every alias and connection of that database) and what they write.
_statements: dict[tuple[Any, ...], str] = {}


def _insert_sql(model: type[models.Model], connection: BaseDatabaseWrapper) -> str:
    """The INSERT of a row of ``model``."""
    built = _statements.get((model, connection.vendor))
    if built is None:
        built = _statements[model, connection.vendor] = _build_insert(model, connection)
    return built


def _build_insert(model: type[models.Model], connection: BaseDatabaseWrapper) -> str:
    quote = connection.ops.quote_name
    _, written, _ = _columns(model)
    return (
        f"INSERT INTO {quote(model._meta.db_table)} "
        f"({', '.join(quote(column_of(field)) for field in written)}) "
        f"VALUES ({', '.join(['%s'] * len(written))})"
    )


def insert_row(model: type[M], using: str, **values: Any) -> M:
    """INSERT one row of ``model`` on ``using``, its fields ``values`` and the others their
    defaults, and return it as ``QuerySet.create()`` would (its key read back, its generated
    columns None). ``IntegrityError`` if a constraint refuses it."""
    connection = connections[using]
    quote = connection.ops.quote_name
    concrete, written, key = _columns(model)
    row = model(**values)
    params = [field.get_db_prep_save(getattr(row, field.name), connection) for field in written]
    with connection.cursor() as cursor:
        pk = inspector_for(connection).insert_returning_pk(
            cursor, _insert_sql(model, connection), params, quote(column_of(key))
        )
    # The row as loaded from the database (``Model.from_db``): saved, on ``using``.
    loaded = {key.name: pk, **{field.name: getattr(row, field.name) for field in written}}
    return model.from_db(
        using,
        [field.name for field in concrete],
        [loaded.get(field.name) for field in concrete],
    )


def update_row_while(
    model: type[models.Model], using: str, pk: Any, field: str, value: str, **written: Any
) -> int:
    """UPDATE the columns ``written`` of ``model``'s row ``pk`` on ``using``, if its text
    ``field`` is ``value`` then; the number of rows updated (0 or 1).

    The row is found by its primary key alone: ``field`` is compared through an expression
    (``COALESCE(field, '')``) that no index can serve. Compared as a column, MariaDB's
    optimizer may read ``id = ... AND status = 'running'`` through an index of that column
    when few rows match (EXPLAIN: ``range``), and InnoDB keeps a lock on every index entry a
    locking read or UPDATE has read until its transaction ends: a transaction that updates
    its row first (an atomic run's) would then hold the entries of the other matching rows,
    blocking their own fenced UPDATEs and deadlocking them (error 1213). Through the primary
    key an UPDATE locks its own row only."""
    connection = connections[using]
    statement = (model, connection.vendor, field, *written)
    sql = _statements.get(statement)
    if sql is None:
        sql = _statements[statement] = _build_update(model, connection, field, tuple(written))
    params = [
        model._meta.get_field(name).get_db_prep_save(new, connection)  # type: ignore[union-attr]
        for name, new in written.items()
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, pk, value])
        return int(cursor.rowcount)


def _build_update(
    model: type[models.Model],
    connection: BaseDatabaseWrapper,
    field: str,
    written: tuple[str, ...],
) -> str:
    quote = connection.ops.quote_name
    meta = model._meta
    _, _, key = _columns(model)
    assignments = ", ".join(f"{quote(column_of(meta.get_field(name)))} = %s" for name in written)
    fence = quote(column_of(meta.get_field(field)))
    return (
        f"UPDATE {quote(meta.db_table)} SET {assignments} "
        f"WHERE {quote(column_of(key))} = %s AND COALESCE({fence}, '') = %s"
    )
