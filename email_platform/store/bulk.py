"""Batch statements the store modules share: one statement per batch, whatever its size.

On PostgreSQL a batch travels as one array per column: the SQL text stays the same whatever the
batch size, so psycopg parses it once and the server prepares it once. An IN list or a multi-row
VALUES has one placeholder per value instead, and psycopg re-parses that text on every call (a
few microseconds per placeholder, most of the cost of a batch insert); an executemany runs one
statement per row on the server. SQLite keeps the portable forms.
"""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    String,
    Table,
    TableValuedAlias,
    Text,
    any_,
    bindparam,
    cast,
    func,
    insert,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY


def on_postgresql(connection: Connection) -> bool:
    return connection.dialect.name == "postgresql"


def _array_of(column: Any) -> ARRAY:
    item = column.type
    if isinstance(item, String) and item.length is not None:
        # The array is cast explicitly, and an explicit cast to VARCHAR(n) truncates: an
        # over-long value would match or be stored cut short instead of being refused.
        item = String()
    return ARRAY(item)


def one_of(connection: Connection, column: Any, values: Sequence[Any]) -> ColumnElement[bool]:
    """``column IN (values)``: ``column = ANY(array)`` on PostgreSQL."""
    if on_postgresql(connection):
        return column == any_(bindparam(None, list(values), type_=_array_of(column)))
    return column.in_(list(values))


def unnest(
    table: Table, columns: Sequence[str], rows: Sequence[dict[str, Any]]
) -> TableValuedAlias:
    """PostgreSQL only: ``rows`` as a FROM-able ``unnest(array, ...) AS t(columns)``."""
    arrays = [
        bindparam(None, [row.get(name) for row in rows], type_=_array_of(table.c[name]))
        for name in columns
    ]
    return func.unnest(*arrays).table_valued(*columns).render_derived()


def insert_rows(connection: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert ``rows`` with one statement (PostgreSQL) or one executemany (SQLite)."""
    if not rows:
        return
    if on_postgresql(connection):
        columns = sorted(set().union(*(row.keys() for row in rows)))
        source = unnest(table, columns, rows)
        connection.execute(
            insert(table).from_select(columns, select(*(source.c[name] for name in columns)))
        )
    else:
        connection.execute(insert(table), list(rows))


def rows_for_events(connection: Connection, table: Table, event_ids: Sequence[str]) -> list[Any]:
    """Every row of ``table`` (any table with an ``event_id``) that belongs to these events."""
    rows: list[Any] = []
    for start in range(0, len(event_ids), 500):
        chunk = list(event_ids[start : start + 500])
        rows.extend(
            connection.execute(
                select(table).where(one_of(connection, table.c.event_id, chunk))
            ).all()
        )
    return rows


def rows_in(connection: Connection, table: Table, column: str, values: Sequence[Any]) -> list[Any]:
    """Every row of ``table`` whose ``column`` is one of ``values`` (500 to a statement)."""
    rows: list[Any] = []
    ordered = sorted(set(values))
    for start in range(0, len(ordered), 500):
        chunk = ordered[start : start + 500]
        rows.extend(
            connection.execute(select(table).where(one_of(connection, table.c[column], chunk)))
        )
    return rows


def text_holds_any(column: Any, terms: Sequence[str]) -> ColumnElement[bool]:
    """``column``'s text (JSON as written) holds one of ``terms``, in any case.

    A scan, not an index lookup: erasure's coarse first filter, which the caller confirms.
    """
    text = func.lower(cast(column, Text))
    return or_(*(text.like(f"%{_like_escaped(term.lower())}%", escape="\\") for term in terms))


def _like_escaped(term: str) -> str:
    return term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
