"""Batch statements the store modules share: one statement per batch, whatever its size.

On PostgreSQL a batch travels as one parameter whatever its size, so the SQL text stays the same,
psycopg parses it once and the server prepares it once. An IN list or a multi-row VALUES has one
placeholder per value instead, and psycopg re-parses that text on every call (a few microseconds
per placeholder, most of the cost of a batch insert); an executemany runs one statement per row
on the server. SQLite keeps the portable forms.

Rows go as one JSON document read back by ``json_to_recordset``: orjson encodes it in C,
datetimes included, while psycopg dumps an array parameter element by element in Python, which
cost about twice the client CPU per 1,000-row insert. Rows JSON cannot carry exactly (a JSON
column, a float that is not finite, a value of another type) go as one array per column.
"""

import datetime
import math
from collections.abc import Sequence
from typing import Any

import orjson
from sqlalchemy import (
    Boolean,
    ColumnElement,
    Connection,
    DateTime,
    Float,
    Integer,
    String,
    Table,
    TableValuedAlias,
    Text,
    any_,
    bindparam,
    cast,
    column,
    func,
    insert,
    or_,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import JSON as PG_JSON


def on_postgresql(connection: Connection) -> bool:
    return connection.dialect.name == "postgresql"


#: Ids one statement takes. SQLite's IN list has a placeholder per id (older builds allow 999 in
#: all); PostgreSQL's array is one parameter, so a lane's whole batch goes in one statement
#: instead of one per 500, each a round trip and an index walk of its own.
IDS_PER_STATEMENT = {"postgresql": 5000}
IDS_PER_STATEMENT_DEFAULT = 500


def ids_per_statement(connection: Connection) -> int:
    """How many ids ``one_of`` should get at once on this connection's database."""
    return IDS_PER_STATEMENT.get(connection.dialect.name, IDS_PER_STATEMENT_DEFAULT)


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


#: Column types whose values JSON carries exactly (strings, whole numbers, booleans, finite
#: floats, and datetimes as ISO 8601 text the server parses back to the same instant).
_JSON_SAFE = (String, Integer, Float, Boolean, DateTime)


def _as_json(rows: Sequence[dict[str, Any]], types: dict[str, Any]) -> str | None:
    """``rows`` as one JSON array, or None where JSON would not carry every value exactly.

    orjson writes a float that is not finite as null (PostgreSQL's JSON has no NaN) and an
    offset's seconds not at all, so the Float and DateTime columns (``types``: column name to
    SQL type) are looked at first; it refuses a lone surrogate, an integer past 64 bits and a
    type it does not know, which then go as arrays (where psycopg refuses the surrogate, as the
    database would). Other columns hold their own type's values (strings, whole numbers,
    booleans), which JSON carries as they are.
    """
    for name, type_ in types.items():
        odd = (
            _not_finite
            if isinstance(type_, Float)
            else _odd_offset
            if isinstance(type_, DateTime)
            else None
        )
        if odd is not None and any(odd(row.get(name)) for row in rows):
            return None
    try:
        return orjson.dumps(rows).decode()
    except TypeError:  # orjson.JSONEncodeError
        return None


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _odd_offset(value: Any) -> bool:
    """A datetime whose UTC offset has seconds (a historical local mean time): orjson drops them."""
    if not isinstance(value, datetime.datetime) or value.tzinfo in (None, datetime.UTC):
        return False
    offset = value.utcoffset()
    return offset is not None and offset % datetime.timedelta(minutes=1) != datetime.timedelta(0)


def _record_type(table_column: Any) -> Any:
    item = _array_of(table_column).item_type
    return item if isinstance(item, _JSON_SAFE) else None


def unnest(
    table: Table, columns: Sequence[str], rows: Sequence[dict[str, Any]]
) -> TableValuedAlias:
    """PostgreSQL only: ``rows`` as a FROM-able row source with ``columns``.

    ``json_to_recordset(document) AS t(column type, ...)`` where every value fits JSON, else
    ``unnest(array, ...) AS t(columns)``.
    """
    types = [_record_type(table.c[name]) for name in columns]
    document = (
        _as_json(rows, dict(zip(columns, types, strict=True)))
        if all(t is not None for t in types)
        else None
    )
    if document is not None:
        source = func.json_to_recordset(cast(bindparam(None, document, type_=Text), PG_JSON))
        return source.table_valued(
            *(column(name, type_) for name, type_ in zip(columns, types, strict=True))
        ).render_derived(with_types=True)
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
