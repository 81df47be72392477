"""Temp views that stand in for tables and views while a model is built over part of them.

DuckDB binds the unqualified names inside a view when it is queried, temp schema first, so
the staging views and the model SQL run unchanged over the rows a temp view of the same name
selects.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import duckdb


@contextmanager
def temp_views(connection: duckdb.DuckDBPyConnection, views: dict[str, str]) -> Iterator[None]:
    """A temp view per name, selecting what its value says, for the duration of the block."""
    created = []
    try:
        for name, select in views.items():
            connection.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {select}")
            created.append(name)
        yield
    finally:
        for name in reversed(created):
            connection.execute(f"DROP VIEW IF EXISTS temp.main.{name}")


def main_table(connection: duckdb.DuckDBPyConnection, name: str) -> str:
    """``name`` in the database's own main schema, past any temp view of that name. Fully
    qualified: inside the temp catalog, a bare ``main.`` names the temp schema itself."""
    database = connection.execute("SELECT current_database()").fetchone()[0]
    return f'"{database}".main.{name}'


@contextmanager
def shadowed(connection: duckdb.DuckDBPyConnection, filters: dict[str, str]) -> Iterator[None]:
    """Shadow each named table with a temp view of only its rows matching the filter, for the
    duration of the block: the staging views and the model SQL then run over the rows that can
    change instead of aggregating everything and filtering afterwards (the filter does not push
    through their GROUP BYs). Views, not tables: each reader then scans only the columns it
    needs, and zone maps skip the row groups the filter rules out."""
    with temp_views(
        connection,
        {
            table: f"SELECT * FROM {main_table(connection, table)} WHERE {condition}"
            for table, condition in filters.items()
        },
    ):
        yield
