"""What the warehouse remembers between refreshes, and when it compacts.

**State.** High-water marks live in the DuckDB table ``warehouse_state``, one row per source
(and one for the provider events' deletion records), next to the models' fingerprint (a change
to a model's SQL file triggers a full build) and the count of deleted rows not compacted yet.
The rows are replaced as a whole in the refresh's own transaction.

**Compaction.** Replacing a row deletes its old version, which stays in its row group until a
checkpoint compacts it. A refresh's own commit never compacts (analysts would wait for it);
once the deleted rows add up to ``VACUUM_SHARE`` of the funnel, the next writer file is
compacted after the new snapshot is published, so the snapshot after next is compact.
"""

from datetime import UTC, datetime
from pathlib import Path

import duckdb

from email_platform.warehouse.build import FUNNEL, FUNNEL_DAILY
from email_platform.warehouse.files import connect, literal
from email_platform.warehouse.sources import SOURCES
from email_platform.warehouse.summary import RefreshSummary

STATE_TABLE = "warehouse_state"
# The state row counting the deleted rows not compacted yet (see vacuum_policy, compact).
UNVACUUMED_STATE = "unvacuumed_rows"
VACUUM_SHARE = 0.05
# Its first version had a primary key; touching that index first thing in a refresh cost
# 0.15-0.2 s on a 300 MB file. The few rows are replaced as a whole instead.
_OLD_STATE_TABLE = "warehouse_load_state"


def ensure_schema(connection: duckdb.DuckDBPyConnection) -> None:
    connection.execute(
        f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} ("
        "name VARCHAR NOT NULL, high_water_mark TIMESTAMP, value VARCHAR, "
        "rows_loaded BIGINT, loaded_at TIMESTAMP)"
    )
    tables = {row[0] for row in connection.execute("SHOW TABLES").fetchall()}
    if _OLD_STATE_TABLE in tables:
        connection.execute(f"INSERT INTO {STATE_TABLE} SELECT * FROM {_OLD_STATE_TABLE}")
        connection.execute(f"DROP TABLE {_OLD_STATE_TABLE}")
    for source in SOURCES:
        columns = ", ".join(f"{name} {kind}" for name, kind in source.columns)
        connection.execute(f"CREATE TABLE IF NOT EXISTS {source.raw_table} ({columns})")
    # A file from before a source grew columns (the outbox's trace fields): they are appended,
    # so the load's positional inserts line up. Its old rows keep NULL there, as the
    # operational rows of that time do. One catalog query, no ALTER when nothing is missing.
    present = set(
        connection.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_catalog = current_database() AND table_schema = 'main'"
        ).fetchall()
    )
    for source in SOURCES:
        for name, kind in source.columns:
            if (source.raw_table, name) not in present:
                connection.execute(f"ALTER TABLE {source.raw_table} ADD COLUMN {name} {kind}")


def load_state(connection: duckdb.DuckDBPyConnection) -> dict[str, datetime]:
    rows = connection.execute(
        f"SELECT name, high_water_mark FROM {STATE_TABLE} WHERE high_water_mark IS NOT NULL"
    ).fetchall()
    return {name: mark.replace(tzinfo=UTC) for name, mark in rows}


def vacuum_policy(
    connection: duckdb.DuckDBPyConnection,
    summary: RefreshSummary,
    deleted_before: int,
    rebuild: bool,
) -> int:
    """Keep the refresh's own commit from compacting; returns the deleted rows left
    uncompacted after it (``compact`` removes them once they add up).

    Compacting (DuckDB's vacuum) rewrites whole row groups to drop the rows a refresh replaced
    (the funnel rows of touched messages, changed messages). A realistic refresh at 1M messages
    replaces ~28,000 funnel rows, so a commit allowed to compact did so every second refresh,
    for 0.3-0.5 s that analysts waited for. Deleted rows cost nothing but space (a scan skips
    them) until they are compacted after publishing; a full build starts from compact tables.
    """
    if rebuild:
        connection.execute("RESET max_vacuum_tasks")
        return 0
    connection.execute("SET max_vacuum_tasks = 0")
    return deleted_before + summary.rows_deleted


def needs_compacting(summary: RefreshSummary, unvacuumed: int) -> bool:
    return unvacuumed > VACUUM_SHARE * summary.table_rows.get(FUNNEL, 0)


def compact(path: Path) -> None:
    """Compact the deleted rows out of a warehouse file no reader holds (the next writer file,
    after publishing): what the refresh's commit left undone, off the path to visibility.

    DuckDB compacts a table's row groups only in a checkpoint that writes the table, and a
    checkpoint writes only tables changed since the last one; so each table is changed by
    taking its last row out and putting the same row back, which leaves its content and order
    as they were. One transaction: a crash leaves the file as it was, still uncompacted, and
    the next refresh's publish compacts it then.
    """
    # DuckDB's own row group size: the vacuum merges the refreshes' small row groups into it.
    connection = connect(path, read_only=False, whole=True)
    try:
        connection.execute("RESET max_vacuum_tasks")
        # Off the path to visibility, the row groups it rewrites keep the full build's FSST
        # strings (without it a compaction grew the file it was to shrink).
        connection.execute("RESET disabled_compression_methods")
        connection.execute("BEGIN TRANSACTION")
        for table in (*(source.raw_table for source in SOURCES), FUNNEL, FUNNEL_DAILY):
            last = f"(SELECT max(rowid) FROM {table})"
            connection.execute(
                f"CREATE OR REPLACE TEMP TABLE _last AS SELECT * FROM {table} WHERE rowid = {last}"
            )
            connection.execute(f"DELETE FROM {table} WHERE rowid = {last}")
            connection.execute(f"INSERT INTO {table} SELECT * FROM _last")
        connection.execute(
            f"UPDATE {STATE_TABLE} SET value = '0' WHERE name = {literal(UNVACUUMED_STATE)}"
        )
        connection.execute("COMMIT")  # checkpoints, compacting as it writes each table
    finally:
        connection.close()


def state_value(connection: duckdb.DuckDBPyConnection, name: str) -> str | None:
    row = connection.execute(
        f"SELECT value FROM {STATE_TABLE} WHERE name = {literal(name)}"
    ).fetchone()
    return row[0] if row else None


def save_state(
    connection: duckdb.DuckDBPyConnection,
    summary: RefreshSummary,
    fingerprint: str,
    unvacuumed: int,
) -> None:
    now = datetime.now(UTC).replace(tzinfo=None)
    rows = [
        (name, _naive(mark), None, summary.rows_loaded.get(name, 0), now)
        for name, mark in summary.high_water_marks.items()
    ]
    rows.append(("models", None, fingerprint, summary.messages_rebuilt, now))
    rows.append((UNVACUUMED_STATE, None, str(unvacuumed), summary.rows_deleted, now))
    connection.execute(f"DELETE FROM {STATE_TABLE}")
    values = ", ".join("(" + ", ".join(literal(v) for v in row) + ")" for row in rows)
    connection.execute(f"INSERT INTO {STATE_TABLE} VALUES {values}")


def _naive(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value
